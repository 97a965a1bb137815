"""The HuggingFace model families flax_tp loads and writes, each one declaration.

A ``Family`` says how its ``config.json`` maps onto ``TransformerConfig`` (``read``:
the family's own fields over the ones every family shares, read by ``_shared``),
how a config is written back (``write``), and which tensors it stores fused
(``fused``). The tensor names themselves are shared (``tensor_names``): Llama's,
with the extra norms a config asks for (``qk_norm``: ``self_attn.q_norm``/``k_norm``,
over a head or, OLMo 2/3, the whole projection; ``sandwich_norm``: Gemma 2's four norms
per layer, OLMo's two after the branches without ``pre_norm``). Adding a family is a declaration
here, and a mechanism in ``models/transformer.py`` only when it brings a new one.

A config field that changes the computation and is not honoured is an error
naming it (``HFConfigError``), never a silently different model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

from models.config import FULL, SLIDING, RopeScaling, TransformerConfig


class HFConfigError(ValueError):
  """A config.json flax_tp cannot honour exactly (never silently a different model)."""


# -- reading fields --------------------------------------------------------------------------

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


def _optional(hf: dict[str, Any], field: str, *, integer: bool) -> Any:
  """``hf[field]`` as ``_number`` reads it, or None where absent or null."""
  return None if hf.get(field) is None else _number(hf, field, integer=integer)


def _flag(hf: dict[str, Any], field: str, default: bool) -> bool:
  value = hf.get(field, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise HFConfigError(f"config.json field {field!r} is {value!r}; expected true or false")
  return value


def _activation(hf: dict[str, Any], fields: tuple[str, ...], honoured: dict[str, str]) -> str:
  """The MLP kind of the first of ``fields`` present (``hidden_act``, Gemma 2's
  ``hidden_activation``), by ``honoured`` {HF activation: mlp kind}."""
  for field in fields:
    if hf.get(field) is not None:
      if hf[field] not in honoured:
        raise HFConfigError(f"{field} {hf[field]!r} is not supported (expected one of "
                            f"{tuple(honoured)})")
      return honoured[hf[field]]
  return next(iter(honoured.values()))


# -- rotary ----------------------------------------------------------------------------------

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_dict(hf: dict[str, Any], layer_type: str | None) -> tuple[dict[str, Any], str]:
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


def _rope(hf: dict[str, Any], layer_type: str | None = None,
          default_theta: float = 10_000.0) -> tuple[float, RopeScaling | None, float]:
  """``(rope_base, rope_scaling, rotary_fraction)`` of ``layer_type``'s layers, with
  transformers' defaults; a kind flax_tp does not implement is named."""
  rope, field = _rope_dict(hf, layer_type)
  theta = _number(rope if rope.get("rope_theta") is not None else hf, "rope_theta",
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
    factor = _number(hf, "max_position_embeddings", integer=True) / original
  factor = _number({"factor": factor}, "factor", integer=False)
  if kind == "linear":
    return theta, RopeScaling("linear", factor), fraction
  original = _number({"original_max_position_embeddings": original},
                     "original_max_position_embeddings", integer=True)
  if kind == "llama3":
    return theta, RopeScaling(
        "llama3", factor, low_freq_factor=_number(rope, "low_freq_factor", integer=False),
        high_freq_factor=_number(rope, "high_freq_factor", integer=False),
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


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
  theta, scaling, fraction = _rope(hf)
  return dict(rope_base=theta, rope_scaling=scaling, rotary_fraction=fraction)


def _rope_out(cfg: TransformerConfig) -> dict[str, Any]:
  """The rope fields of a config.json (legacy form, which transformers 4 and 5 read)."""
  out = dict(rope_theta=cfg.rope_base)
  if cfg.rope_scaling is not None:
    out["rope_scaling"] = _scaling_out(cfg.rope_scaling)
  if cfg.rotary_fraction != 1.0:
    out["partial_rotary_factor"] = cfg.rotary_fraction
  return out


def _scaling_out(scaling: RopeScaling | None) -> dict[str, Any]:
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


# -- attention layouts -----------------------------------------------------------------------

def _layer_types(hf: dict[str, Any], layers: int, default: Callable[[int], str]) -> tuple:
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


def _windows(types: tuple, window: int | None) -> dict[str, Any]:
  """``layer_types`` / ``sliding_window`` fields: None where every layer is full (or no
  layer has a window to slide)."""
  if window is None or SLIDING not in types:
    return dict(layer_types=None, sliding_window=None)
  return dict(layer_types=types, sliding_window=window)


def _qwen_windows(hf: dict[str, Any], layers: int) -> dict[str, Any]:
  """Qwen2/Qwen3: sliding layers only with ``use_sliding_window`` (from
  ``max_window_layers`` on, unless ``layer_types`` says which)."""
  window = _optional(hf, "sliding_window", integer=True) if _flag(
      hf, "use_sliding_window", False) else None
  first = hf.get("max_window_layers") or 0
  types = _layer_types(hf, layers, lambda i: SLIDING if window is not None and i >= first
                       else FULL)
  return _windows(types, window)


def _no_bidirectional(hf: dict[str, Any]) -> None:
  if hf.get("use_bidirectional_attention"):
    raise HFConfigError("use_bidirectional_attention true is not implemented (flax_tp's "
                        "attention is causal)")


def _layer_types_out(cfg: TransformerConfig) -> dict[str, Any]:
  if cfg.layer_types is None:
    return dict(layer_types=[FULL] * cfg.num_layers)
  return dict(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window)


# -- the families ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Family:
  """One HF family: its ``model_type``, architecture, the config fields it reads
  beyond the shared ones, what it writes back, and whether it fuses q/k/v and
  gate/up on disk (Phi-3: ``qkv_proj`` rows q, k, v; ``gate_up_proj`` rows gate, up).

  read: config.json -> ``TransformerConfig`` fields that override the shared ones.
  write: config -> config.json fields beyond the shared ones (``HFConfigError`` for a
  config the family cannot represent).
  """

  model_type: str
  architecture: str
  read: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
  write: Callable[[TransformerConfig], dict[str, Any]]
  fused: bool = False
  # Mixture of experts: the prefix of a layer's MoE tensors in the per-expert form
  # transformers' save_pretrained writes (Mixtral's "block_sparse_moe", Qwen's "mlp"),
  # and the names of an expert's gate, up and down there. None: a dense family.
  moe_prefix: str | None = None
  expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  shared_expert: str = "shared_expert"  # the shared expert's module (GLM's "shared_experts")
  # Multi-token-prediction layers a checkpoint may hold after its decoder layers (the
  # config.json fields that count them; DeepSeek-V3, GLM-4.5): not run by a causal LM
  # (transformers ignores them too), skipped by name on load with a warning.
  mtp_fields: tuple[str, ...] = ()

  @property
  def name(self) -> str | None:
    """``TransformerConfig.family``: None for Llama and Qwen2, which the biases tell
    apart (a run written before the families keeps its identity)."""
    return None if self.model_type in ("llama", "qwen2") else self.model_type


# What Gemma 2/3 add, absent from every other family (their writers require it so).
_NO_GEMMA = dict(sandwich_norm=False, attn_scale=None, attn_softcap=None, final_softcap=None,
                 rope_local_base=None, embed_scale=False)


def _llama_read(hf, shared):
  bias = _flag(hf, "attention_bias", False)
  return dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=_flag(hf, "mlp_bias", False),
              mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}))


def _llama_write(cfg):
  _require(cfg, "llama", norm="rmsnorm", mlp="swiglu", qk_norm=False, layer_types=None,
           rotary_fraction=1.0, **_NO_GEMMA)
  if cfg.qkv_bias != cfg.attn_out_bias:
    raise HFConfigError(f"qkv_bias={cfg.qkv_bias}, attn_out_bias={cfg.attn_out_bias}: Llama "
                        "has both or neither, Qwen2 q/k/v biases only")
  return dict(attention_bias=cfg.attn_out_bias, mlp_bias=cfg.mlp_bias)


def _qwen2_read(hf, shared):
  return dict(qkv_bias=True, attn_out_bias=False, mlp_bias=False,
              mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
              **_qwen_windows(hf, shared["num_layers"]))


def _qwen_windows_out(cfg):
  if cfg.layer_types is None:
    return dict(use_sliding_window=False)
  return dict(use_sliding_window=True, max_window_layers=0, **_layer_types_out(cfg))


def _qwen2_write(cfg):
  _require(cfg, "qwen2", norm="rmsnorm", mlp="swiglu", qk_norm=False, qkv_bias=True,
           attn_out_bias=False, mlp_bias=False, rotary_fraction=1.0, **_NO_GEMMA)
  return _qwen_windows_out(cfg)


def _qwen3_read(hf, shared):
  bias = _flag(hf, "attention_bias", False)
  return dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=False, qk_norm=True,
              mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
              **_qwen_windows(hf, shared["num_layers"]))


def _qwen3_write(cfg):
  _require(cfg, "qwen3", norm="rmsnorm", mlp="swiglu", qk_norm=True, mlp_bias=False,
           qkv_bias=cfg.attn_out_bias, rotary_fraction=1.0, **_NO_GEMMA)
  return dict(attention_bias=cfg.attn_out_bias, **_qwen_windows_out(cfg))


def _mistral_read(hf, shared):
  window = _optional(hf, "sliding_window", integer=True)
  if hf.get("layer_types") is not None:
    raise HFConfigError("layer_types in a mistral config is not what transformers' Mistral "
                        "reads (its sliding_window applies to every layer); load it as "
                        "its own family")
  return dict(qkv_bias=False, attn_out_bias=False, mlp_bias=False,
              mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
              **_windows((SLIDING,) * shared["num_layers"], window))


def _mistral_write(cfg):
  _require(cfg, "mistral", norm="rmsnorm", mlp="swiglu", qk_norm=False, qkv_bias=False,
           attn_out_bias=False, mlp_bias=False, rotary_fraction=1.0, **_NO_GEMMA)
  if cfg.layer_types is not None and set(cfg.layer_types) != {SLIDING}:
    raise HFConfigError("mistral's sliding_window applies to every layer; this model mixes "
                        "full and sliding layers")
  return dict(sliding_window=cfg.sliding_window)


_GELU_TANH = {"gelu_pytorch_tanh": "geglu", "gelu_tanh": "geglu"}


def _gemma_read(hf, shared):
  _no_bidirectional(hf)
  bias = _flag(hf, "attention_bias", False)
  return dict(norm="rmsnorm_offset", embed_scale=True, qkv_bias=bias, attn_out_bias=bias,
              mlp_bias=False, tie_embeddings=_flag(hf, "tie_word_embeddings", True),
              mlp=_activation(hf, ("hidden_act", "hidden_activation"), _GELU_TANH))


def _gemma_write(cfg):
  _require(cfg, "gemma", norm="rmsnorm_offset", mlp="geglu", qk_norm=False, layer_types=None,
           mlp_bias=False, qkv_bias=cfg.attn_out_bias, rotary_fraction=1.0,
           **{**_NO_GEMMA, "embed_scale": True})
  return dict(attention_bias=cfg.attn_out_bias, hidden_act="gelu_pytorch_tanh")


def _gemma2_read(hf, shared):
  fields = _gemma_read(hf, shared)
  fields["mlp"] = _activation(hf, ("hidden_activation", "hidden_act"), _GELU_TANH)
  layers = shared["num_layers"]
  types = _layer_types(hf, layers, lambda i: SLIDING if (i + 1) % 2 else FULL)
  return dict(fields, sandwich_norm=True,
              attn_scale=_number(hf, "query_pre_attn_scalar", 256, integer=False) ** -0.5,
              attn_softcap=_optional(hf, "attn_logit_softcapping", integer=False),
              final_softcap=_optional(hf, "final_logit_softcapping", integer=False),
              **_windows(types, _optional(hf, "sliding_window", integer=True)))


def _gemma2_out(cfg, family):
  _require(cfg, family, norm="rmsnorm_offset", mlp="geglu", embed_scale=True,
           sandwich_norm=True, mlp_bias=False, qkv_bias=cfg.attn_out_bias,
           rotary_fraction=1.0)
  if cfg.attn_scale is None:
    raise HFConfigError(f"{family} needs attn_scale (query_pre_attn_scalar ** -0.5)")
  return dict(attention_bias=cfg.attn_out_bias, hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=_whole(round(cfg.attn_scale ** -2, 6)),
              attn_logit_softcapping=cfg.attn_softcap,
              final_logit_softcapping=cfg.final_softcap, **_layer_types_out(cfg))


def _whole(x: float) -> float | int:
  return int(x) if float(x).is_integer() else x


def _gemma2_write(cfg):
  _require(cfg, "gemma2", qk_norm=False, rope_local_base=None)
  return _gemma2_out(cfg, "gemma2")


def _gemma3_read(hf, shared):
  fields = _gemma2_read(hf, shared)
  layers = shared["num_layers"]
  pattern = hf.get("sliding_window_pattern") or 6
  types = _layer_types(hf, layers, lambda i: SLIDING if (i + 1) % pattern else FULL)
  fields.update(_windows(types, _optional(hf, "sliding_window", integer=True)))
  return dict(fields, qk_norm=True, **_per_layer_type_rope(hf, 1_000_000.0, 10_000.0))


def _per_layer_type_rope(hf: dict[str, Any], full_theta: float,
                         sliding_theta: float) -> dict[str, Any]:
  """The rope fields of a family whose full and sliding layers each have their own
  (Gemma 3, OLMo 3: ``rope_parameters`` keyed by layer type; Gemma 3's legacy form,
  ``rope_theta`` / ``rope_scaling`` for the full layers and ``rope_local_base_freq``).
  The sliding layers' must be a plain base (``rope_local_base``)."""
  nested = isinstance(hf.get("rope_parameters"), dict) and any(
      isinstance(v, dict) for v in hf["rope_parameters"].values())
  if nested:
    theta, scaling, fraction = _rope(hf, FULL, full_theta)
    local, local_scaling, local_fraction = _rope(hf, SLIDING, sliding_theta)
  else:  # legacy: rope_theta and rope_scaling for global layers, rope_local_base_freq
    theta, scaling, fraction = _rope(hf, None, full_theta)
    local, local_scaling, local_fraction = _number(hf, "rope_local_base_freq", sliding_theta,
                                                   integer=False), None, fraction
  if local_scaling is not None or local_fraction != fraction:
    raise HFConfigError("rope_parameters of sliding_attention layers with scaling or their "
                        "own partial_rotary_factor are not implemented (only a plain base)")
  return dict(rope_base=theta, rope_scaling=scaling, rotary_fraction=fraction,
              rope_local_base=local)


def _per_layer_type_rope_out(cfg: TransformerConfig) -> dict[str, Any]:
  local = cfg.rope_base if cfg.rope_local_base is None else cfg.rope_local_base
  return {"rope_parameters": {
      FULL: dict(_scaling_out(cfg.rope_scaling), rope_theta=cfg.rope_base),
      SLIDING: dict(rope_type="default", rope_theta=local)}}


def _gemma3_write(cfg):
  _require(cfg, "gemma3_text", qk_norm=True)
  return dict(_gemma2_out(cfg, "gemma3_text"), **_per_layer_type_rope_out(cfg))


# OLMo 2 / OLMo 3: RMSNorms on q and k over the whole projection (all heads), and a norm
# only after attention and after the MLP (post_attention_layernorm,
# post_feedforward_layernorm), none before; attention_bias on q, k, v and o; OLMo 3 adds
# sliding layers and rope parameters per layer type.
_OLMO = dict(norm="rmsnorm", qk_norm=True, qk_norm_span="projection", sandwich_norm=True,
             pre_norm=False, mlp_bias=False)


def _olmo2_read(hf, shared):
  bias = _flag(hf, "attention_bias", False)
  return dict(_OLMO, qkv_bias=bias, attn_out_bias=bias,
              norm_eps=_number(hf, "rms_norm_eps", 1e-5, integer=False),
              mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}))


def _olmo_write(cfg, family):
  _require(cfg, family, mlp="swiglu", qkv_bias=cfg.attn_out_bias, rotary_fraction=1.0,
           attn_scale=None, attn_softcap=None, final_softcap=None, embed_scale=False, **_OLMO)
  return dict(attention_bias=cfg.attn_out_bias)


def _olmo2_write(cfg):
  _require(cfg, "olmo2", layer_types=None, rope_local_base=None)
  return _olmo_write(cfg, "olmo2")


def _olmo3_read(hf, shared):
  layers = shared["num_layers"]
  types = _layer_types(hf, layers, lambda i: SLIDING if (i + 1) % 4 else FULL)
  return dict(_olmo2_read(hf, shared), **_per_layer_type_rope(hf, 500_000.0, 500_000.0),
              **_windows(types, _number(hf, "sliding_window", 4096, integer=True)))


def _olmo3_write(cfg):
  return dict(_olmo_write(cfg, "olmo3"), **_layer_types_out(cfg),
              **_per_layer_type_rope_out(cfg))


def _experts(hf: dict[str, Any], shared: dict[str, Any], *, count: tuple[str, ...],
             expert_width: str | None, normalize: bool | None) -> dict[str, Any]:
  """The mixture-of-experts fields of a MoE family's config.json. ``count``: the fields
  that may hold the number of experts (transformers maps one onto the other);
  ``expert_width``: the field of each expert's FFN width (None: ``intermediate_size``);
  ``normalize``: Mixtral always renormalises its top-k (True), Qwen reads
  ``norm_topk_prob`` (None)."""
  field = next((f for f in count if hf.get(f) is not None), count[0])
  if hf.get("router_jitter_noise"):
    raise HFConfigError(f"router_jitter_noise {hf['router_jitter_noise']!r} is not implemented "
                        "(flax_tp's router adds no noise in training)")
  fields = dict(num_experts=_number(hf, field, integer=True),
                experts_per_token=_number(hf, "num_experts_per_tok", integer=True),
                normalize_top_k=(_flag(hf, "norm_topk_prob", False) if normalize is None
                                 else normalize),
                # transformers adds the load-balancing loss only with output_router_logits
                router_aux_loss_coef=(float(hf.get("router_aux_loss_coef") or 0.0)
                                      if _flag(hf, "output_router_logits", False) else 0.0))
  if expert_width is not None:
    fields["expert_d_ff"] = _number(hf, expert_width, integer=True)
  step = _number(hf, "decoder_sparse_step", 1, integer=True)
  only = hf.get("mlp_only_layers") or []
  if not isinstance(only, list) or any(not isinstance(i, int) for i in only):
    raise HFConfigError(f"config.json field 'mlp_only_layers' is {only!r}; expected a list of "
                        "layer numbers")
  layers = shared["num_layers"]
  moe = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)
  fields["moe_layers"] = None if len(moe) == layers else moe
  return fields


def _experts_out(cfg: TransformerConfig, family: str, count: str,
                 expert_width: str | None) -> dict[str, Any]:
  if not cfg.has_experts:
    raise HFConfigError(f"{family} is a mixture of experts; this model has none")
  out = {count: cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
         "router_aux_loss_coef": cfg.router_aux_loss_coef,
         "output_router_logits": cfg.router_aux_loss_coef > 0}
  if expert_width is not None:
    out[expert_width] = cfg.expert_width
    out["norm_topk_prob"] = cfg.normalize_top_k
    out["decoder_sparse_step"] = 1
    out["mlp_only_layers"] = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
  else:
    _require(cfg, family, normalize_top_k=True, moe_layers=None, shared_expert_d_ff=None,
             expert_d_ff=None)
  return out


# The router of Mixtral and Qwen: what a family without DeepSeek-V3's router requires.
_SOFTMAX_ROUTER = dict(router_score="softmax", router_selection_bias=False, expert_groups=1,
                       expert_groups_per_token=1, routed_scale=1.0, shared_expert_gated=True)


# The router fields' defaults where a config.json leaves them out (the config classes').
_GLM_ROUTER_DEFAULTS = dict(n_group=1, topk_group=1, first_k_dense_replace=1)
_DEEPSEEK_ROUTER_DEFAULTS = dict(n_group=8, topk_group=4, first_k_dense_replace=3)


def _deepseek_router(hf: dict[str, Any], shared: dict[str, Any],
                     defaults: dict[str, int] = _GLM_ROUTER_DEFAULTS) -> dict[str, Any]:
  """DeepSeek-V3's and GLM-4.5's mixture of experts (``*TopkRouter``): sigmoid scores
  picked with ``e_score_correction_bias`` from the best ``topk_group`` of ``n_group``
  groups, renormalised (``norm_topk_prob``) and scaled (``routed_scaling_factor``);
  ``n_shared_experts`` ungated shared experts of ``moe_intermediate_size`` each, as one
  MLP; the first ``first_k_dense_replace`` layers dense (``intermediate_size``).
  transformers adds no load-balancing loss to these models."""
  if hf.get("scoring_func", "sigmoid") != "sigmoid":
    raise HFConfigError(f"scoring_func {hf['scoring_func']!r} is not what transformers' "
                        "router computes (sigmoid)")
  if hf.get("topk_method", "noaux_tc") != "noaux_tc":
    raise HFConfigError(f"topk_method {hf['topk_method']!r} is not what transformers' router "
                        "computes ('noaux_tc': the biased group-limited top-k)")
  width = _number(hf, "moe_intermediate_size", integer=True)
  count = next((f for f in ("n_routed_experts", "num_local_experts") if hf.get(f) is not None),
               "n_routed_experts")
  n_shared = hf.get("n_shared_experts", 1)
  if n_shared is None or n_shared == 0:
    shared_width = None
  else:
    shared_width = _number(hf, "n_shared_experts", integer=True) * width
  layers = shared["num_layers"]
  dense = hf.get("first_k_dense_replace", defaults["first_k_dense_replace"])
  dense = 0 if dense in (None, 0) else _number(hf, "first_k_dense_replace", integer=True)
  if dense >= layers:
    raise HFConfigError(f"first_k_dense_replace {dense} leaves no MoE layer of "
                        f"num_hidden_layers {layers}")
  return dict(
      num_experts=_number(hf, count, integer=True),
      experts_per_token=_number(hf, "num_experts_per_tok", integer=True),
      expert_d_ff=width, shared_expert_d_ff=shared_width, shared_expert_gated=False,
      normalize_top_k=_flag(hf, "norm_topk_prob", True), router_score="sigmoid",
      router_selection_bias=True,
      expert_groups=_number(hf, "n_group", defaults["n_group"], integer=True),
      expert_groups_per_token=_number(hf, "topk_group", defaults["topk_group"], integer=True),
      routed_scale=_number(hf, "routed_scaling_factor", 1.0, integer=False),
      moe_layers=None if dense == 0 else tuple(range(dense, layers)),
      router_aux_loss_coef=0.0)


def _deepseek_router_out(cfg: TransformerConfig, family: str) -> dict[str, Any]:
  if not cfg.has_experts:
    raise HFConfigError(f"{family} is a mixture of experts; this model has none")
  _require(cfg, family, router_score="sigmoid", router_selection_bias=True,
           shared_expert_gated=False, router_aux_loss_coef=0.0)
  dense = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
  if any(not cfg.is_moe_layer(i) for i in range(dense, cfg.num_layers)):
    raise HFConfigError(f"{family}'s dense layers are its first (first_k_dense_replace); this "
                        f"model's MoE layers are {cfg.moe_layers}")
  shared = cfg.shared_expert_d_ff or 0
  if shared % cfg.expert_width:
    raise HFConfigError(f"{family}'s shared experts are n_shared_experts x "
                        f"moe_intermediate_size wide; shared_expert_d_ff {shared} is not a "
                        f"multiple of {cfg.expert_width}")
  return dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
              moe_intermediate_size=cfg.expert_width,
              n_shared_experts=shared // cfg.expert_width, n_group=cfg.expert_groups,
              topk_group=cfg.expert_groups_per_token, norm_topk_prob=cfg.normalize_top_k,
              routed_scaling_factor=cfg.routed_scale, first_k_dense_replace=dense,
              num_nextn_predict_layers=0)


def _mixtral_read(hf, shared):
  return dict(_mistral_read(hf, shared), **_experts(
      hf, shared, count=("num_local_experts", "num_experts"), expert_width=None,
      normalize=True))


def _mixtral_write(cfg):
  _require(cfg, "mixtral", **_SOFTMAX_ROUTER)
  return dict(_mistral_write(cfg), **_experts_out(cfg, "mixtral", "num_local_experts", None))


def _qwen2_moe_read(hf, shared):
  fields = dict(qkv_bias=_flag(hf, "qkv_bias", True), attn_out_bias=False, mlp_bias=False,
                mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
                **_qwen_windows(hf, shared["num_layers"]))
  fields.update(_experts(hf, shared, count=("num_experts", "num_local_experts"),
                         expert_width="moe_intermediate_size", normalize=None))
  fields["shared_expert_d_ff"] = _optional(hf, "shared_expert_intermediate_size",
                                           integer=True)
  return fields


def _qwen2_moe_write(cfg):
  _require(cfg, "qwen2_moe", norm="rmsnorm", mlp="swiglu", qk_norm=False, attn_out_bias=False,
           mlp_bias=False, rotary_fraction=1.0, **_NO_GEMMA, **_SOFTMAX_ROUTER)
  if not cfg.shared_expert_d_ff:
    raise HFConfigError("qwen2_moe has a shared expert; this model has none "
                        "(shared_expert_d_ff is None): write it as qwen3_moe")
  return dict(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.shared_expert_d_ff,
              **_qwen_windows_out(cfg),
              **_experts_out(cfg, "qwen2_moe", "num_experts", "moe_intermediate_size"))


def _qwen3_moe_read(hf, shared):
  return dict(_qwen3_read(hf, shared), **_experts(
      hf, shared, count=("num_experts", "num_local_experts"),
      expert_width="moe_intermediate_size", normalize=None))


def _qwen3_moe_write(cfg):
  _require(cfg, "qwen3_moe", shared_expert_d_ff=None, **_SOFTMAX_ROUTER)
  return dict(_qwen3_write(cfg), **_experts_out(cfg, "qwen3_moe", "num_experts",
                                                "moe_intermediate_size"))


# GLM-4.5 / 4.6 (glm4_moe): grouped-query attention with q/k/v biases (attention_bias; o
# has none), q/k norms per head (use_qk_norm), rotary on the first half of each head
# (partial_rotary_factor, 0.5 when absent, as transformers defaults it), DeepSeek-V3's
# router and shared experts.
def _glm4_moe_read(hf, shared):
  bias = _flag(hf, "attention_bias", False)
  fields = dict(qkv_bias=bias, attn_out_bias=False, mlp_bias=False,
                qk_norm=_flag(hf, "use_qk_norm", False),
                mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
                **_deepseek_router(hf, shared))
  rope, _ = _rope_dict(hf, None)
  if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) is None:
    fields["rotary_fraction"] = 0.5
  return fields


def _glm4_moe_write(cfg):
  _require(cfg, "glm4_moe", norm="rmsnorm", mlp="swiglu", attn_out_bias=False, mlp_bias=False,
           layer_types=None, **_NO_GEMMA)
  return dict(attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm,
              partial_rotary_factor=cfg.rotary_fraction,
              **_deepseek_router_out(cfg, "glm4_moe"))


# GPT-OSS (gpt_oss): grouped-query attention with biases on q/k/v/o (attention_bias) and a
# sink logit per head (attention sinks), alternating sliding and full layers; a softmax
# router with a bias (its top-k's softmax: the renormalised softmax), experts with biases
# and the clamped SwiGLU (swiglu_limit, swiglu_alpha); yarn rope. Experts stored fused as
# transformers writes them: gate_up_proj [E, H, 2I] (gate and up interleaved along the
# last dim: gate = [..., ::2]), down_proj [E, I, H], in [in, out] order (flax's own).
def _gpt_oss_read(hf, shared):
  bias = _flag(hf, "attention_bias", True)
  layers = shared["num_layers"]
  types = _layer_types(hf, layers, lambda i: SLIDING if (i + 1) % 2 else FULL)
  fields = dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=False, attn_sinks=True,
                router_bias=True, expert_bias=True,
                mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
                swiglu_limit=_number(hf, "swiglu_limit", 7.0, integer=False),
                swiglu_alpha=_number(hf, "swiglu_alpha", 1.702, integer=False),
                **_windows(types, _optional(hf, "sliding_window", integer=True)))
  fields.update(_experts(hf, shared, count=("num_local_experts", "num_experts"),
                         expert_width=None, normalize=True))
  return fields


def _gpt_oss_write(cfg):
  _require(cfg, "gpt_oss", norm="rmsnorm", mlp="swiglu", qk_norm=False, mlp_bias=False,
           attn_sinks=True, router_bias=True, expert_bias=True, rotary_fraction=1.0,
           attn_out_bias=cfg.qkv_bias, **_NO_GEMMA, **_SOFTMAX_ROUTER)
  if cfg.swiglu_limit is None:
    raise HFConfigError("swiglu_limit=None has no gpt_oss equivalent (its experts clamp)")
  return dict(attention_bias=cfg.qkv_bias, swiglu_limit=cfg.swiglu_limit,
              swiglu_alpha=cfg.swiglu_alpha, **_layer_types_out(cfg),
              **_experts_out(cfg, "gpt_oss", "num_local_experts", None))


# DeepSeek-V3 (deepseek_v3; also Kimi K2's text backbone): multi-head latent attention
# (models.transformer.LatentAttention) and the router GLM-4.5 shares. config.json's
# head_dim is qk_rope_head_dim (transformers sets it so for its rotary tables); a q/k head
# is qk_nope + qk_rope wide. attention_bias puts biases on q_a, kv_a and o. With yarn and
# mscale_all_dim the scores are scaled by mscale(factor, mscale_all_dim) ** 2 beyond
# qk_head_dim ** -0.5 (transformers' yarn_apply_mscale).
def _mla_scale(hf: dict[str, Any], head_dim: int) -> float | None:
  rope, _ = _rope_dict(hf, None)
  if rope.get("rope_type", rope.get("type", "default")) == "default":
    return None
  m_all = rope.get("mscale_all_dim")
  if not m_all:
    return None
  factor = _number(rope, "factor", integer=False)
  mscale = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
  return head_dim ** -0.5 * mscale * mscale


def _deepseek_v3_read(hf, shared):
  heads = shared["num_heads"]
  if shared["num_kv_heads"] != heads:
    raise HFConfigError(f"num_key_value_heads {shared['num_kv_heads']} is not "
                        f"num_attention_heads {heads}: latent attention expands a k and v "
                        "head per query head (transformers' would not run otherwise)")
  rope = _number(hf, "qk_rope_head_dim", 64, integer=True)
  head_dim = _number(hf, "qk_nope_head_dim", 128, integer=True) + rope
  bias = _flag(hf, "attention_bias", False)
  return dict(
      num_kv_heads=None, head_dim=head_dim, qk_rope_head_dim=rope,
      v_head_dim=_number(hf, "v_head_dim", 128, integer=True),
      kv_lora_rank=_number(hf, "kv_lora_rank", 512, integer=True),
      q_lora_rank=_optional(hf, "q_lora_rank", integer=True) if "q_lora_rank" in hf else 1536,
      rope_interleave=_flag(hf, "rope_interleave", True), attn_scale=_mla_scale(hf, head_dim),
      qkv_bias=bias, attn_out_bias=bias, mlp_bias=False,
      mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
      **_deepseek_router(hf, shared, _DEEPSEEK_ROUTER_DEFAULTS))


def _deepseek_v3_write(cfg):
  _require(cfg, "deepseek_v3", norm="rmsnorm", mlp="swiglu", mlp_bias=False, layer_types=None,
           qkv_bias=cfg.attn_out_bias, **{**_NO_GEMMA, "attn_scale": cfg.attn_scale})
  if not cfg.latent_attention:
    raise HFConfigError("deepseek_v3's attention is latent (kv_lora_rank); this model's is not")
  out = {}
  plain = cfg.head_dim ** -0.5
  if cfg.attn_scale is not None and cfg.attn_scale != plain:
    # yarn_apply_mscale: scale = plain * mscale(factor, mscale_all_dim) ** 2 (yarn's own
    # attention_factor is written as it is)
    factor = cfg.rope_scaling.factor if cfg.rope_scaling is not None else 1.0
    if cfg.rope_scaling is None or factor <= 1 or cfg.attn_scale < plain:
      raise HFConfigError(f"attn_scale {cfg.attn_scale!r} has no deepseek_v3 equivalent "
                          f"(qk_head_dim ** -0.5 = {plain!r}, times yarn's mscale ** 2)")
    out["rope_scaling"] = dict(_scaling_out(cfg.rope_scaling), mscale_all_dim=(
        math.sqrt(cfg.attn_scale / plain) - 1.0) / (0.1 * math.log(factor)))
  return dict(attention_bias=cfg.attn_out_bias, head_dim=cfg.qk_rope_head_dim,
              qk_rope_head_dim=cfg.qk_rope_head_dim,
              qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim, v_head_dim=cfg.value_dim,
              kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
              rope_interleave=cfg.rope_interleave, **out,
              **_deepseek_router_out(cfg, "deepseek_v3"))


def _phi3_read(hf, shared):
  return dict(qkv_bias=False, attn_out_bias=False, mlp_bias=False,
              mlp=_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
              **_windows((SLIDING,) * shared["num_layers"],
                         _optional(hf, "sliding_window", integer=True)))


def _phi3_write(cfg):
  _require(cfg, "phi3", norm="rmsnorm", mlp="swiglu", qk_norm=False, qkv_bias=False,
           attn_out_bias=False, mlp_bias=False, **_NO_GEMMA)
  if cfg.layer_types is not None and set(cfg.layer_types) != {SLIDING}:
    raise HFConfigError("phi3's sliding_window applies to every layer; this model mixes "
                        "full and sliding layers")
  return dict(sliding_window=cfg.sliding_window,
              original_max_position_embeddings=cfg.max_seq_len)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", _llama_read, _llama_write),
    Family("qwen2", "Qwen2ForCausalLM", _qwen2_read, _qwen2_write),
    Family("qwen3", "Qwen3ForCausalLM", _qwen3_read, _qwen3_write),
    Family("mistral", "MistralForCausalLM", _mistral_read, _mistral_write),
    Family("gemma", "GemmaForCausalLM", _gemma_read, _gemma_write),
    Family("gemma2", "Gemma2ForCausalLM", _gemma2_read, _gemma2_write),
    Family("gemma3_text", "Gemma3ForCausalLM", _gemma3_read, _gemma3_write),
    Family("phi3", "Phi3ForCausalLM", _phi3_read, _phi3_write, fused=True),
    Family("olmo2", "Olmo2ForCausalLM", _olmo2_read, _olmo2_write),
    Family("olmo3", "Olmo3ForCausalLM", _olmo3_read, _olmo3_write),
    Family("mixtral", "MixtralForCausalLM", _mixtral_read, _mixtral_write,
           moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2")),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", _qwen2_moe_read, _qwen2_moe_write,
           moe_prefix="mlp"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_read, _qwen3_moe_write,
           moe_prefix="mlp"),
    Family("glm4_moe", "Glm4MoeForCausalLM", _glm4_moe_read, _glm4_moe_write,
           moe_prefix="mlp", shared_expert="shared_experts",
           mtp_fields=("num_nextn_predict_layers", "num_mtp_layers")),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", _deepseek_v3_read, _deepseek_v3_write,
           moe_prefix="mlp", shared_expert="shared_experts",
           mtp_fields=("num_nextn_predict_layers", "num_mtp_layers")),
    Family("gpt_oss", "GptOssForCausalLM", _gpt_oss_read, _gpt_oss_write, moe_prefix="mlp"),
)}
SUPPORTED = tuple(FAMILIES)
# The families whose rope fields are per layer type (read by _per_layer_type_rope).
_PER_LAYER_TYPE_ROPE = ("gemma3_text", "olmo3")

# Llama's norm and MLP: what a family has unless its declaration says otherwise.
_LLAMA_DEFAULTS = dict(norm="rmsnorm", mlp="swiglu")


def _require(cfg: TransformerConfig, family: str, **fields) -> None:
  """``HFConfigError`` naming the first of ``fields`` where ``cfg`` differs: a model the
  family cannot represent is never written as it."""
  for name, value in fields.items():
    if getattr(cfg, name) != value:
      raise HFConfigError(f"{name}={getattr(cfg, name)!r} has no {family} equivalent (needs "
                          f"{name}={value!r})")


def _shared(hf: dict[str, Any]) -> dict[str, Any]:
  """The fields every family reads alike (sizes, norm eps, tying, plain rotary)."""
  heads = _number(hf, "num_attention_heads", integer=True)
  d_model = _number(hf, "hidden_size", integer=True)
  if not hf.get("head_dim") and d_model % heads:
    raise HFConfigError(f"config.json field 'hidden_size' {d_model} is not divisible by "
                        f"'num_attention_heads' {heads} and there is no 'head_dim'")
  return dict(
      vocab_size=_number(hf, "vocab_size", integer=True), d_model=d_model, num_heads=heads,
      num_kv_heads=_number(hf, "num_key_value_heads", heads, integer=True),
      head_dim=_number(hf, "head_dim", d_model // heads, integer=True),
      d_ff=_number(hf, "intermediate_size", integer=True),
      num_layers=_number(hf, "num_hidden_layers", integer=True),
      max_seq_len=_number(hf, "max_position_embeddings", 2048, integer=True),
      tie_embeddings=_flag(hf, "tie_word_embeddings", False),
      norm_eps=_number(hf, "rms_norm_eps", 1e-6, integer=False), **_LLAMA_DEFAULTS)


def family_of(hf: dict[str, Any]) -> Family:
  kind = hf.get("model_type")
  if kind not in FAMILIES:
    raise HFConfigError(f"model_type {kind!r} is not supported (expected one of {SUPPORTED})")
  return FAMILIES[kind]


def config_from_hf(hf: dict[str, Any]) -> TransformerConfig:
  """The ``TransformerConfig`` of an HF ``config.json``; ``HFConfigError`` naming the field
  it cannot honour."""
  if not isinstance(hf, dict):
    raise HFConfigError(f"config.json holds a {type(hf).__name__}, not an object of fields")
  family = family_of(hf)
  fp8_block_size(hf)  # (a quantization it cannot read is named here)
  fields = _shared(hf)
  fields.update(_rope_fields(hf) if family.model_type not in _PER_LAYER_TYPE_ROPE else {})
  fields.update(family.read(hf, fields))
  try:
    return TransformerConfig(**fields, family=family.name)
  except ValueError as err:
    raise HFConfigError(f"{family.model_type} config: {err}") from None


def is_mxfp4(hf: dict[str, Any]) -> bool:
  """Whether a checkpoint's experts are MXFP4 (GPT-OSS's release: ``quantization_config``
  ``quant_method`` mxfp4; ``load_hf`` dequantizes their ``*_blocks`` / ``*_scales``)."""
  quant = hf.get("quantization_config")
  return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def fp8_block_size(hf: dict[str, Any]) -> tuple[int, int] | None:
  """The ``[rows, cols]`` blocks of an FP8 block-quantized checkpoint (DeepSeek-V3's
  ``quantization_config``: ``quant_method`` fp8, ``fmt`` e4m3, ``weight_block_size``),
  whose weights ``load_hf`` dequantizes; None for a float or an MXFP4 checkpoint. Any
  other quantization is named (bitsandbytes, GPTQ...: not read)."""
  quant = hf.get("quantization_config")
  if not quant:
    return None
  method = quant.get("quant_method") if isinstance(quant, dict) else None
  if method == "mxfp4" and hf.get("model_type") == "gpt_oss":
    return None
  if method != "fp8":
    raise HFConfigError(f"quantization_config ({method or quant!r}) is not read: flax_tp "
                        "dequantizes FP8 block-quantized checkpoints and GPT-OSS's MXFP4 "
                        "experts only (for another, load a float copy, e.g. transformers' "
                        "from_pretrained then save_pretrained)")
  if quant.get("fmt", "e4m3") != "e4m3":
    raise HFConfigError(f"quantization_config fmt {quant['fmt']!r} is not read (FP8 e4m3 is)")
  block = quant.get("weight_block_size")
  if (not isinstance(block, list) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    raise HFConfigError(f"quantization_config weight_block_size is {block!r}; expected "
                        "[rows, cols] of positive integers (per-tensor FP8 is not read)")
  return tuple(block)


def mtp_prefixes(hf: dict[str, Any], cfg: TransformerConfig) -> tuple[str, ...]:
  """The tensor-name prefixes of the multi-token-prediction layers a checkpoint of this
  config.json may hold after its ``cfg.num_layers`` decoder layers
  (``num_nextn_predict_layers``; ``model.layers.{num_layers + j}.``), which a causal LM
  does not run; none for a family without them."""
  family = family_of(hf)
  field = next((f for f in family.mtp_fields if hf.get(f) is not None), None)
  if field is None or hf[field] == 0:
    return ()
  count = _number(hf, field, integer=True)
  return tuple(f"model.layers.{cfg.num_layers + j}." for j in range(count))


def family_for(cfg: TransformerConfig) -> Family:
  """The family a config is written as: the one it was read from, else (``family``
  None) Llama, or Qwen2 for q/k/v biases only."""
  if cfg.family is not None:
    if cfg.family not in FAMILIES:
      raise HFConfigError(f"family {cfg.family!r} is not one flax_tp writes ({SUPPORTED})")
    return FAMILIES[cfg.family]
  qwen2 = cfg.qkv_bias and not cfg.attn_out_bias and not cfg.mlp_bias
  return FAMILIES["qwen2" if qwen2 else "llama"]


def config_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
  """The HF ``config.json`` of ``cfg`` as its family writes it (``HFConfigError`` for a
  config no family represents)."""
  family = family_for(cfg)
  if cfg.has_experts and family.moe_prefix is None:
    raise HFConfigError(f"this model has mixture-of-experts layers, which {family.model_type} "
                        "cannot hold (a MoE family is mixtral, qwen2_moe, qwen3_moe or "
                        "glm4_moe, deepseek_v3 or gpt_oss)")
  if cfg.norm not in ("rmsnorm", "rmsnorm_offset") or cfg.mlp not in ("swiglu", "geglu"):
    raise HFConfigError(f"norm={cfg.norm!r}, mlp={cfg.mlp!r} has no HF equivalent (needs "
                        "norm='rmsnorm', mlp='swiglu' as Llama, or a family's own)")
  if family.model_type not in ("olmo2", "olmo3"):  # (OLMo's writers require their own)
    _require(cfg, family.model_type, qk_norm_span="head", pre_norm=True)
  if family.model_type != "deepseek_v3":
    _require(cfg, family.model_type, kv_lora_rank=None, rope_interleave=False)
  if family.model_type != "gpt_oss":
    _require(cfg, family.model_type, attn_sinks=False, router_bias=False, expert_bias=False,
             swiglu_limit=None)
  extra = family.write(cfg)  # (each writer refuses what its family cannot represent)
  # (Llama's and Qwen2's fields in the order they were always written: same bytes)
  out = dict(
      model_type=family.model_type, architectures=[family.architecture],
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim)
  if cfg.mlp == "swiglu":
    out["hidden_act"] = "silu"
  out.update(max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps)
  if family.model_type not in _PER_LAYER_TYPE_ROPE:
    out.update(_rope_out(cfg))
  out.update(tie_word_embeddings=cfg.tie_embeddings, torch_dtype="float32")
  if family.name is not None:
    # flax_tp does not keep a checkpoint's special tokens; left unset, transformers would
    # take its class defaults (Phi-3's 32000: beyond a smaller vocabulary, an error)
    out.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
  out.update(extra)
  return out


# -- tensor names ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HFTensor:
  """One tensor of an HF checkpoint: its name, the flax_tp params it holds (one, or
  several fused along its rows with ``sizes`` rows each: the first dim of a matrix, the
  second of a stack of experts' ``[E, out, in]``), and whether it is stored transposed
  (HF's ``[..., out, in]`` against flax's ``kernel [..., in, out]``). ``expert``: the
  tensor is that expert's slice of the param (``[E, ...]``; transformers'
  per-expert layout)."""

  name: str
  paths: tuple[tuple, ...]
  transposed: bool
  sizes: tuple[int, ...] | None = None
  expert: int | None = None
  buffer: bool = False  # not trained (HF's nn.Buffer; a flax_tp.SelectionBias): a gradients
  # state has none
  rows: tuple[int, ...] | None = None  # the param's row i is the checkpoint's row rows[i]
  # (its out dim; a bias's one dim): DeepSeek's interleaved rotary rows, held half-split
  columns: bool = False  # ``sizes`` and ``rows`` lie along the last dim, not the rows: a
  # tensor stored [..., in, out] (GPT-OSS's experts, their biases [E, out])

  @property
  def out_axis(self) -> Callable[[Any], int]:
    """Where ``sizes`` and ``rows`` lie in a checkpoint value of this tensor: the rows
    (``out``) of ``[..., out, in]`` or a bias's one dim, or (``columns``) the last."""
    return (lambda value: -1) if self.columns else _rows_axis


def _rows_axis(value: Any) -> int:
  """The rows (``out``) of ``[..., out, in]``, or the one dim of a bias."""
  return 0 if value.ndim == 1 else value.ndim - 2


_ATTENTION = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"))
_MLP_IN = (("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"))


def _moe_tensors(cfg: TransformerConfig, family: Family, layer: str, at: Callable,
                 experts_fused: bool) -> Iterator[HFTensor]:
  """A MoE layer's tensors: the router, the experts (one tensor per expert and weight,
  as ``save_pretrained`` writes them; or ``experts_fused``, transformers 5's in-memory
  ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` under ``mlp``), and a shared
  expert with its gate."""
  prefix = "mlp" if experts_fused else family.moe_prefix
  yield HFTensor(f"{layer}.{prefix}.gate.weight", (at("mlp", "router"),), True)
  if cfg.router_selection_bias:
    yield HFTensor(f"{layer}.{prefix}.gate.e_score_correction_bias",
                   (at("mlp", "selection_bias"),), False, buffer=True)
  if experts_fused:
    yield HFTensor(f"{layer}.mlp.experts.gate_up_proj", (at("mlp", "gate"), at("mlp", "up")),
                   True, (cfg.expert_width, cfg.expert_width))
    yield HFTensor(f"{layer}.mlp.experts.down_proj", (at("mlp", "down"),), True)
  else:
    for n in range(cfg.num_experts):
      for ours, hf in zip(("gate", "up", "down"), family.expert_names, strict=True):
        yield HFTensor(f"{layer}.{prefix}.experts.{n}.{hf}.weight", (at("mlp", ours),), True,
                       expert=n)
  if cfg.shared_expert_d_ff:
    for ours, hf in (("shared_gate", "gate_proj"), ("shared_up", "up_proj"),
                     ("shared_down", "down_proj")):
      yield HFTensor(f"{layer}.mlp.{family.shared_expert}.{hf}.weight",
                     (at("mlp", ours, "kernel"),), True)
    if cfg.shared_expert_gated:
      yield HFTensor(f"{layer}.mlp.shared_expert_gate.weight",
                     (at("mlp", "shared_expert_gate"),), True)


def _gpt_oss_experts(cfg: TransformerConfig, layer: str, at: Callable) -> Iterator[HFTensor]:
  """GPT-OSS's MoE tensors: the router's weight ``[E, H]`` and bias, the experts fused as
  transformers writes them, gate and up interleaved along gate_up's last dim (``rows``
  takes the even columns, then the odd)."""
  width = cfg.expert_width
  split = tuple(range(0, 2 * width, 2)) + tuple(range(1, 2 * width, 2))
  yield HFTensor(f"{layer}.mlp.router.weight", (at("mlp", "router"),), True)
  yield HFTensor(f"{layer}.mlp.router.bias", (at("mlp", "router_bias"),), False)
  experts = f"{layer}.mlp.experts"
  yield HFTensor(f"{experts}.gate_up_proj", (at("mlp", "gate"), at("mlp", "up")), False,
                 (width, width), rows=split, columns=True)
  yield HFTensor(f"{experts}.gate_up_proj_bias", (at("mlp", "gate_bias"), at("mlp", "up_bias")),
                 False, (width, width), rows=split, columns=True)
  yield HFTensor(f"{experts}.down_proj", (at("mlp", "down"),), False)
  yield HFTensor(f"{experts}.down_proj_bias", (at("mlp", "down_bias"),), False)


def _deinterleaved(width: int, rope: int, blocks: int) -> tuple[int, ...]:
  """Row order of ``blocks`` blocks of ``width`` rows whose last ``rope`` rows hold rotary
  pairs interleaved ``(x0, x1), (x2, x3), ...``: each block's own rows, then its even rope
  rows, then its odd ones (the half-split layout rotary runs on)."""
  keep = width - rope
  block = [*range(keep), *range(keep, width, 2), *range(keep + 1, width, 2)]
  return tuple(b * width + r for b in range(blocks) for r in block)


def _latent_attention_tensors(cfg: TransformerConfig, layer: str,
                              at: Callable) -> Iterator[HFTensor]:
  """DeepSeek-V3's attention tensors (``models.transformer.LatentAttention``); with
  ``rope_interleave`` the rotary rows of q (each head's last ``qk_rope_head_dim``) and of
  kv_a (its last) are permuted to the half-split layout flax_tp holds."""
  rope = cfg.qk_rope_head_dim
  q_rows = kv_rows = None
  if cfg.rope_interleave:
    q_rows = _deinterleaved(cfg.head_dim, rope, cfg.num_heads)
    kv_rows = _deinterleaved(cfg.kv_lora_rank + rope, rope, 1)
  attn = f"{layer}.self_attn"
  bias = cfg.qkv_bias
  if cfg.q_lora_rank is None:
    yield HFTensor(f"{attn}.q_proj.weight", (at("attn", "q", "kernel"),), True, rows=q_rows)
  else:
    yield HFTensor(f"{attn}.q_a_proj.weight", (at("attn", "q_a", "kernel"),), True)
    if bias:
      yield HFTensor(f"{attn}.q_a_proj.bias", (at("attn", "q_a", "bias"),), False)
    yield HFTensor(f"{attn}.q_a_layernorm.weight", (at("attn", "q_a_norm", "scale"),), False)
    yield HFTensor(f"{attn}.q_b_proj.weight", (at("attn", "q_b", "kernel"),), True, rows=q_rows)
  yield HFTensor(f"{attn}.kv_a_proj_with_mqa.weight", (at("attn", "kv_a", "kernel"),), True,
                 rows=kv_rows)
  if bias:
    yield HFTensor(f"{attn}.kv_a_proj_with_mqa.bias", (at("attn", "kv_a", "bias"),), False,
                   rows=kv_rows)
  yield HFTensor(f"{attn}.kv_a_layernorm.weight", (at("attn", "kv_a_norm", "scale"),), False)
  yield HFTensor(f"{attn}.kv_b_proj.weight", (at("attn", "kv_b", "kernel"),), True)
  yield HFTensor(f"{attn}.o_proj.weight", (at("attn", "o", "kernel"),), True)
  if cfg.attn_out_bias:
    yield HFTensor(f"{attn}.o_proj.bias", (at("attn", "o", "bias"),), False)


def tensor_names(cfg: TransformerConfig, experts_fused: bool = False) -> Iterator[HFTensor]:
  """Every tensor of ``cfg``'s HF checkpoint, in its family's names (a MoE family's
  experts one per tensor, or ``experts_fused`` as transformers 5 holds them)."""
  family = family_for(cfg)
  fused = family.fused
  yield HFTensor("model.embed_tokens.weight", (("embed", "embedding"),), False)
  q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
  norms = ([("ln1", "input_layernorm"), ("ln_attn_out", "post_attention_layernorm"),
            ("ln2", "pre_feedforward_layernorm"), ("ln_mlp_out", "post_feedforward_layernorm")]
           if cfg.sandwich_norm else
           [("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")])
  if not cfg.pre_norm:  # OLMo 2/3: only the norms after attention and the MLP
    norms = [(ours, hf) for ours, hf in norms if ours not in ("ln1", "ln2")]
  for i in range(cfg.num_layers):
    layer = f"model.layers.{i}"
    at = lambda *p, i=i: ("blocks", i, *p)
    groups = []  # (our names, HF name, group, bias, row sizes when fused)
    if cfg.latent_attention:
      yield from _latent_attention_tensors(cfg, layer, at)
    elif fused:
      groups.append((("q", "k", "v"), "self_attn.qkv_proj", "attn", cfg.qkv_bias,
                     (q_rows, kv_rows, kv_rows)))
    else:
      groups += [((ours,), hf, "attn", cfg.qkv_bias, None) for ours, hf in _ATTENTION]
    if not cfg.latent_attention:
      groups.append((("o",), "self_attn.o_proj", "attn", cfg.attn_out_bias, None))
    moe = cfg.is_moe_layer(i)
    if moe:
      pass  # (its tensors follow the attention's)
    elif cfg.mlp in ("swiglu", "geglu"):
      if fused:
        groups.append((("gate", "up"), "mlp.gate_up_proj", "mlp", cfg.mlp_bias,
                       (cfg.d_ff, cfg.d_ff)))
      else:
        groups += [((ours,), hf, "mlp", cfg.mlp_bias, None) for ours, hf in _MLP_IN]
    if not moe:
      groups.append((("down",), "mlp.down_proj", "mlp", cfg.mlp_bias, None))
    for ours, hf, group, bias, sizes in groups:
      yield HFTensor(f"{layer}.{hf}.weight", tuple(at(group, n, "kernel") for n in ours), True,
                     sizes)
      if bias:
        yield HFTensor(f"{layer}.{hf}.bias", tuple(at(group, n, "bias") for n in ours), False,
                       sizes)
    if cfg.qk_norm:
      for ours in ("q_norm", "k_norm"):
        yield HFTensor(f"{layer}.self_attn.{ours}.weight", (at("attn", ours, "scale"),), False)
    if cfg.attn_sinks:
      yield HFTensor(f"{layer}.self_attn.sinks", (at("attn", "sinks"),), False)
    if moe and family.model_type == "gpt_oss":
      yield from _gpt_oss_experts(cfg, layer, at)
    elif moe:
      yield from _moe_tensors(cfg, family, layer, at, experts_fused)
    for ours, hf in norms:
      yield HFTensor(f"{layer}.{hf}.weight", (at(ours, "scale"),), False)
  yield HFTensor("model.norm.weight", (("ln_f", "scale"),), False)
  if not cfg.tie_embeddings:
    yield HFTensor("lm_head.weight", (("head", "kernel"),), True)
