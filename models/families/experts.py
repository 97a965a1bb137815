"""The mixture-of-experts families' config readers and writers: the experts' and
routers' fields they share (softmax or DeepSeek's sigmoid router with groups), Mixtral,
Qwen2/3-MoE, GLM-4.5, GPT-OSS and DeepSeek-V3 (with its latent attention)."""

from __future__ import annotations

import math
from typing import Any

from models.config import FULL, SLIDING, TransformerConfig
from models.families.dense import (
  NO_GEMMA,
  mistral_read,
  mistral_write,
  qwen3_read,
  qwen3_write,
  qwen_windows_out,
)
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
  require,
  window_fields,
)
from models.families.rope import rope_dict, scaling_out
from models.families.tensors import gpt_oss_expert_tensors, latent_attention_tensors


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
  fields = dict(num_experts=read_number(hf, field, integer=True),
                experts_per_token=read_number(hf, "num_experts_per_tok", integer=True),
                normalize_top_k=(read_flag(hf, "norm_topk_prob", False) if normalize is None
                                 else normalize),
                # transformers adds the load-balancing loss only with output_router_logits
                router_aux_loss_coef=(float(hf.get("router_aux_loss_coef") or 0.0)
                                      if read_flag(hf, "output_router_logits", False) else 0.0))
  if expert_width is not None:
    fields["expert_d_ff"] = read_number(hf, expert_width, integer=True)
  step = read_number(hf, "decoder_sparse_step", 1, integer=True)
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
    require(cfg, family, normalize_top_k=True, moe_layers=None, shared_expert_d_ff=None,
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
  width = read_number(hf, "moe_intermediate_size", integer=True)
  count = next((f for f in ("n_routed_experts", "num_local_experts") if hf.get(f) is not None),
               "n_routed_experts")
  n_shared = hf.get("n_shared_experts", 1)
  if n_shared is None or n_shared == 0:
    shared_width = None
  else:
    shared_width = read_number(hf, "n_shared_experts", integer=True) * width
  layers = shared["num_layers"]
  dense = hf.get("first_k_dense_replace", defaults["first_k_dense_replace"])
  dense = 0 if dense in (None, 0) else read_number(hf, "first_k_dense_replace", integer=True)
  if dense >= layers:
    raise HFConfigError(f"first_k_dense_replace {dense} leaves no MoE layer of "
                        f"num_hidden_layers {layers}")
  return dict(
      num_experts=read_number(hf, count, integer=True),
      experts_per_token=read_number(hf, "num_experts_per_tok", integer=True),
      expert_d_ff=width, shared_expert_d_ff=shared_width, shared_expert_gated=False,
      normalize_top_k=read_flag(hf, "norm_topk_prob", True), router_score="sigmoid",
      router_selection_bias=True,
      expert_groups=read_number(hf, "n_group", defaults["n_group"], integer=True),
      expert_groups_per_token=read_number(hf, "topk_group", defaults["topk_group"], integer=True),
      routed_scale=read_number(hf, "routed_scaling_factor", 1.0, integer=False),
      moe_layers=None if dense == 0 else tuple(range(dense, layers)),
      router_aux_loss_coef=0.0)


def _deepseek_router_out(cfg: TransformerConfig, family: str) -> dict[str, Any]:
  if not cfg.has_experts:
    raise HFConfigError(f"{family} is a mixture of experts; this model has none")
  require(cfg, family, router_score="sigmoid", router_selection_bias=True,
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
  return dict(mistral_read(hf, shared), **_experts(
      hf, shared, count=("num_local_experts", "num_experts"), expert_width=None,
      normalize=True))


def _mixtral_write(cfg):
  require(cfg, "mixtral", **_SOFTMAX_ROUTER)
  return dict(mistral_write(cfg), **_experts_out(cfg, "mixtral", "num_local_experts", None))


def _qwen2_moe_read(hf, shared):
  fields = dict(qkv_bias=read_flag(hf, "qkv_bias", True), attn_out_bias=False, mlp_bias=False,
                mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
                **qwen_window_fields(hf, shared["num_layers"]))
  fields.update(_experts(hf, shared, count=("num_experts", "num_local_experts"),
                         expert_width="moe_intermediate_size", normalize=None))
  fields["shared_expert_d_ff"] = read_optional(hf, "shared_expert_intermediate_size",
                                           integer=True)
  return fields


def _qwen2_moe_write(cfg):
  require(cfg, "qwen2_moe", norm="rmsnorm", mlp="swiglu", qk_norm=False, attn_out_bias=False,
           mlp_bias=False, rotary_fraction=1.0, **NO_GEMMA, **_SOFTMAX_ROUTER)
  if not cfg.shared_expert_d_ff:
    raise HFConfigError("qwen2_moe has a shared expert; this model has none "
                        "(shared_expert_d_ff is None): write it as qwen3_moe")
  return dict(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.shared_expert_d_ff,
              **qwen_windows_out(cfg),
              **_experts_out(cfg, "qwen2_moe", "num_experts", "moe_intermediate_size"))


def _qwen3_moe_read(hf, shared):
  return dict(qwen3_read(hf, shared), **_experts(
      hf, shared, count=("num_experts", "num_local_experts"),
      expert_width="moe_intermediate_size", normalize=None))


def _qwen3_moe_write(cfg):
  require(cfg, "qwen3_moe", shared_expert_d_ff=None, **_SOFTMAX_ROUTER)
  return dict(qwen3_write(cfg), **_experts_out(cfg, "qwen3_moe", "num_experts",
                                                "moe_intermediate_size"))


# GLM-4.5 / 4.6 (glm4_moe): grouped-query attention with q/k/v biases (attention_bias; o
# has none), q/k norms per head (use_qk_norm), rotary on the first half of each head
# (partial_rotary_factor, 0.5 when absent, as transformers defaults it), DeepSeek-V3's
# router and shared experts.
def _glm4_moe_read(hf, shared):
  bias = read_flag(hf, "attention_bias", False)
  fields = dict(qkv_bias=bias, attn_out_bias=False, mlp_bias=False,
                qk_norm=read_flag(hf, "use_qk_norm", False),
                mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
                **_deepseek_router(hf, shared))
  rope, _ = rope_dict(hf, None)
  if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) is None:
    fields["rotary_fraction"] = 0.5
  return fields


def _glm4_moe_write(cfg):
  require(cfg, "glm4_moe", norm="rmsnorm", mlp="swiglu", attn_out_bias=False, mlp_bias=False,
           layer_types=None, **NO_GEMMA)
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
  bias = read_flag(hf, "attention_bias", True)
  layers = shared["num_layers"]
  types = read_layer_types(hf, layers, lambda i: SLIDING if (i + 1) % 2 else FULL)
  fields = dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=False, attn_sinks=True,
                router_bias=True, expert_bias=True,
                mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
                swiglu_limit=read_number(hf, "swiglu_limit", 7.0, integer=False),
                swiglu_alpha=read_number(hf, "swiglu_alpha", 1.702, integer=False),
                **window_fields(types, read_optional(hf, "sliding_window", integer=True)))
  fields.update(_experts(hf, shared, count=("num_local_experts", "num_experts"),
                         expert_width=None, normalize=True))
  return fields


def _gpt_oss_write(cfg):
  require(cfg, "gpt_oss", norm="rmsnorm", mlp="swiglu", qk_norm=False, mlp_bias=False,
           attn_sinks=True, router_bias=True, expert_bias=True, rotary_fraction=1.0,
           attn_out_bias=cfg.qkv_bias, **NO_GEMMA, **_SOFTMAX_ROUTER)
  if cfg.swiglu_limit is None:
    raise HFConfigError("swiglu_limit=None has no gpt_oss equivalent (its experts clamp)")
  return dict(attention_bias=cfg.qkv_bias, swiglu_limit=cfg.swiglu_limit,
              swiglu_alpha=cfg.swiglu_alpha, **layer_types_out(cfg),
              **_experts_out(cfg, "gpt_oss", "num_local_experts", None))


# DeepSeek-V3 (deepseek_v3; also Kimi K2's text backbone): multi-head latent attention
# (models.transformer.LatentAttention) and the router GLM-4.5 shares. config.json's
# head_dim is qk_rope_head_dim (transformers sets it so for its rotary tables); a q/k head
# is qk_nope + qk_rope wide. attention_bias puts biases on q_a, kv_a and o. With yarn and
# mscale_all_dim the scores are scaled by mscale(factor, mscale_all_dim) ** 2 beyond
# qk_head_dim ** -0.5 (transformers' yarn_apply_mscale).
def _mla_scale(hf: dict[str, Any], head_dim: int) -> float | None:
  rope, _ = rope_dict(hf, None)
  if rope.get("rope_type", rope.get("type", "default")) == "default":
    return None
  m_all = rope.get("mscale_all_dim")
  if not m_all:
    return None
  factor = read_number(rope, "factor", integer=False)
  mscale = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
  return head_dim ** -0.5 * mscale * mscale


def _deepseek_v3_read(hf, shared):
  heads = shared["num_heads"]
  if shared["num_kv_heads"] != heads:
    raise HFConfigError(f"num_key_value_heads {shared['num_kv_heads']} is not "
                        f"num_attention_heads {heads}: latent attention expands a k and v "
                        "head per query head (transformers' would not run otherwise)")
  rope = read_number(hf, "qk_rope_head_dim", 64, integer=True)
  head_dim = read_number(hf, "qk_nope_head_dim", 128, integer=True) + rope
  bias = read_flag(hf, "attention_bias", False)
  return dict(
      num_kv_heads=None, head_dim=head_dim, qk_rope_head_dim=rope,
      v_head_dim=read_number(hf, "v_head_dim", 128, integer=True),
      kv_lora_rank=read_number(hf, "kv_lora_rank", 512, integer=True),
      q_lora_rank=read_optional(hf, "q_lora_rank", integer=True) if "q_lora_rank" in hf else 1536,
      rope_interleave=read_flag(hf, "rope_interleave", True), attn_scale=_mla_scale(hf, head_dim),
      qkv_bias=bias, attn_out_bias=bias, mlp_bias=False,
      mlp=read_activation(hf, ("hidden_act",), {"silu": "swiglu"}),
      **_deepseek_router(hf, shared, _DEEPSEEK_ROUTER_DEFAULTS))


def _deepseek_v3_write(cfg):
  require(cfg, "deepseek_v3", norm="rmsnorm", mlp="swiglu", mlp_bias=False, layer_types=None,
           qkv_bias=cfg.attn_out_bias, **{**NO_GEMMA, "attn_scale": cfg.attn_scale})
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
    out["rope_scaling"] = dict(scaling_out(cfg.rope_scaling), mscale_all_dim=(
        math.sqrt(cfg.attn_scale / plain) - 1.0) / (0.1 * math.log(factor)))
  return dict(attention_bias=cfg.attn_out_bias, head_dim=cfg.qk_rope_head_dim,
              qk_rope_head_dim=cfg.qk_rope_head_dim,
              qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim, v_head_dim=cfg.value_dim,
              kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
              rope_interleave=cfg.rope_interleave, **out,
              **_deepseek_router_out(cfg, "deepseek_v3"))


# The mixture-of-experts families (``catalog.FAMILIES``), each with where its experts live.
MOE_FAMILIES = (
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
           mtp_fields=("num_nextn_predict_layers", "num_mtp_layers"),
           attention=latent_attention_tensors),
    Family("gpt_oss", "GptOssForCausalLM", _gpt_oss_read, _gpt_oss_write, moe_prefix="mlp",
           experts=gpt_oss_expert_tensors),
)
