"""LoRA adapters in PEFT's format, both ways, and merged into the base.

A PEFT LoRA folder holds ``adapter_config.json`` and ``adapter_model.safetensors``, whose
tensors are named after the base's modules: ``base_model.model.<module>.lora_A.weight
[r, in]`` and ``...lora_B.weight [out, r]`` (torch's ``[out, in]``; flax_tp stores
``lora_a [in, r]``, ``lora_b [r, out]``). The module names are the HF family's
(``models/families.py``): ``blocks.3.attn.q`` is ``model.layers.3.self_attn.q_proj``.
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
import os
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
  tensors = {}
  for target in model.lora_targets:
    module = names[target]
    tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(
        logical[f"{target}.lora_a"].T)
    tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(
        logical[f"{target}.lora_b"].T)
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


# What a PEFT LoRA config may say, and still mean the plain LoRA flax_tp computes.
_PLAIN = {"bias": ("none",), "use_dora": (False, None), "fan_in_fan_out": (False, None),
          "modules_to_save": (None, []), "rank_pattern": ({}, None),
          "alpha_pattern": ({}, None), "layers_to_transform": (None,),
          "layers_pattern": (None, [], ""), "lora_bias": (False, None),
          "use_qalora": (False, None), "trainable_token_indices": (None,),
          "target_parameters": (None, [])}


def read_adapter(path: str | Path, cfg: Any) -> tuple[LoRAConfig, dict[str, tuple]]:
  """``(the LoRAConfig, {flax_tp layer path: (lora_a [in, r], lora_b [r, out])})`` of a
  PEFT LoRA folder, for a base of config ``cfg``. ``PeftError`` names what is not plain
  LoRA, a tensor that adapts no layer of ``cfg``, or a misshapen one."""
  from safetensors.numpy import load_file
  directory = Path(path)
  if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
    raise PeftError(f"{str(directory)!r} is not a PEFT adapter folder (needs {CONFIG} and "
                    f"{WEIGHTS})")
  config = json.loads((directory / CONFIG).read_text(encoding="utf-8"))
  if config.get("peft_type") != "LORA":
    raise PeftError(f"{CONFIG}: peft_type {config.get('peft_type')!r}; flax_tp reads LORA")
  for key, allowed in _PLAIN.items():
    if key in config and config[key] not in allowed:
      raise PeftError(f"{CONFIG}: {key} {config[key]!r} is not plain LoRA (flax_tp reads "
                      f"{allowed[0]!r})")
  if float(config.get("lora_dropout") or 0.0) != 0.0:
    raise PeftError(f"{CONFIG}: lora_dropout {config['lora_dropout']!r}; flax_tp's adapters "
                    "have no dropout (use 0)")
  rank, alpha = int(config["r"]), float(config["lora_alpha"])
  by_module = {module: path for path, module in module_names(cfg).items()}
  tensors = load_file(str(directory / WEIGHTS))
  found: dict[str, dict[str, np.ndarray]] = {}
  for key, value in tensors.items():
    module, _, part = key.removeprefix(PREFIX).rpartition(".lora_")
    if not key.startswith(PREFIX) or part not in ("A.weight", "B.weight") or (
        module not in by_module):
      raise PeftError(f"{WEIGHTS}: tensor {key!r} adapts no layer of this "
                      f"{cfg.family or 'llama/qwen2'} model")
    found.setdefault(by_module[module], {})[part[0]] = value
  adapters = {}
  for target, parts in found.items():
    if set(parts) != {"A", "B"}:
      raise PeftError(f"{WEIGHTS}: layer {target} has lora_{''.join(parts)} but not both")
    a, b = parts["A"].T, parts["B"].T  # [in, r], [r, out]
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
