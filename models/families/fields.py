"""Reading and checking config.json fields, shared by every family: numbers, flags and
activations named when they are not what flax_tp honours (``HFConfigError``), and the
layouts of full and sliding attention layers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from models.config import FULL, SLIDING, TransformerConfig


class HFConfigError(ValueError):
  """A config.json flax_tp cannot honour exactly (never silently a different model)."""


# -- reading fields --------------------------------------------------------------------------

def read_number(hf: dict[str, Any], field: str, default: Any = None, *, integer: bool) -> Any:
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


def read_optional(hf: dict[str, Any], field: str, *, integer: bool) -> Any:
  """``hf[field]`` as ``read_number`` reads it, or None where absent or null."""
  return None if hf.get(field) is None else read_number(hf, field, integer=integer)


def read_flag(hf: dict[str, Any], field: str, default: bool) -> bool:
  value = hf.get(field, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise HFConfigError(f"config.json field {field!r} is {value!r}; expected true or false")
  return value


def read_activation(hf: dict[str, Any], fields: tuple[str, ...], honoured: dict[str, str]) -> str:
  """The MLP kind of the first of ``fields`` present (``hidden_act``, Gemma 2's
  ``hidden_activation``), by ``honoured`` {HF activation: mlp kind}."""
  for field in fields:
    if hf.get(field) is not None:
      if hf[field] not in honoured:
        raise HFConfigError(f"{field} {hf[field]!r} is not supported (expected one of "
                            f"{tuple(honoured)})")
      return honoured[hf[field]]
  return next(iter(honoured.values()))


# -- attention layouts -----------------------------------------------------------------------

def read_layer_types(hf: dict[str, Any], layers: int, default: Callable[[int], str]) -> tuple:
  types = hf.get("layer_types")
  if types is None:
    return tuple(default(i) for i in range(layers))
  if not isinstance(types, list) or len(types) != layers:
    raise HFConfigError(f"config.json field 'layer_types' is {types!r}; expected a list of "
                        f"num_hidden_layers={layers} entries")
  wrong = sorted(set(types) - {FULL, SLIDING})
  if wrong:
    raise HFConfigError(f"layer_types {wrong[0]!r} is not implemented (only {FULL!r} and "
                        f"{SLIDING!r})")
  return tuple(types)


def window_fields(types: tuple, window: int | None) -> dict[str, Any]:
  """``layer_types`` / ``sliding_window`` fields: None where every layer is full (or no
  layer has a window to slide)."""
  if window is None or SLIDING not in types:
    return dict(layer_types=None, sliding_window=None)
  return dict(layer_types=types, sliding_window=window)


def qwen_window_fields(hf: dict[str, Any], layers: int) -> dict[str, Any]:
  """Qwen2/Qwen3: sliding layers only with ``use_sliding_window`` (from
  ``max_window_layers`` on, unless ``layer_types`` says which)."""
  window = read_optional(hf, "sliding_window", integer=True) if read_flag(
      hf, "use_sliding_window", False) else None
  first = hf.get("max_window_layers") or 0
  types = read_layer_types(hf, layers, lambda i: SLIDING if window is not None and i >= first
                       else FULL)
  return window_fields(types, window)


def refuse_bidirectional(hf: dict[str, Any]) -> None:
  if hf.get("use_bidirectional_attention"):
    raise HFConfigError("use_bidirectional_attention true is not implemented (flax_tp's "
                        "attention is causal)")


def layer_types_out(cfg: TransformerConfig) -> dict[str, Any]:
  if cfg.layer_types is None:
    return dict(layer_types=[FULL] * cfg.num_layers)
  return dict(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window)

def require(cfg: TransformerConfig, family: str, **fields) -> None:
  """``HFConfigError`` naming the first of ``fields`` where ``cfg`` differs: a model the
  family cannot represent is never written as it."""
  for name, value in fields.items():
    if getattr(cfg, name) != value:
      raise HFConfigError(f"{name}={getattr(cfg, name)!r} has no {family} equivalent (needs "
                          f"{name}={value!r})")

