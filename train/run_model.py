"""A run's model, rebuilt the one way for every use: a fresh run, ``--resume``, export and
generate. A run's model is its base (a preset's draws at the run's seed, or an
``--init-from`` HF folder) with the settings the run put over that base's config, and
its LoRA adapters if it trains some. Building it in one place keeps the three from
drifting apart (an export that forgot the run's expert capacity refused a model it had
trained). ``checkpoint_model`` is that model read back from a run's checkpoint, for
``train/generate.py`` and ``train/export.py`` alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from flax_tp.lora import LoRAConfig
from models.config import TransformerConfig
from models.execution import Execution
from models.transformer import Transformer
from train.errors import UsageError

# The config fields a run sets whatever its base's config says (``ModelJob.overrides``).
RUN_FIELDS = ("max_seq_len", "dropout", "dtype")
EXPERT_RUN_FIELDS = ("expert_capacity_factor", "expert_drop_policy")


def run_overrides(cfg: TransformerConfig) -> dict[str, Any]:
  """The fields of a run's ``cfg`` that the run put over its base's config: the
  sequence length, dropout and dtype, and a model with experts its capacity and drop
  policy (a dense model has none to set)."""
  fields = RUN_FIELDS + (EXPERT_RUN_FIELDS if cfg.has_experts else ())
  return {name: getattr(cfg, name) for name in fields}


def build_run_model(cfg: TransformerConfig, *, mesh: Mesh, seed: int,
                    init_from: str | Path | None = None, lora: LoRAConfig | None = None,
                    execution: Execution = Execution()) -> Transformer:
  """The run's model on ``mesh``: ``init_from``'s weights with ``cfg``'s run settings
  over its config (``load_hf``), or ``cfg``'s draws at ``seed``; with ``lora``'s fresh
  adapters. ``ValueError`` / ``OSError`` for a folder that is not such a model."""
  if init_from is not None:
    from models.hf import load_hf  # reads safetensors: only where a folder is loaded
    return load_hf(init_from, mesh, seed=seed, execution=execution, lora=lora,
                   **run_overrides(cfg))
  return Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed), execution=execution, lora=lora)


def lora_of_run(run: dict[str, Any]) -> LoRAConfig | None:
  """The ``LoRAConfig`` a run's record (a checkpoint's ``run``) says it trained, or None."""
  settings = run.get("lora")
  if not settings:
    return None
  from train.job import LoRAJob
  return LoRAJob(**settings).config(int(run.get("seed", 0)))


def decoding() -> Execution:
  """The ``Execution`` generate and export build with: no pipeline on a mesh's stage axis
  (the decoder and the export run the layers one by one; every stage holds them all)."""
  return Execution(pipelined=False)


def checkpoint_model(checkpoint: str, step: int | None, mesh: Mesh, *,
                     dtype: str | None = None):
  """(model, tokenizer, eos ids) of a ``train/run.py`` checkpoint directory at ``step``
  (None: its latest), built as the run built it (``decoding()``'s execution) on ``mesh``;
  ``dtype`` over the run's compute dtype. A bad or diverged checkpoint is a
  ``UsageError`` naming ``--checkpoint``."""
  from flax_tp.checkpoint import Checkpointer, CheckpointError
  from flax_tp.checkpoint.checkpointer import non_finite
  from flax_tp.checkpoint.keys import flat_leaves
  from models.config import FLAT_FIELDS
  from train.data import ByteTokenizer, HFTokenizer
  from train.hf_folder import eos_ids
  checkpointer = Checkpointer(checkpoint)
  try:
    meta = checkpointer.read_meta(step)
  except CheckpointError as err:
    raise UsageError(f"--checkpoint: {err}") from None
  run = meta.get("run") or {}
  config = run.get("config") or meta.get("config")
  if not isinstance(config, dict):
    raise UsageError(f"--checkpoint {checkpoint!r}: the checkpoint records no model config")
  config = {k: v for k, v in config.items() if k in FLAT_FIELDS}
  if dtype:
    config["dtype"] = dtype
  try:
    cfg = TransformerConfig.from_identity(config)
  except (TypeError, ValueError) as err:
    raise UsageError(f"--checkpoint {checkpoint!r}: bad model config: {err}") from None
  # The run's --seq-len is how long it trained, not how long a context its model takes:
  # the base's (its HF config's, or its preset's), as an export writes it.
  cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, _base_context(run)))
  name = run.get("tokenizer", "bytes")
  if name == "bytes":
    tokenizer = ByteTokenizer()
  else:
    path = Path(run.get("init_from") or "") / "tokenizer.json"
    if not path.is_file():
      raise UsageError(f"--checkpoint {checkpoint!r}: its run's tokenizer ({name}) was "
                       f"{str(path)!r}, which is gone")
    tokenizer = HFTokenizer(path)
    if tokenizer.name != name:
      raise UsageError(f"--checkpoint {checkpoint!r}: {str(path)!r} changed since the run "
                       f"(it is {tokenizer.name}, the run used {name})")
  model = _model_of_run(checkpoint, run, cfg, mesh)
  # A LoRA run's checkpoint holds its adapters alone, on the base rebuilt above.
  held = nnx.LoRAParam if model.lora is not None else nnx.Param
  try:
    restored, _ = checkpointer.restore({"params": nnx.state(model, held)}, step)
  except CheckpointError as err:
    raise UsageError(f"--checkpoint: {err}") from None
  bad = non_finite(flat_leaves(restored))
  if bad:  # saved before flax_tp refused to save a diverged run's state
    raise UsageError(f"--checkpoint {checkpoint!r}: step {meta.get('step', step)} "
                     f"holds NaN or infinity in {len(bad)} param(s) ({bad[0]}, ...): the run "
                     "diverged; use an earlier --step")
  nnx.update(model, restored["params"])
  eos = eos_ids(Path(run["init_from"])) if run.get("init_from") else []
  return model, tokenizer, eos


def _base_context(run: dict) -> int:
  """The positions the model a run started from takes: its ``--init-from`` folder's
  ``max_position_embeddings``, or its preset's ``max_seq_len`` (0 when neither is known)."""
  if run.get("init_from"):
    from models.hf import read_config
    try:
      return read_config(run["init_from"]).max_seq_len
    except (OSError, ValueError):
      return 0  # (a base that is gone or changed is named where the model is built)
  preset = run.get("preset")
  return (TransformerConfig.preset(preset).max_seq_len
          if preset in TransformerConfig.preset_names() else 0)


def _model_of_run(checkpoint: str, run: dict, cfg: TransformerConfig, mesh: Mesh):
  """The model a checkpoint's params go into, built as the run built it: the config's,
  or for a LoRA run its base (``--init-from``'s folder, checked to be the model the run
  trained, or the preset's draws at the run's seed) with the run's adapters."""
  lora = lora_of_run(run)
  seed = int(run.get("seed", 0))
  if lora is None or not run.get("init_from"):
    return build_run_model(cfg, mesh=mesh, seed=seed if lora else 0, lora=lora,
                           execution=decoding())
  base = Path(run["init_from"])
  if not (base / "config.json").is_file():
    raise UsageError(f"--checkpoint {checkpoint!r}: its LoRA adapters' base "
                     f"{str(base)!r} is gone")
  try:
    model = build_run_model(cfg, mesh=mesh, seed=seed, init_from=base, lora=lora,
                            execution=decoding())
  except (ValueError, OSError) as err:
    raise UsageError(f"--checkpoint {checkpoint!r}: its base {str(base)!r}: {err}"
                     ) from None
  from models.hf import weights_digest
  if model.cfg.identity() != cfg.identity() or (
      run.get("lora_base_sha256") not in (None, weights_digest(base))):
    raise UsageError(f"--checkpoint {checkpoint!r}: its base {str(base)!r} is not the "
                     "model the run adapted (its config or weights changed since)")
  return model
