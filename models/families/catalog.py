"""Every family by its ``model_type`` (``FAMILIES``), and config.json to
``TransformerConfig`` and back through them, with the quantization and
multi-token-prediction fields a loader needs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from models.config import TransformerConfig
from models.families.dense import DENSE_FAMILIES
from models.families.experts import MOE_FAMILIES
from models.families.family import Family
from models.families.fields import HFConfigError, read_flag, read_number, require
from models.families.rope import rope_fields, rope_out
from models.families.tensors import HFTensor, dense_mlp_tensors

FAMILIES: dict[str, Family] = {f.model_type: f for f in (*DENSE_FAMILIES, *MOE_FAMILIES)}
SUPPORTED = tuple(FAMILIES)
# The families whose rope fields are per layer type (read by per_layer_type_rope).
_PER_LAYER_TYPE_ROPE = ("gemma3_text", "olmo3")

# Llama's norm and MLP: what a family has unless its declaration says otherwise.
_LLAMA_DEFAULTS = dict(norm="rmsnorm", mlp="swiglu")


def _shared(hf: dict[str, Any]) -> dict[str, Any]:
  """The fields every family reads alike (sizes, norm eps, tying, plain rotary)."""
  heads = read_number(hf, "num_attention_heads", integer=True)
  d_model = read_number(hf, "hidden_size", integer=True)
  if not hf.get("head_dim") and d_model % heads:
    raise HFConfigError(f"config.json field 'hidden_size' {d_model} is not divisible by "
                        f"'num_attention_heads' {heads} and there is no 'head_dim'")
  return dict(
      vocab_size=read_number(hf, "vocab_size", integer=True), d_model=d_model, num_heads=heads,
      num_kv_heads=read_number(hf, "num_key_value_heads", heads, integer=True),
      head_dim=read_number(hf, "head_dim", d_model // heads, integer=True),
      d_ff=read_number(hf, "intermediate_size", integer=True),
      num_layers=read_number(hf, "num_hidden_layers", integer=True),
      max_seq_len=read_number(hf, "max_position_embeddings", 2048, integer=True),
      tie_embeddings=read_flag(hf, "tie_word_embeddings", False),
      norm_eps=read_number(hf, "rms_norm_eps", 1e-6, integer=False),
      padding_idx=_padding_idx(hf), **_LLAMA_DEFAULTS)


def _padding_idx(hf: dict[str, Any]) -> int | None:
  """``pad_token_id``, which every family's transformers model gives its embedding as
  ``padding_idx`` (that row's lookups pass no gradient); negative ids wrap, as torch's."""
  pad = hf.get("pad_token_id")
  if pad is None:
    return None
  vocab = read_number(hf, "vocab_size", integer=True)
  if not (isinstance(pad, int) and not isinstance(pad, bool) and -vocab <= pad < vocab):
    raise HFConfigError(f"config.json field 'pad_token_id' is {pad!r}; expected null or a "
                        f"token id in [-{vocab}, {vocab}) (vocab_size {vocab})")
  return pad % vocab


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
  fields.update(rope_fields(hf) if family.model_type not in _PER_LAYER_TYPE_ROPE else {})
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
  count = read_number(hf, field, integer=True)
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
    require(cfg, family.model_type, qk_norm_span="head", pre_norm=True)
  if family.model_type != "deepseek_v3":
    require(cfg, family.model_type, kv_lora_rank=None, rope_interleave=False)
  if family.model_type != "gpt_oss":
    require(cfg, family.model_type, attn_sinks=False, router_bias=False, expert_bias=False,
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
    out.update(rope_out(cfg))
  out.update(tie_word_embeddings=cfg.tie_embeddings, torch_dtype="float32")
  if family.name is not None:
    # flax_tp does not keep a checkpoint's special tokens; left unset, transformers would
    # take its class defaults (Phi-3's 32000: beyond a smaller vocabulary, an error)
    out.update(bos_token_id=None, eos_token_id=None, pad_token_id=cfg.padding_idx)
  elif cfg.padding_idx is not None:  # (Llama's class default is None: written when set)
    out.update(pad_token_id=cfg.padding_idx)
  out.update(extra)
  return out




def tensor_names(cfg: TransformerConfig, experts_fused: bool = False) -> Iterator[HFTensor]:
  """Every tensor of ``cfg``'s HF checkpoint, in its family's names: the embedding; per
  layer the family's attention tensors, the dense MLP or the family's experts (one tensor
  per expert, or ``experts_fused`` as transformers 5 holds them), the norms the config
  has; the final norm and an untied head."""
  family = family_for(cfg)
  yield HFTensor("model.embed_tokens.weight", (("embed", "embedding"),), False)
  norms = ([("ln1", "input_layernorm"), ("ln_attn_out", "post_attention_layernorm"),
            ("ln2", "pre_feedforward_layernorm"), ("ln_mlp_out", "post_feedforward_layernorm")]
           if cfg.sandwich_norm else
           [("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")])
  if not cfg.pre_norm:  # OLMo 2/3: only the norms after attention and the MLP
    norms = [(ours, hf) for ours, hf in norms if ours not in ("ln1", "ln2")]
  for i in range(cfg.num_layers):
    layer = f"model.layers.{i}"
    at = lambda *p, i=i: ("blocks", i, *p)
    moe = cfg.is_moe_layer(i)
    yield from family.attention(cfg, family, layer, at, experts_fused)
    if not moe:
      yield from dense_mlp_tensors(cfg, family, layer, at)
    if cfg.qk_norm:
      for ours in ("q_norm", "k_norm"):
        yield HFTensor(f"{layer}.self_attn.{ours}.weight", (at("attn", ours, "scale"),), False)
    if cfg.attn_sinks:
      yield HFTensor(f"{layer}.self_attn.sinks", (at("attn", "sinks"),), False)
    if moe:
      yield from family.experts(cfg, family, layer, at, experts_fused)
    for ours, hf in norms:
      yield HFTensor(f"{layer}.{hf}.weight", (at(ours, "scale"),), False)
  yield HFTensor("model.norm.weight", (("ln_f", "scale"),), False)
  if not cfg.tie_embeddings:
    yield HFTensor("lm_head.weight", (("head", "kernel"),), True)
