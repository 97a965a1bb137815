"""The dense families' config readers and writers: Llama, Qwen2/3, Mistral, Gemma 1-3,
OLMo 2/3, Phi-3."""

from __future__ import annotations

from models.config import FULL, SLIDING
from models.families.family import Family
from models.families.fields import (
  HFConfigError,
  layer_types_out,
  qwen_window_fields,
  read_activation,
  read_flag,
  read_layer_types,
  read_number,
  read_optional,
  refuse_bidirectional,
  require,
  window_fields,
)
from models.families.rope import per_layer_type_rope, per_layer_type_rope_out

# What Gemma 2/3 add, absent from every other family (their writers require it so).
NO_GEMMA = dict(sandwich_norm=False, attn_scale=None, attn_softcap=None, final_softcap=None,
                 rope_local_base=None, embed_scale=False)


def _llama_read(hf, shared):
  bias = read_flag(hf, "attention_bias", False)
  return dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=read_flag(hf, "mlp_bias", False),
              mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}))


def _llama_write(cfg):
  require(cfg, "llama", norm="rmsnorm", mlp="swiglu", qk_norm=False, layer_types=None,
           rotary_fraction=1.0, **NO_GEMMA)
  if cfg.qkv_bias != cfg.attn_out_bias:
    raise HFConfigError(f"qkv_bias={cfg.qkv_bias}, attn_out_bias={cfg.attn_out_bias}: Llama "
                        "has both or neither, Qwen2 q/k/v biases only")
  return dict(attention_bias=cfg.attn_out_bias, mlp_bias=cfg.mlp_bias)


def _qwen2_read(hf, shared):
  return dict(qkv_bias=True, attn_out_bias=False, mlp_bias=False,
              mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
              **qwen_window_fields(hf, shared["num_layers"]))


def qwen_windows_out(cfg):
  if cfg.layer_types is None:
    return dict(use_sliding_window=False)
  return dict(use_sliding_window=True, max_window_layers=0, **layer_types_out(cfg))


def _qwen2_write(cfg):
  require(cfg, "qwen2", norm="rmsnorm", mlp="swiglu", qk_norm=False, qkv_bias=True,
           attn_out_bias=False, mlp_bias=False, rotary_fraction=1.0, **NO_GEMMA)
  return qwen_windows_out(cfg)


def qwen3_read(hf, shared):
  bias = read_flag(hf, "attention_bias", False)
  return dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=False, qk_norm=True,
              mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
              **qwen_window_fields(hf, shared["num_layers"]))


def qwen3_write(cfg):
  require(cfg, "qwen3", norm="rmsnorm", mlp="swiglu", qk_norm=True, mlp_bias=False,
           qkv_bias=cfg.attn_out_bias, rotary_fraction=1.0, **NO_GEMMA)
  return dict(attention_bias=cfg.attn_out_bias, **qwen_windows_out(cfg))


def mistral_read(hf, shared):
  window = read_optional(hf, "sliding_window", integer=True)
  if hf.get("layer_types") is not None:
    raise HFConfigError("layer_types in a mistral config is not what transformers' Mistral "
                        "reads (its sliding_window applies to every layer); load it as "
                        "its own family")
  return dict(qkv_bias=False, attn_out_bias=False, mlp_bias=False,
              mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
              **window_fields((SLIDING,) * shared["num_layers"], window))


def mistral_write(cfg):
  require(cfg, "mistral", norm="rmsnorm", mlp="swiglu", qk_norm=False, qkv_bias=False,
           attn_out_bias=False, mlp_bias=False, rotary_fraction=1.0, **NO_GEMMA)
  if cfg.layer_types is not None and set(cfg.layer_types) != {SLIDING}:
    raise HFConfigError("mistral's sliding_window applies to every layer; this model mixes "
                        "full and sliding layers")
  return dict(sliding_window=cfg.sliding_window)


_GELU_TANH = {"gelu_pytorch_tanh": "geglu", "gelu_tanh": "geglu"}


def _gemma_read(hf, shared):
  refuse_bidirectional(hf)
  bias = read_flag(hf, "attention_bias", False)
  return dict(norm="rmsnorm_offset", embed_scale=True, qkv_bias=bias, attn_out_bias=bias,
              mlp_bias=False, tie_embeddings=read_flag(hf, "tie_word_embeddings", True),
              mlp=read_activation(hf, ("hidden_act", "hidden_activation"), _GELU_TANH))


def _gemma_write(cfg):
  require(cfg, "gemma", norm="rmsnorm_offset", mlp="geglu", qk_norm=False, layer_types=None,
           mlp_bias=False, qkv_bias=cfg.attn_out_bias, rotary_fraction=1.0,
           **{**NO_GEMMA, "embed_scale": True})
  return dict(attention_bias=cfg.attn_out_bias, hidden_act="gelu_pytorch_tanh")


def _gemma2_read(hf, shared):
  fields = _gemma_read(hf, shared)
  fields["mlp"] = read_activation(hf, ("hidden_activation", "hidden_act"), _GELU_TANH)
  layers = shared["num_layers"]
  types = read_layer_types(hf, layers, lambda i: SLIDING if (i + 1) % 2 else FULL)
  return dict(fields, sandwich_norm=True,
              attn_scale=read_number(hf, "query_pre_attn_scalar", 256, integer=False) ** -0.5,
              attn_softcap=read_optional(hf, "attn_logit_softcapping", integer=False),
              final_softcap=read_optional(hf, "final_logit_softcapping", integer=False),
              **window_fields(types, read_optional(hf, "sliding_window", integer=True)))


def _gemma2_out(cfg, family):
  require(cfg, family, norm="rmsnorm_offset", mlp="geglu", embed_scale=True,
           sandwich_norm=True, mlp_bias=False, qkv_bias=cfg.attn_out_bias,
           rotary_fraction=1.0)
  if cfg.attn_scale is None:
    raise HFConfigError(f"{family} needs attn_scale (query_pre_attn_scalar ** -0.5)")
  return dict(attention_bias=cfg.attn_out_bias, hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=_whole(round(cfg.attn_scale ** -2, 6)),
              attn_logit_softcapping=cfg.attn_softcap,
              final_logit_softcapping=cfg.final_softcap, **layer_types_out(cfg))


def _whole(x: float) -> float | int:
  return int(x) if float(x).is_integer() else x


def _gemma2_write(cfg):
  require(cfg, "gemma2", qk_norm=False, rope_local_base=None)
  return _gemma2_out(cfg, "gemma2")


def _gemma3_read(hf, shared):
  fields = _gemma2_read(hf, shared)
  layers = shared["num_layers"]
  pattern = hf.get("sliding_window_pattern") or 6
  types = read_layer_types(hf, layers, lambda i: SLIDING if (i + 1) % pattern else FULL)
  fields.update(window_fields(types, read_optional(hf, "sliding_window", integer=True)))
  return dict(fields, qk_norm=True, **per_layer_type_rope(hf, 1_000_000.0, 10_000.0))


def _gemma3_write(cfg):
  require(cfg, "gemma3_text", qk_norm=True)
  return dict(_gemma2_out(cfg, "gemma3_text"), **per_layer_type_rope_out(cfg))


# OLMo 2 / OLMo 3: RMSNorms on q and k over the whole projection (all heads), and a norm
# only after attention and after the MLP (post_attention_layernorm,
# post_feedforward_layernorm), none before; attention_bias on q, k, v and o; OLMo 3 adds
# sliding layers and rope parameters per layer type.
_OLMO = dict(norm="rmsnorm", qk_norm=True, qk_norm_span="projection", sandwich_norm=True,
             pre_norm=False, mlp_bias=False)


def _olmo2_read(hf, shared):
  bias = read_flag(hf, "attention_bias", False)
  return dict(_OLMO, qkv_bias=bias, attn_out_bias=bias,
              norm_eps=read_number(hf, "rms_norm_eps", 1e-5, integer=False),
              mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}))


def _olmo_write(cfg, family):
  require(cfg, family, mlp="swiglu", qkv_bias=cfg.attn_out_bias, rotary_fraction=1.0,
           attn_scale=None, attn_softcap=None, final_softcap=None, embed_scale=False, **_OLMO)
  return dict(attention_bias=cfg.attn_out_bias)


def _olmo2_write(cfg):
  require(cfg, "olmo2", layer_types=None, rope_local_base=None)
  return _olmo_write(cfg, "olmo2")


def _olmo3_read(hf, shared):
  layers = shared["num_layers"]
  types = read_layer_types(hf, layers, lambda i: SLIDING if (i + 1) % 4 else FULL)
  return dict(_olmo2_read(hf, shared), **per_layer_type_rope(hf, 500_000.0, 500_000.0),
              **window_fields(types, read_number(hf, "sliding_window", 4096, integer=True)))


def _olmo3_write(cfg):
  return dict(_olmo_write(cfg, "olmo3"), **layer_types_out(cfg),
              **per_layer_type_rope_out(cfg))


def _phi3_read(hf, shared):
  return dict(qkv_bias=False, attn_out_bias=False, mlp_bias=False,
              mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
              **window_fields((SLIDING,) * shared["num_layers"],
                         read_optional(hf, "sliding_window", integer=True)))


def _phi3_write(cfg):
  require(cfg, "phi3", norm="rmsnorm", mlp="swiglu", qk_norm=False, qkv_bias=False,
           attn_out_bias=False, mlp_bias=False, **NO_GEMMA)
  if cfg.layer_types is not None and set(cfg.layer_types) != {SLIDING}:
    raise HFConfigError("phi3's sliding_window applies to every layer; this model mixes "
                        "full and sliding layers")
  return dict(sliding_window=cfg.sliding_window,
              original_max_position_embeddings=cfg.max_seq_len)


# The dense families, in the order they are listed (``catalog.FAMILIES``).
DENSE_FAMILIES = (
    Family("llama", "LlamaForCausalLM", _llama_read, _llama_write),
    Family("qwen2", "Qwen2ForCausalLM", _qwen2_read, _qwen2_write),
    Family("qwen3", "Qwen3ForCausalLM", qwen3_read, qwen3_write),
    Family("mistral", "MistralForCausalLM", mistral_read, mistral_write),
    Family("gemma", "GemmaForCausalLM", _gemma_read, _gemma_write),
    Family("gemma2", "Gemma2ForCausalLM", _gemma2_read, _gemma2_write),
    Family("gemma3_text", "Gemma3ForCausalLM", _gemma3_read, _gemma3_write),
    Family("phi3", "Phi3ForCausalLM", _phi3_read, _phi3_write, fused=True),
    Family("olmo2", "Olmo2ForCausalLM", _olmo2_read, _olmo2_write),
    Family("olmo3", "Olmo3ForCausalLM", _olmo3_read, _olmo3_write),
)
