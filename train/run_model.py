"""A run's model, rebuilt the one way for every use: a fresh run, ``--resume``, export and
generate. A run's model is its base (a preset's draws at the run's seed, or an
``--init-from`` HF folder) with the settings the run put over that base's config, and
its LoRA adapters if it trains some. Building it in one place keeps the three from
drifting apart (an export that forgot the run's expert capacity refused a model it had
trained)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from flax_tp.lora import LoRAConfig
from models.config import TransformerConfig
from models.execution import Execution
from models.transformer import Transformer

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
