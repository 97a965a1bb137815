"""HuggingFace Llama / Qwen2 checkpoints in and out of ``models.transformer.Transformer``.

    model = load_hf("path/to/dir", flax_tp.make_mesh("2x4"))   # config.json + safetensors
    save_hf(model, "out/dir")     # transformers.AutoModelForCausalLM.from_pretrained("out/dir")
    to_hf_state_dict(nnx.state(model, nnx.Param))   # {HF name: [out, in] numpy array}

Layouts: HF stores a linear layer's weight as ``[out, in]``, flax as ``kernel
[in, out]``. HF's Llama/Qwen2 rotary already uses the rotate-half convention
(the first and second halves of a head are the pairs), which is what
``models.ops.rotary`` computes, so q/k need no permutation. Loading reads one
tensor at a time (safetensors) and places it straight into its shards.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

import flax_tp
from flax_tp.logical import stored_like
from flax_tp.stack import per_layer_paths, set_layer, stacked_layers
from models.config import TransformerConfig, check_architecture_fields
from models.execution import Execution
from models.transformer import Transformer

SUPPORTED = ("llama", "qwen2")


class HFConfigError(ValueError):
  """A config.json flax_tp cannot honour exactly (never silently a different model)."""


def _number(hf: dict[str, Any], field: str, default: Any = None, *, integer: bool) -> Any:
  """``hf[field]`` (or ``default`` when absent or null) as a positive int / finite positive
  float; ``HFConfigError`` naming the field otherwise (NaN, negative, a string...)."""
  value = hf.get(field)
  if value is None:
    if default is None:
      raise HFConfigError(f"config.json lacks {field!r}")
    return default
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  if integer:
    ok = ok and float(value).is_integer()
  if not ok or value <= 0:
    raise HFConfigError(f"config.json field {field!r} is {value!r}; expected a positive "
                        f"{'integer' if integer else 'finite number'}")
  return int(value) if integer else float(value)


def _flag(hf: dict[str, Any], field: str, default: bool) -> bool:
  value = hf.get(field, default)
  if not isinstance(value, bool):
    raise HFConfigError(f"config.json field {field!r} is {value!r}; expected true or false")
  return value


def config_from_hf(hf: dict[str, Any]) -> TransformerConfig:
  """The ``TransformerConfig`` of an HF ``config.json``; ``HFConfigError`` naming the field
  it cannot honour."""
  if not isinstance(hf, dict):
    raise HFConfigError(f"config.json holds a {type(hf).__name__}, not an object of fields")
  kind = hf.get("model_type")
  if kind not in SUPPORTED:
    raise HFConfigError(f"model_type {kind!r} is not supported (expected one of {SUPPORTED})")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise HFConfigError(f"hidden_act {act!r} is not supported (expected 'silu')")
  rope = hf.get("rope_parameters") or {}  # transformers 5 keeps the rope settings here
  scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                       else None)
  if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
    raise HFConfigError(f"rope_scaling {scaling!r} is not implemented (only plain rotary)")
  if hf.get("use_sliding_window") or (kind != "qwen2" and hf.get("sliding_window")):
    raise HFConfigError(f"sliding_window {hf.get('sliding_window')!r} is not implemented")
  layer_types = set(hf.get("layer_types") or ["full_attention"])
  if layer_types != {"full_attention"}:
    raise HFConfigError(f"layer_types {sorted(layer_types)} is not implemented (only "
                        "'full_attention')")
  heads = _number(hf, "num_attention_heads", integer=True)
  d_model = _number(hf, "hidden_size", integer=True)
  if not hf.get("head_dim") and d_model % heads:
    raise HFConfigError(f"config.json field 'hidden_size' {d_model} is not divisible by "
                        f"'num_attention_heads' {heads} and there is no 'head_dim'")
  head_dim = _number(hf, "head_dim", d_model // heads, integer=True)
  if kind == "qwen2":
    biases = dict(qkv_bias=True, attn_out_bias=False, mlp_bias=False)
  else:
    attention_bias = _flag(hf, "attention_bias", False)
    biases = dict(qkv_bias=attention_bias, attn_out_bias=attention_bias,
                  mlp_bias=_flag(hf, "mlp_bias", False))
  theta_from = rope if "rope_theta" in rope else hf
  return TransformerConfig(
      vocab_size=_number(hf, "vocab_size", integer=True), d_model=d_model, num_heads=heads,
      num_kv_heads=_number(hf, "num_key_value_heads", heads, integer=True), head_dim=head_dim,
      d_ff=_number(hf, "intermediate_size", integer=True),
      num_layers=_number(hf, "num_hidden_layers", integer=True),
      max_seq_len=_number(hf, "max_position_embeddings", 2048, integer=True),
      tie_embeddings=_flag(hf, "tie_word_embeddings", False),
      rope_base=_number(theta_from, "rope_theta", 10_000.0, integer=False),
      norm_eps=_number(hf, "rms_norm_eps", 1e-6, integer=False), norm="rmsnorm",
      mlp="swiglu", **biases)


def config_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
  """The HF ``config.json`` of a Llama/Qwen2-style config (``HFConfigError`` otherwise)."""
  if cfg.norm != "rmsnorm" or cfg.mlp != "swiglu":
    raise HFConfigError(f"norm={cfg.norm!r}, mlp={cfg.mlp!r} has no Llama/Qwen2 equivalent "
                        "(needs norm='rmsnorm', mlp='swiglu')")
  qwen2 = cfg.qkv_bias and not cfg.attn_out_bias and not cfg.mlp_bias
  if not qwen2 and cfg.qkv_bias != cfg.attn_out_bias:
    raise HFConfigError(f"qkv_bias={cfg.qkv_bias}, attn_out_bias={cfg.attn_out_bias}: Llama "
                        "has both or neither, Qwen2 q/k/v biases only")
  out = dict(
      model_type="qwen2" if qwen2 else "llama",
      architectures=["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
      max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
      rope_theta=cfg.rope_base, tie_word_embeddings=cfg.tie_embeddings,
      torch_dtype="float32")
  if not qwen2:
    out.update(attention_bias=cfg.attn_out_bias, mlp_bias=cfg.mlp_bias)
  else:
    out.update(use_sliding_window=False)
  return out


def _names(cfg: TransformerConfig) -> Iterator[tuple[tuple, str, bool]]:
  """``(flax_tp param path, HF name, transposed)`` of every parameter."""
  yield ("embed", "embedding"), "model.embed_tokens.weight", False
  proj = [("attn", "q", "self_attn.q_proj", cfg.qkv_bias),
          ("attn", "k", "self_attn.k_proj", cfg.qkv_bias),
          ("attn", "v", "self_attn.v_proj", cfg.qkv_bias),
          ("attn", "o", "self_attn.o_proj", cfg.attn_out_bias),
          ("mlp", "gate", "mlp.gate_proj", cfg.mlp_bias),
          ("mlp", "up", "mlp.up_proj", cfg.mlp_bias),
          ("mlp", "down", "mlp.down_proj", cfg.mlp_bias)]
  for i in range(cfg.num_layers):
    for group, name, hf, bias in proj:
      yield ("blocks", i, group, name, "kernel"), f"model.layers.{i}.{hf}.weight", True
      if bias:
        yield ("blocks", i, group, name, "bias"), f"model.layers.{i}.{hf}.bias", False
    yield ("blocks", i, "ln1", "scale"), f"model.layers.{i}.input_layernorm.weight", False
    yield (("blocks", i, "ln2", "scale"), f"model.layers.{i}.post_attention_layernorm.weight",
           False)
  yield ("ln_f", "scale"), "model.norm.weight", False
  if not cfg.tie_embeddings:
    yield ("head", "kernel"), "lm_head.weight", True


def _at(state: nnx.State, path: tuple) -> Any:
  node = state
  for part in path:
    node = node[part]
  return node


def to_hf_state_dict(state: nnx.State, cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """HF names and logical ``[out, in]`` arrays of a params (or gradients) state of a
  ``Transformer`` with config ``cfg``."""
  logical = flax_tp.unshard(state)
  out = {}
  for path, name, transposed in _names(cfg):
    value = np.asarray(_at(logical, path)[...])
    out[name] = np.ascontiguousarray(value.T if transposed else value)
  return out


SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def _keys_of(path: Path) -> list[str]:
  """The tensor names of one safetensors file; ``HFConfigError`` naming it when it is not
  one (empty, truncated, corrupt)."""
  from safetensors import safe_open
  try:
    with safe_open(path, framework="numpy") as f:
      return list(f.keys())
  except FileNotFoundError:
    raise
  except Exception as err:  # safetensors raises its own SafetensorError
    raise HFConfigError(f"{str(path)!r} is not a readable safetensors file: {err}") from None


class _Tensors:
  """Reads the tensors of a safetensors checkpoint, single-file or sharded, one at a time.

  A folder with both forms is read as transformers reads it: ``model.safetensors``."""

  def __init__(self, directory: Path):
    index = directory / INDEX
    if (directory / SINGLE).is_file():
      self.files = {name: directory / SINGLE for name in _keys_of(directory / SINGLE)}
    elif index.is_file():
      try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
          raise TypeError("'weight_map' is not an object")
      except (ValueError, KeyError, TypeError) as err:
        raise HFConfigError(f"{str(index)!r} is not a safetensors index: "
                            f"{type(err).__name__}: {err}") from None
      self.files = {name: directory / file for name, file in weight_map.items()}
      for file in sorted(set(self.files.values())):
        listed = {n for n, f in self.files.items() if f == file}
        missing = sorted(listed - set(_keys_of(file)))
        if missing:
          raise HFConfigError(f"{str(file)!r} lacks {missing[:3]}, which {INDEX} places there")
    else:
      raise FileNotFoundError(f"{str(directory)!r} has neither {SINGLE} nor {INDEX}")

  def get(self, name: str) -> np.ndarray:
    from safetensors import safe_open
    if name not in self.files:
      raise HFConfigError(f"the checkpoint lacks tensor {name!r}")
    try:
      with safe_open(self.files[name], framework="flax") as f:  # bfloat16 too
        return np.asarray(f.get_tensor(name), np.float32)
    except Exception as err:  # a file cut short after its header
      raise HFConfigError(f"cannot read tensor {name!r} from {str(self.files[name])!r}: "
                          f"{err}") from None


def read_config(path: str | Path, **overrides) -> TransformerConfig:
  """The ``TransformerConfig`` of the HF directory ``path`` (its config.json), with
  ``overrides`` (e.g. ``dropout``, ``dtype``, ``max_seq_len``) replaced."""
  check_architecture_fields(overrides)
  config_path = Path(path) / "config.json"
  if not config_path.is_file():
    raise FileNotFoundError(f"{str(path)!r} has no config.json")
  try:
    hf = json.loads(config_path.read_text(encoding="utf-8"))
  except (ValueError, OSError) as err:
    raise HFConfigError(f"{str(config_path)!r} is not readable JSON: {err}") from None
  try:
    cfg = config_from_hf(hf)
  except HFConfigError as err:
    raise HFConfigError(f"{str(config_path)!r}: {err}") from None
  if cfg.tie_embeddings and _separate_head(Path(path)):
    cfg = dataclasses.replace(cfg, tie_embeddings=False)
  return dataclasses.replace(cfg, **overrides)


def _separate_head(directory: Path) -> bool:
  """Whether a checkpoint whose config says ``tie_word_embeddings: true`` holds an
  ``lm_head.weight`` that differs from the embedding: transformers (5.x) then keeps the
  two apart, and so does flax_tp (with transformers' warning), rather than tie silently."""
  if not ((directory / SINGLE).is_file() or (directory / INDEX).is_file()):
    return False  # load_hf names the missing weights
  tensors = _Tensors(directory)
  if "lm_head.weight" not in tensors.files:
    return False
  if np.array_equal(tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")):
    return False
  warnings.warn(f"{str(directory)!r}: config.json says tie_word_embeddings: true, but the "
                "checkpoint's lm_head.weight differs from model.embed_tokens.weight; they are "
                "kept apart, as transformers does (set tie_word_embeddings to false to silence "
                "this)", stacklevel=3)
  return True


def load_hf(path: str | Path, mesh: Mesh, *, seed: int = 0,
            execution: Execution = Execution(), **overrides) -> Transformer:
  """The ``Transformer`` of a local HF Llama/Qwen2 directory, on ``mesh``, run as
  ``execution`` says (sequence parallelism, remat, scanned layers, FSDP).

  Each tensor is read on its own, converted to the flax layout and placed into
  its shards, so the host holds one checkpoint tensor at a time. (The model is
  first built with random params, as ``Transformer`` does, then overwritten.)
  ``overrides`` replace config fields HF does not fix (``dropout``, ``dtype``,
  ``max_seq_len``).
  """
  directory = Path(path)
  cfg = read_config(directory, **overrides)
  tensors = _Tensors(directory)
  model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed), execution=execution)
  # Each flax_tp param path -> (its param, layer of a stacked param or None).
  targets = {layer_path: (var, None if stacked_layers(var) is None else layer)
             for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
             for layer, layer_path in enumerate(per_layer_paths(path, var))}
  used = set()
  for flax_path, name, transposed in _names(cfg):
    value = tensors.get(name)
    value = value.T if transposed else value
    var, layer = targets[flax_path]
    if layer is None:
      var[...] = stored_like(var, value, name)
    else:
      set_layer(var, layer, value, name)
    used.add(name)
  # A tied model's file may also hold the head (equal to the embedding: see read_config).
  unused = sorted(set(tensors.files) - used - ({"lm_head.weight"} if cfg.tie_embeddings
                                               else set()))
  if unused:  # a tensor this architecture does not have: not the model it claims
    raise HFConfigError(f"the checkpoint has tensors the config does not explain: "
                        f"{unused[:5]}{' ...' if len(unused) > 5 else ''}")
  return model


def save_hf(model: Transformer, path: str | Path) -> None:
  """Writes ``config.json`` and ``model.safetensors`` (float32) that transformers loads.

  Each file is written beside its place and renamed over it, so an interrupted save
  leaves the folder's earlier files whole. A folder holding a sharded checkpoint
  (``model.safetensors.index.json``) is refused: flax_tp did not write those shards and
  will not delete them, and leaving them beside a new ``model.safetensors`` would leave
  two different models in one folder.
  """
  from safetensors.numpy import save_file
  cfg = model.cfg
  hf_config = config_to_hf(cfg)  # refuses a model HF cannot represent, before writing
  directory = Path(path)
  if (directory / INDEX).exists():
    raise FileExistsError(f"refusing to save into {str(directory)!r}: it holds a sharded "
                          f"checkpoint ({INDEX}) that flax_tp did not write and will not "
                          "delete; choose an empty or new folder")
  directory.mkdir(parents=True, exist_ok=True)
  tensors = to_hf_state_dict(nnx.state(model, nnx.Param), cfg)
  tmp = directory / f".{SINGLE}.tmp"
  save_file(tensors, str(tmp), metadata={"format": "pt"})
  os.replace(tmp, directory / SINGLE)
  tmp = directory / ".config.json.tmp"
  tmp.write_text(json.dumps(hf_config, indent=2))
  os.replace(tmp, directory / "config.json")
