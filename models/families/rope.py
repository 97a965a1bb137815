"""Rotary positions in config.json, both ways: ``rope_parameters`` (transformers 5) or the
legacy ``rope_scaling`` + ``rope_theta``, the scaling types flax_tp honours, and the
per-layer-type rope of the families whose full and sliding layers differ."""

from __future__ import annotations

import math
from typing import Any

from models.config import FULL, SLIDING, RopeScaling, TransformerConfig
from models.families.fields import HFConfigError, read_number

# -- rotary ----------------------------------------------------------------------------------

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_dict(hf: dict[str, Any], layer_type: str | None) -> tuple[dict[str, Any], str]:
  """The rope settings of ``layer_type``'s layers (None: the one setting of every layer)
  and the field they came from, as transformers 5 resolves them: the legacy
  ``rope_scaling`` where present (it replaces ``rope_parameters``; for Gemma 3 it
  updates the full-attention layers'), else ``rope_parameters`` (nested by layer type
  for Gemma 3)."""
  params = hf.get("rope_parameters")
  if params is not None and not isinstance(params, dict):
    raise HFConfigError(f"config.json field 'rope_parameters' is {params!r}; expected an object")
  legacy = hf.get("rope_scaling")
  if legacy is not None and not isinstance(legacy, dict):
    raise HFConfigError(f"config.json field 'rope_scaling' is {legacy!r}; expected an object")
  nested = isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())
  if nested:
    if layer_type is None:
      raise HFConfigError(f"rope_parameters is per layer type ({sorted(params)}), which this "
                          f"family does not have")
    own = dict(params.get(layer_type) or {})
    if legacy and layer_type == FULL:
      return {**own, **legacy}, "rope_scaling"
    return own, "rope_parameters"
  if legacy:
    return dict(legacy), "rope_scaling"
  return dict(params or {}), "rope_parameters"


def read_rope(hf: dict[str, Any], layer_type: str | None = None,
          default_theta: float = 10_000.0) -> tuple[float, RopeScaling | None, float]:
  """``(rope_base, rope_scaling, rotary_fraction)`` of ``layer_type``'s layers, with
  transformers' defaults; a kind flax_tp does not implement is named."""
  rope, field = rope_dict(hf, layer_type)
  theta = read_number(rope if rope.get("rope_theta") is not None else hf, "rope_theta",
                  default_theta, integer=False)
  fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
  fraction = 1.0 if fraction is None else float(fraction)
  if not 0 < fraction <= 1:
    raise HFConfigError(f"partial_rotary_factor {fraction!r} is not in (0, 1]")
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise HFConfigError(f"{field} rope_type {kind!r} is not implemented (flax_tp implements "
                        f"{ROPE_TYPES}; 'dynamic' rescales with the sequence, 'longrope' "
                        "needs per-dimension factors)")
  if kind == "default":
    return theta, None, fraction
  factor = rope.get("factor")
  original = hf.get("original_max_position_embeddings") or rope.get(
      "original_max_position_embeddings") or hf.get("max_position_embeddings")
  if kind == "yarn" and factor is None and original:
    factor = read_number(hf, "max_position_embeddings", integer=True) / original
  factor = read_number({"factor": factor}, "factor", integer=False)
  if kind == "linear":
    return theta, RopeScaling("linear", factor), fraction
  original = read_number({"original_max_position_embeddings": original},
                     "original_max_position_embeddings", integer=True)
  if kind == "llama3":
    return theta, RopeScaling(
        "llama3", factor, low_freq_factor=read_number(rope, "low_freq_factor", integer=False),
        high_freq_factor=read_number(rope, "high_freq_factor", integer=False),
        original_max_len=original), fraction

  def mscale(scale, m=1.0):  # transformers' get_mscale
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention = rope.get("attention_factor")
  if attention is None:
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else \
        mscale(factor)
  return theta, RopeScaling(
      "yarn", factor, original_max_len=original, attention_factor=float(attention),
      beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
      truncate=bool(rope.get("truncate", True))), fraction


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
  theta, scaling, fraction = read_rope(hf)
  return dict(rope_base=theta, rope_scaling=scaling, rotary_fraction=fraction)


def rope_out(cfg: TransformerConfig) -> dict[str, Any]:
  """The rope fields of a config.json (legacy form, which transformers 4 and 5 read)."""
  out = dict(rope_theta=cfg.rope_base)
  if cfg.rope_scaling is not None:
    out["rope_scaling"] = scaling_out(cfg.rope_scaling)
  if cfg.rotary_fraction != 1.0:
    out["partial_rotary_factor"] = cfg.rotary_fraction
  return out


def scaling_out(scaling: RopeScaling | None) -> dict[str, Any]:
  if scaling is None:
    return {"rope_type": "default"}
  out = dict(rope_type=scaling.kind, factor=scaling.factor)
  if scaling.kind == "llama3":
    out.update(low_freq_factor=scaling.low_freq_factor,
               high_freq_factor=scaling.high_freq_factor,
               original_max_position_embeddings=scaling.original_max_len)
  elif scaling.kind == "yarn":
    out.update(original_max_position_embeddings=scaling.original_max_len,
               attention_factor=scaling.attention_factor, beta_fast=scaling.beta_fast,
               beta_slow=scaling.beta_slow, truncate=scaling.truncate)
  return out


def per_layer_type_rope(hf: dict[str, Any], full_theta: float,
                         sliding_theta: float) -> dict[str, Any]:
  """The rope fields of a family whose full and sliding layers each have their own
  (Gemma 3, OLMo 3: ``rope_parameters`` keyed by layer type; Gemma 3's legacy form,
  ``rope_theta`` / ``rope_scaling`` for the full layers and ``rope_local_base_freq``).
  The sliding layers' must be a plain base (``rope_local_base``)."""
  nested = isinstance(hf.get("rope_parameters"), dict) and any(
      isinstance(v, dict) for v in hf["rope_parameters"].values())
  if nested:
    theta, scaling, fraction = read_rope(hf, FULL, full_theta)
    local, local_scaling, local_fraction = read_rope(hf, SLIDING, sliding_theta)
  else:  # legacy: rope_theta and rope_scaling for global layers, rope_local_base_freq
    theta, scaling, fraction = read_rope(hf, None, full_theta)
    local, local_scaling, local_fraction = read_number(hf, "rope_local_base_freq", sliding_theta,
                                                   integer=False), None, fraction
  if local_scaling is not None or local_fraction != fraction:
    raise HFConfigError("rope_parameters of sliding_attention layers with scaling or their "
                        "own partial_rotary_factor are not implemented (only a plain base)")
  return dict(rope_base=theta, rope_scaling=scaling, rotary_fraction=fraction,
              rope_local_base=local)


def per_layer_type_rope_out(cfg: TransformerConfig) -> dict[str, Any]:
  local = cfg.rope_base if cfg.rope_local_base is None else cfg.rope_local_base
  return {"rope_parameters": {
      FULL: dict(scaling_out(cfg.rope_scaling), rope_theta=cfg.rope_base),
      SLIDING: dict(rope_type="default", rope_theta=local)}}


