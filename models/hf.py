"""HuggingFace checkpoints in and out of ``models.transformer.Transformer``: the families
of ``models/families/`` (Llama 2/3.x, Qwen2, Qwen3, Mistral, Gemma 1-3, Phi-3, and the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE).

    model = load_hf("path/to/dir", flax_tp.make_mesh("2x4"))   # config.json + safetensors
    save_hf(model, "out/dir")     # transformers.AutoModelForCausalLM.from_pretrained("out/dir")
    to_hf_state_dict(nnx.state(model, nnx.Param))   # {HF name: [out, in] numpy array}

Layouts: HF stores a linear layer's weight as ``[out, in]``, flax as ``kernel
[in, out]``. HF's rotary already uses the rotate-half convention (the first and
second halves of a head's rotated dims are the pairs), which is what
``models.ops.rotary`` computes, so q/k need no permutation. Loading reads one
tensor at a time (safetensors) and places it straight into its shards; a fused
tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``) is cut into its parts first, and
each part is split over the devices in whole heads as the unfused model's is.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

import flax_tp
from flax_tp.logical import stored_like
from flax_tp.param_info import ParamInfo
from flax_tp.stack import per_layer_paths, set_layer, stacked_layers
from models.config import TransformerConfig, check_architecture_fields
from models.execution import Execution
from models.families import (
  SUPPORTED,
  HFConfigError,
  config_from_hf,
  config_to_hf,
  fp8_block_size,
  is_mxfp4,
  mtp_prefixes,
  tensor_names,
)
from models.transformer import Transformer

__all__ = ["SUPPORTED", "HFConfigError", "config_from_hf", "config_to_hf", "load_hf",
           "read_config", "save_hf", "to_hf_state_dict"]


def _at(state: nnx.State, path: tuple) -> Any:
  node = state
  for part in path:
    node = node[part]
  return node


def to_hf_state_dict(state: nnx.State, cfg: TransformerConfig,
                     experts_fused: bool = False) -> dict[str, np.ndarray]:
  """HF names and logical ``[out, in]`` arrays of a params (or gradients) state of a
  ``Transformer`` with config ``cfg``. A MoE's experts one tensor per expert, as
  ``save_pretrained`` writes them, or ``experts_fused`` as transformers 5 holds them in
  memory (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``). A gradients state has no
  selection biases (never trained): their tensors are left out."""
  logical = flax_tp.unshard(state)
  out = {}
  for tensor in tensor_names(cfg, experts_fused):
    if tensor.buffer and not _has(logical, tensor.paths[0]):  # gradients: none for it
      continue
    parts = [np.asarray(_at(logical, path)[...]) for path in tensor.paths]
    if tensor.expert is not None:
      parts = [part[tensor.expert] for part in parts]
    value = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]  # fused: rows
    value = _transposed(value) if tensor.transposed else value
    if tensor.rows is not None:  # back to the checkpoint's row order
      value = np.take(value, np.argsort(tensor.rows), axis=tensor.out_axis(value))
    out[tensor.name] = np.ascontiguousarray(value)
  return out


def _has(state: nnx.State, path: tuple) -> bool:
  try:
    _at(state, path)
  except (KeyError, IndexError, TypeError):
    return False
  return True


def _transposed(value: np.ndarray) -> np.ndarray:
  """HF's ``[..., out, in]`` <-> flax's ``[..., in, out]`` (the last two dims)."""
  return np.swapaxes(value, -1, -2)


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


def weights_digest(path: str | Path) -> str:
  """sha256 of the weight files an HF folder's model is read from (as ``load_hf`` reads
  them: ``model.safetensors``, or the shards its index names), names and bytes, read in
  16 MiB pieces: what a LoRA run's adapters were trained on."""
  import hashlib
  directory = Path(path)
  tensors = _Tensors(directory)
  digest = hashlib.sha256()
  for file in sorted(set(tensors.files.values())):
    digest.update(file.name.encode() + b"\0")
    with open(file, "rb") as f:
      while chunk := f.read(1 << 24):
        digest.update(chunk)
  return digest.hexdigest()


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

  def packed(self, name: str) -> np.ndarray:
    """Tensor ``name``'s stored bytes as uint8 (MXFP4's ``_blocks`` and ``_scales``);
    ``HFConfigError`` naming it when it is absent or not U8."""
    if name not in self.files:
      raise HFConfigError(f"the checkpoint lacks tensor {name!r}")
    if self.raw_dtype(name) != "U8":
      raise HFConfigError(f"tensor {name!r} is {self.raw_dtype(name)}; MXFP4 stores U8")
    return _read_raw(self.files[name], name, "uint8", as_float=False)

  def get(self, name: str) -> np.ndarray:
    from safetensors import safe_open
    if name not in self.files:
      raise HFConfigError(f"the checkpoint lacks tensor {name!r}")
    raw = self.raw_dtype(name)
    if raw in _RAW_DTYPES:  # FP8 weights and UE8M0 scales, which safetensors' numpy lacks
      return _read_raw(self.files[name], name, _RAW_DTYPES[raw])
    try:
      with safe_open(self.files[name], framework="flax") as f:  # bfloat16 too
        return np.asarray(f.get_tensor(name), np.float32)
    except Exception as err:  # a file cut short after its header
      raise HFConfigError(f"cannot read tensor {name!r} from {str(self.files[name])!r}: "
                          f"{err}") from None


  def raw_dtype(self, name: str) -> str:
    """The safetensors dtype of tensor ``name`` as its file's header says (``F32``,
    ``BF16``, ``F8_E4M3``, ``U8``...)."""
    return _header(self.files[name])[name]["dtype"]


def _ml_dtype(name: str):
  import ml_dtypes  # (jax's own dependency)
  return np.dtype(getattr(ml_dtypes, name))


# The dtypes read from a file's bytes (safetensors' numpy and flax readers do not map
# FP8): as their numpy type.
_RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U8": "uint8"}


def _header(path: Path) -> dict:
  """A safetensors file's header: each tensor's dtype, shape and byte offsets."""
  stat = os.stat(path)
  return _header_of(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _header_of(path: str, mtime_ns: int, size: int) -> dict:
  """(the file as it is now: a rewritten file is read again)"""
  with open(path, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(size)) | {"__start__": 8 + size}


def _read_raw(path: Path, name: str, dtype: str, *, as_float: bool = True) -> np.ndarray:
  """Tensor ``name`` of ``path`` from its bytes, as ``dtype`` (``_RAW_DTYPES``'), in
  float32 (a UE8M0 scale's byte ``e`` is ``2 ** (e - 127)``); ``as_float=False``: the
  stored values as they are (MXFP4's packed codes and exponents)."""
  header = _header(path)
  entry = header[name]
  begin, end = entry["data_offsets"]
  with open(path, "rb") as f:
    f.seek(header["__start__"] + begin)
    data = f.read(end - begin)
  kind = np.dtype("uint8") if dtype == "uint8" else _ml_dtype(dtype)
  value = np.frombuffer(data, kind).reshape(entry["shape"])
  if not as_float:
    return value
  if dtype == "uint8":
    return np.exp2(value.astype(np.float32) - 127.0)
  return value.astype(np.float32)


def dequantized(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
                name: str) -> np.ndarray:
  """An FP8 block-quantized ``weight [..., out, in]`` (in float32) times its per-block
  ``scale_inv [..., ceil(out / rows), ceil(in / cols)]`` (DeepSeek-V3's
  ``weight_dequant``; the last blocks of an uneven dim are partial), exactly: an FP8 value
  times a float32 scale is one float32 product."""
  rows, cols = weight.shape[-2:]
  grid = (-(-rows // block[0]), -(-cols // block[1]))
  if tuple(scale_inv.shape) != weight.shape[:-2] + grid:
    raise HFConfigError(f"tensor {name + '_scale_inv'!r} has shape {tuple(scale_inv.shape)}; "
                        f"weight_block_size {list(block)} over {name!r} "
                        f"{tuple(weight.shape)} gives {weight.shape[:-2] + grid}")
  scale = np.repeat(np.repeat(scale_inv, block[0], axis=-2)[..., :rows, :], block[1],
                    axis=-1)[..., :cols]
  return (weight * scale).astype(np.float32)


# The 16 values of an FP4 (E2M1) code, as the OCP MX spec and transformers' FP4_VALUES list
# them: the low three bits the magnitude, the high one the sign.
FP4_VALUES = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
MXFP4_BLOCK = 32  # values sharing one exponent


def mxfp4_dequantized(blocks: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
  """GPT-OSS's MXFP4 experts (``name``'s ``_blocks [E, out, in / 32, 16]`` uint8, two FP4
  codes a byte, the low nibble first; ``_scales [E, out, in / 32]`` uint8, a power of two
  biased by 127) -> float32 ``[E, in, out]`` as transformers' ``convert_moe_packed_tensors``
  gives them, exactly: a table lookup times a power of two."""
  if (blocks.ndim != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2
      or tuple(scales.shape) != tuple(blocks.shape[:-1])):
    raise HFConfigError(f"tensor {name + '_blocks'!r} has shape {tuple(blocks.shape)} and "
                        f"{name + '_scales'!r} {tuple(scales.shape)}; MXFP4 expects "
                        f"[E, out, in / {MXFP4_BLOCK}, {MXFP4_BLOCK // 2}] and [E, out, "
                        f"in / {MXFP4_BLOCK}]")
  blocks = np.asarray(blocks, np.uint8)
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [E, out, G, 16, 2]
  values = FP4_VALUES[codes].reshape(blocks.shape[:-1] + (MXFP4_BLOCK,))
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
  return np.swapaxes(values.reshape(blocks.shape[:2] + (-1,)), 1, 2).astype(np.float32)


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
            execution: Execution = Execution(), lora: flax_tp.LoRAConfig | None = None,
            **overrides) -> Transformer:
  """The ``Transformer`` of a local HF directory (a family of ``models/families/``), on
  ``mesh``, run as ``execution`` says (sequence parallelism, remat, scanned layers, FSDP).

  Each tensor is read on its own, converted to the flax layout and placed into
  its shards, so the host holds one checkpoint tensor at a time. (The model is
  first built with random params, as ``Transformer`` does, then overwritten.)
  ``overrides`` replace config fields HF does not fix (``dropout``, ``dtype``,
  ``max_seq_len``). ``lora``: fresh adapters on the loaded base (``Transformer``'s).
  """
  directory = Path(path)
  cfg = read_config(directory, **overrides)
  tensors = _Tensors(directory)
  model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed), execution=execution, lora=lora)
  # Each flax_tp param path -> (its param, layer of a stacked param or None).
  targets = {layer_path: (var, None if stacked_layers(var) is None else layer)
             for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
             for layer, layer_path in enumerate(per_layer_paths(path, var))}
  used = set()
  # A MoE's experts as transformers 5 holds them in memory (one tensor per weight), or
  # one tensor per expert as save_pretrained writes them.
  experts_fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in tensors.files)
  experts: dict[tuple, tuple[np.ndarray, set]] = {}  # path -> (experts so far, which)
  # FP8 block-quantized weights (DeepSeek-V3's release): each read with its scales and
  # dequantized to float32.
  hf_config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
  block = fp8_block_size(hf_config)
  mxfp4 = is_mxfp4(hf_config)  # GPT-OSS's release: its experts as MXFP4 blocks and scales
  for tensor in tensor_names(cfg, experts_fused):
    scale_name = tensor.name + "_scale_inv"
    packed = (tensor.name + "_blocks", tensor.name + "_scales")
    if mxfp4 and tensor.name not in tensors.files and packed[0] in tensors.files:
      value = mxfp4_dequantized(tensors.packed(packed[0]), tensors.packed(packed[1]),
                                tensor.name)
      used.update(packed)
    else:
      value = tensors.get(tensor.name)
    if block is not None and scale_name in tensors.files:
      value = dequantized(value, tensors.get(scale_name), block, tensor.name)
      used.add(scale_name)
    elif tensor.name in tensors.files and tensors.raw_dtype(tensor.name) in ("F8_E4M3",
                                                                              "F8_E5M2"):
      raise HFConfigError(f"tensor {tensor.name!r} is FP8 without {scale_name!r} (or without "
                          "an fp8 quantization_config): its scale is unknown")
    if tensor.rows is not None:  # rows flax_tp holds in another order (DeepSeek's rotary)
      axis = tensor.out_axis(value)
      if value.ndim == 0 or value.shape[axis] != len(tensor.rows):
        raise HFConfigError(f"tensor {tensor.name!r} has shape {tuple(value.shape)}; the "
                            f"config gives {len(tensor.rows)} "
                            f"{'columns' if tensor.columns else 'rows'}")
      value = np.take(value, tensor.rows, axis=axis)
    if tensor.sizes is not None:  # fused rows: each part's, in order
      rows = tensor.out_axis(value)
      if value.shape[rows] != sum(tensor.sizes):
        raise HFConfigError(f"tensor {tensor.name!r} has {value.shape[rows]} rows; the config "
                            f"gives {' + '.join(map(str, tensor.sizes))}")
      parts = np.split(value, np.cumsum(tensor.sizes)[:-1], axis=rows)
    else:
      parts = [value]
    for flax_path, part in zip(tensor.paths, parts, strict=True):
      part = _transposed(part) if tensor.transposed else part
      var, layer = targets[flax_path]
      if tensor.expert is not None:  # one expert's slice: the param once all are read
        part = _gather_expert(experts, flax_path, var, layer, tensor, part)
        if part is None:
          continue
      if layer is None:
        var[...] = stored_like(var, part, tensor.name)
      else:
        set_layer(var, layer, part, tensor.name)
    used.add(tensor.name)
  # A tied model's file may also hold the head (equal to the embedding: see read_config).
  unused = sorted(set(tensors.files) - used - ({"lm_head.weight"} if cfg.tie_embeddings
                                               else set()))
  # DeepSeek-V3's and GLM-4.5's multi-token-prediction layers: a causal LM does not run
  # them (transformers skips them too); skipped by name, and said.
  mtp = mtp_prefixes(hf_config, cfg)
  skipped = [name for name in unused if name.startswith(mtp)] if mtp else []
  if skipped:
    unused = [name for name in unused if name not in set(skipped)]
    layers = sorted({name[:name.index(".", len("model.layers."))] for name in skipped})
    warnings.warn(f"{str(directory)!r}: skipped the {len(skipped)} tensors of the "
                  f"multi-token-prediction layer{'s' if len(layers) > 1 else ''} "
                  f"{', '.join(layers)} (num_nextn_predict_layers), which a causal LM does "
                  "not run", stacklevel=2)
  if unused:  # a tensor this architecture does not have: not the model it claims
    raise HFConfigError(f"the checkpoint has tensors the config does not explain: "
                        f"{unused[:5]}{' ...' if len(unused) > 5 else ''}")
  return model


def _gather_expert(experts: dict, path: tuple, var: nnx.Variable, layer: int | None,
                   tensor: Any, part: np.ndarray) -> np.ndarray | None:
  """Adds one expert's ``part`` to the param at ``path`` (``[E, ...]`` logical); returns the
  whole param once every expert is in, else None. A misshapen expert is an error naming
  its tensor."""
  info = ParamInfo.of(var)
  if layer is not None:
    info = info.per_layer()
  shape = info.logical_shape(var[...].shape[0 if layer is None else 1:])
  if tuple(part.shape) != tuple(shape[1:]):
    raise HFConfigError(f"tensor {tensor.name!r} has shape {tuple(_transposed(part).shape)}; "
                        f"the config gives {tuple(_transposed(np.zeros(shape[1:])).shape)}")
  whole, seen = experts.setdefault(path, (np.zeros(shape, np.float32), set()))
  whole[tensor.expert] = part
  seen.add(tensor.expert)
  if len(seen) < shape[0]:
    return None
  del experts[path]
  return whole


# The fields of a config.json that say how long a context the model is for. A run's
# --seq-len sets the model's max_seq_len to what it trains on, which says nothing of the
# model's context: an export of a model read from an HF folder keeps that folder's.
CONTEXT_FIELDS = ("max_position_embeddings", "original_max_position_embeddings")


def save_hf(model: Transformer, path: str | Path, *,
            special_tokens: dict[str, int | list[int] | None] | None = None,
            base_config: dict[str, Any] | None = None) -> None:
  """Writes ``config.json`` and ``model.safetensors`` (float32) that transformers loads,
  as the model's family (``models/families/``) names them.

  special_tokens: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` to write into
  config.json (flax_tp's model does not carry them).
  base_config: the config.json of the HF model this one was read from (a fine-tune's
  base): its ``CONTEXT_FIELDS`` are kept rather than the training length.

  Each file is written beside its place and renamed over it, so an interrupted save
  leaves the folder's earlier files whole. A folder holding a sharded checkpoint
  (``model.safetensors.index.json``) is refused: flax_tp did not write those shards and
  will not delete them, and leaving them beside a new ``model.safetensors`` would leave
  two different models in one folder.
  """
  from safetensors.numpy import save_file
  cfg = model.cfg
  if getattr(model, "lora", None) is not None:  # never silently without its adapters
    raise ValueError("the model has LoRA adapters, which an HF checkpoint does not hold: "
                     "save them with models.peft.save_peft_adapter, or save "
                     "models.peft.merged(model)")
  hf_config = config_to_hf(cfg)  # refuses a model HF cannot represent, before writing
  wrong = sorted(set(special_tokens or ()) - {"bos_token_id", "eos_token_id", "pad_token_id"})
  if wrong:
    raise ValueError(f"special_tokens holds {wrong[0]!r}; expected bos_token_id, "
                     "eos_token_id or pad_token_id")
  hf_config.update(special_tokens or {})
  for name in CONTEXT_FIELDS:
    if name in hf_config and (base_config or {}).get(name) is not None:
      hf_config[name] = base_config[name]
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
