"""LoRA adapters in PEFT's format, both ways, and merged into the base.

A PEFT LoRA folder holds ``adapter_config.json`` and ``adapter_model.safetensors``, whose
tensors are named after the base's modules: ``base_model.model.<module>.lora_A.weight
[r, in]`` and ``...lora_B.weight [out, r]`` (torch's ``[out, in]``; flax_tp stores
``lora_a [in, r]``, ``lora_b [r, out]``). The module names are the HF family's
(``models/families/``): ``blocks.3.attn.q`` is ``model.layers.3.self_attn.q_proj``.
``peft.PeftModel.from_pretrained(transformers_model, folder)`` reads what
``save_peft_adapter`` writes, and ``load_peft_adapter`` reads what ``peft`` saves.

Only what a plain LoRA means is read (``bias: none``, no DoRA, no dropout-free
difference...): anything else in the config is refused by name, as is a tensor that is
not some layer's adapter. A layer stored fused on disk (Phi-3's ``qkv_proj``) holds one
PEFT adapter for its parts together, which flax_tp's per-part adapters cannot be: such a
target is refused naming it.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

import flax_tp
from flax_tp.logical import stored_like
from flax_tp.lora import LoRAConfig
from flax_tp.stack import per_layer_paths, set_layer, stacked_layers
from models.execution import Execution
from models.families import tensor_names
from models.transformer import Transformer

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


class PeftError(ValueError):
  """A PEFT adapter folder flax_tp cannot read as it is meant (names what and why)."""


def module_names(cfg: Any) -> dict[str, str]:
  """Each adaptable layer's dotted flax_tp path -> its HF module name (unfused on disk)."""
  out = {}
  for tensor in tensor_names(cfg):
    if (len(tensor.paths) == 1 and tensor.paths[0][-1] == "kernel" and tensor.expert is None
        and tensor.name.endswith(".weight")):
      out[".".join(map(str, tensor.paths[0][:-1]))] = tensor.name[:-len(".weight")]
  return out


def _row_orders(cfg: Any) -> dict[str, tuple[int, ...]]:
  """Each layer whose output rows flax_tp holds in another order than the checkpoint
  (DeepSeek's interleaved rotary rows) -> that order (``HFTensor.rows``): its adapter's B
  rows follow it."""
  return {".".join(map(str, t.paths[0][:-1])): t.rows for t in tensor_names(cfg)
          if t.rows is not None and t.transposed}


def save_peft_adapter(model: Transformer, path: str | Path, *,
                      base_model_name_or_path: str | None = None) -> list[str]:
  """Writes ``model``'s adapters as a PEFT LoRA folder (float32); returns the HF modules.

  Each file is written beside its place and renamed over it. ``ValueError`` for a model
  without adapters, or one whose adapted layer PEFT would name otherwise (fused on disk).
  """
  from safetensors.numpy import save_file
  lora = model.lora
  if lora is None or not model.lora_targets:
    raise ValueError("the model has no LoRA adapters to save")
  names = module_names(model.cfg)
  unnamed = [p for p in model.lora_targets if p not in names]
  if unnamed:
    raise ValueError(f"LoRA target {unnamed[0]} is part of a tensor fused on disk in the "
                     f"{model.cfg.family} family; PEFT would hold one adapter for the fused "
                     "module, which per-part adapters are not")
  logical = {".".join(map(str, k)): np.asarray(v[...], np.float32) for k, v in
             nnx.to_flat_state(flax_tp.unshard(nnx.state(model, nnx.LoRAParam)))}
  tensors, orders = {}, _row_orders(model.cfg)
  for target in model.lora_targets:
    module = names[target]
    b = logical[f"{target}.lora_b"].T  # [out, r]
    if target in orders:  # back to the checkpoint's row order
      b = b[np.argsort(orders[target])]
    tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(
        logical[f"{target}.lora_a"].T)
    tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b)
  modules = [names[t] for t in model.lora_targets]
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
      "lora_alpha": lora.alpha, "use_rslora": lora.rslora, "target_modules": modules,
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
      "modules_to_save": None, "init_lora_weights": True, "rank_pattern": {},
      "alpha_pattern": {}, "base_model_name_or_path": base_model_name_or_path,
      "inference_mode": True,
  }
  directory = Path(path)
  directory.mkdir(parents=True, exist_ok=True)
  tmp = directory / f".{WEIGHTS}.tmp"
  save_file(tensors, str(tmp), metadata={"format": "pt"})
  os.replace(tmp, directory / WEIGHTS)
  tmp = directory / f".{CONFIG}.tmp"
  tmp.write_text(json.dumps(config, indent=2))
  os.replace(tmp, directory / CONFIG)
  return modules


# A PEFT LoRA config, field by field, by what it means. Each field that changes what an
# adapter computes or which layers it adapts must hold a value meaning plain LoRA (the
# first one listed is named in the refusal); r, lora_alpha, use_rslora, lora_dropout and
# target_modules are read below. The rest say where the adapter came from or how it was
# first drawn, which the saved tensors make moot. A field not known here (a later peft's)
# is refused: it could change what the adapter computes, and reading it as plain LoRA
# would be silently wrong.
_PLAIN = {"bias": ("none",), "use_dora": (False, None), "fan_in_fan_out": (False, None),
          "modules_to_save": (None, []), "rank_pattern": ({}, None),
          "alpha_pattern": ({}, None), "layers_to_transform": (None, []),
          "layers_pattern": (None, [], ""), "lora_bias": (False, None),
          "use_qalora": (False, None), "trainable_token_indices": (None, {}, []),
          "target_parameters": (None, []), "exclude_modules": (None, [], ""),
          "alora_invocation_tokens": (None, []), "layer_replication": (None, []),
          "megatron_config": (None, {}), "loftq_config": ({}, None),
          "eva_config": (None, {}), "corda_config": (None, {}), "lora_ga_config": (None, {}),
          "velora_config": (None, {}), "monteclora_config": (None, {}),
          "arrow_config": (None, {}), "kasa_config": (None, {}), "use_bdlora": (None, False),
          "ensure_weight_tying": (False, None),
          # PiSSA, OLoRA, CorDA, LoftQ... change the base weights too, not only the draws.
          "init_lora_weights": (True, False, "gaussian", None)}
_READ = ("peft_type", "r", "lora_alpha", "use_rslora", "lora_dropout", "target_modules")
_INFORMATIONAL = ("task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
                  "revision", "inference_mode", "runtime_config", "megatron_core",
                  "qalora_group_size")


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_config(directory: Path) -> dict[str, Any]:
  """``adapter_config.json`` as a dict, every field checked to mean plain LoRA."""
  try:
    config = json.loads((directory / CONFIG).read_text(encoding="utf-8"))
  except (ValueError, OSError) as err:
    raise PeftError(f"{CONFIG} is not readable JSON: {err}") from None
  if not isinstance(config, dict):
    raise PeftError(f"{CONFIG} holds a JSON {type(config).__name__}, not an object")
  if config.get("peft_type") != "LORA":
    raise PeftError(f"{CONFIG}: peft_type {config.get('peft_type')!r}; flax_tp reads LORA")
  unknown = sorted(set(config) - set(_PLAIN) - set(_READ) - set(_INFORMATIONAL))
  if unknown:
    raise PeftError(f"{CONFIG}: field {unknown[0]!r} is not one flax_tp knows; it may change "
                    "what the adapter computes, so it is not read as plain LoRA")
  for key, allowed in _PLAIN.items():
    # (True == 1 in Python: a value is plain only as the same type too.)
    if key in config and not any(config[key] == a and type(config[key]) is type(a)
                                 for a in allowed):
      raise PeftError(f"{CONFIG}: {key} {config[key]!r} is not plain LoRA (flax_tp reads "
                      f"{allowed[0]!r})")
  for key in ("r", "lora_alpha"):
    if key not in config:
      raise PeftError(f"{CONFIG} has no {key!r}")
  rank, alpha = config["r"], config["lora_alpha"]
  if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
    raise PeftError(f"{CONFIG}: r {rank!r} is not a positive integer")
  if not (_is_number(alpha) and math.isfinite(alpha) and alpha > 0):
    raise PeftError(f"{CONFIG}: lora_alpha {alpha!r} is not a positive number")
  if not isinstance(config.get("use_rslora", False), bool):
    raise PeftError(f"{CONFIG}: use_rslora {config['use_rslora']!r} is not true or false")
  dropout = config.get("lora_dropout") or 0.0
  if not _is_number(dropout) or dropout != 0.0:
    raise PeftError(f"{CONFIG}: lora_dropout {config['lora_dropout']!r}; flax_tp's adapters "
                    "have no dropout (use 0)")
  targets = config.get("target_modules")
  if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                       and all(isinstance(t, str) for t in targets))):
    raise PeftError(f"{CONFIG}: target_modules {targets!r} is not a module name pattern or a "
                    "list of module names")
  return config


def _targeted(targets: str | list[str], module: str, adaptable: set[str]) -> bool:
  """Whether peft adapts the HF module ``module`` under ``target_modules`` (its
  ``check_target_module_exists``: a string is a full regex match, or ``"all-linear"``; a
  list names modules whole or by their last parts)."""
  if targets == "all-linear":
    return module in adaptable
  if isinstance(targets, str):
    return re.fullmatch(targets, module) is not None
  return module in targets or any(module.endswith(f".{t}") for t in targets)


def read_adapter(path: str | Path, cfg: Any) -> tuple[LoRAConfig, dict[str, tuple]]:
  """``(the LoRAConfig, {flax_tp layer path: (lora_a [in, r], lora_b [r, out])})`` of a
  PEFT LoRA folder, for a base of config ``cfg``. ``PeftError`` names what is not plain
  LoRA, a tensor that adapts no layer of ``cfg`` or one its config does not target (peft
  would ignore it), a targeted layer the file holds no adapter for, or a misshapen one."""
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  directory = Path(path)
  if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
    raise PeftError(f"{str(directory)!r} is not a PEFT adapter folder (needs {CONFIG} and "
                    f"{WEIGHTS})")
  config = _read_config(directory)
  rank, alpha, targets = config["r"], float(config["lora_alpha"]), config["target_modules"]
  by_module = {module: path for path, module in module_names(cfg).items()}
  try:
    tensors = load_file(str(directory / WEIGHTS))
  except (SafetensorError, OSError, ValueError) as err:
    raise PeftError(f"{WEIGHTS} cannot be read as safetensors: {err}") from None
  found: dict[str, dict[str, np.ndarray]] = {}
  for key, value in tensors.items():
    module, _, part = key.removeprefix(PREFIX).rpartition(".lora_")
    if not key.startswith(PREFIX) or part not in ("A.weight", "B.weight") or (
        module not in by_module):
      raise PeftError(f"{WEIGHTS}: tensor {key!r} adapts no layer of this "
                      f"{cfg.family or 'llama/qwen2'} model")
    if not _targeted(targets, module, set(by_module)):
      raise PeftError(f"{WEIGHTS}: tensor {key!r} adapts {module}, which {CONFIG}'s "
                      f"target_modules {targets!r} does not reach (peft would ignore it)")
    found.setdefault(module, {})[part[0]] = value
  every_module = {t.name.rpartition(".")[0] for t in tensor_names(cfg)}
  missing = sorted(m for m in every_module if m not in found
                   and _targeted(targets, m, set(by_module)))
  if missing:
    raise PeftError(f"{CONFIG}: target_modules {targets!r} reaches {missing[0]}, for which "
                    f"{WEIGHTS} holds no adapter (peft would draw one)")
  adapters, orders = {}, _row_orders(cfg)
  for module, parts in found.items():
    target = by_module[module]
    if set(parts) != {"A", "B"}:
      raise PeftError(f"{WEIGHTS}: layer {target} has lora_{''.join(parts)} but not both")
    a, b = parts["A"].T, parts["B"].T  # [in, r], [r, out]
    if target in orders and b.shape[1] == len(orders[target]):  # (else misshapen: below)
      b = b[:, list(orders[target])]
    if a.shape[1] != rank or b.shape[0] != rank:
      raise PeftError(f"{WEIGHTS}: layer {target}'s adapter has rank {a.shape[1]}; "
                      f"{CONFIG} says r {rank}")
    adapters[target] = (a, b)
  if not adapters:
    raise PeftError(f"{WEIGHTS}: no adapter tensors")
  lora = LoRAConfig(rank=rank, alpha=alpha, rslora=bool(config.get("use_rslora")),
                    targets=tuple(sorted(adapters)))
  return lora, adapters


def load_peft_adapter(base: str | Path, adapter: str | Path, mesh: Mesh, *,
                      execution: Execution = Execution(), **overrides) -> Transformer:
  """The HF folder ``base`` with the PEFT LoRA folder ``adapter`` on it, on ``mesh``."""
  from models.hf import load_hf, read_config
  cfg = read_config(Path(base), **overrides)
  lora, adapters = read_adapter(adapter, cfg)
  model = load_hf(base, mesh, execution=execution, lora=lora, **overrides)
  set_adapters(model, adapters)
  return model


def set_adapters(model: Transformer, adapters: dict[str, tuple]) -> None:
  """Sets each layer's ``(lora_a [in, r], lora_b [r, out])`` (logical), in place; a
  stacked model's layer by layer."""
  targets = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    for layer, per_layer in enumerate(per_layer_paths(path, var)):
      targets[".".join(map(str, per_layer))] = (var, None if stacked_layers(var) is None
                                                else layer)
  for target, (a, b) in adapters.items():
    for name, value in (("lora_a", a), ("lora_b", b)):
      var, layer = targets[f"{target}.{name}"]
      if layer is None:
        var[...] = stored_like(var, value, f"{target}.{name}")
      else:
        set_layer(var, layer, value, f"{target}.{name}")


def merged(model: Transformer) -> Transformer:
  """A model without adapters whose kernels are the base's plus ``scaling * A @ B``, on
  the same mesh and execution: what ``save_hf`` writes for transformers to read alone."""
  if model.lora is None:
    return model
  flat = dict(nnx.to_flat_state(flax_tp.unshard(nnx.state(model, nnx.Param))))
  scaling = model.lora.scaling
  for target in model.lora_targets:
    key = tuple(int(p) if p.isdigit() else p for p in target.split("."))
    a, b = (np.asarray(flat[key + (name,)][...], np.float32) for name in ("lora_a", "lora_b"))
    kernel = flat[key + ("kernel",)]
    kernel.set_value(np.asarray(kernel[...], np.float32) + scaling * (a @ b))
  base = [(k, v) for k, v in flat.items() if k[-1] not in ("lora_a", "lora_b")]
  out = Transformer(model.cfg, mesh=model.mesh, rngs=nnx.Rngs(0), execution=model.execution)
  flax_tp.load_unsharded(out, nnx.from_flat_state(base))
  return out
