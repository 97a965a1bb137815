"""The transformer's configuration: a frozen dataclass of the skeleton's fields and one
record per part (attention, rope, FFN, experts), read and built by flat names too;
presets as classmethods."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.norms import OffsetRMSNorm

BYTE_VOCAB = 256

FULL, SLIDING = "full_attention", "sliding_attention"  # a layer's attention (HF's names)
NORMS = ("layernorm", "rmsnorm", "rmsnorm_offset")
QK_NORM_SPANS = ("head", "projection")
MLPS = ("gelu", "swiglu", "geglu")
# flax_tp.moe.DROP_POLICIES (not imported: this module does not import flax_tp)
DROP_POLICIES = ("probs", "position")
ROPE_KINDS = ("linear", "llama3", "yarn")
ROUTER_SCORES = ("softmax", "sigmoid")  # flax_tp.moe.SCORES


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How rotary frequencies are rescaled for a longer context (HF's ``rope_type``).

  linear: every inverse frequency divided by ``factor``. llama3: long wavelengths
  (beyond ``original_max_len / low_freq_factor``) divided by ``factor``, short ones
  (below ``original_max_len / high_freq_factor``) kept, the band between smoothed.
  yarn: interpolation and extrapolation blended by a ramp between the ``beta_fast`` /
  ``beta_slow`` correction dimensions, and cos/sin scaled by ``attention_factor``
  (resolved from ``factor`` and HF's mscale fields when the config reads it).
  """

  kind: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float = 1.0
  truncate: bool = True

  def __post_init__(self):
    if self.kind not in ROPE_KINDS:
      raise ValueError(f"rope scaling kind must be one of {ROPE_KINDS}, got {self.kind!r}")
    if not self.factor > 0:
      raise ValueError(f"rope scaling factor must be > 0, got {self.factor!r}")
    if self.kind in ("llama3", "yarn") and not (self.original_max_len or 0) >= 1:
      raise ValueError(f"{self.kind} rope scaling needs original_max_len >= 1, got "
                       f"{self.original_max_len!r}")
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                       f"{self.high_freq_factor!r} and {self.low_freq_factor!r}")


# -- The parts of a model, each a record of its own. A TransformerConfig holds one of
# each (``attention``, ``rope``, ``ffn``; ``experts`` only with mixture-of-experts
# layers). Their checks that involve other parts live in TransformerConfig, which
# checks the whole; a record alone holds values, nothing more.


@dataclasses.dataclass(frozen=True)
class LatentAttention:
  """DeepSeek-V3's multi-head latent attention (``models.transformer.LatentAttention``).

  The attention's ``head_dim`` is then a q/k head's width (qk_nope + ``qk_rope_head_dim``)
  and it has no ``num_kv_heads``: every head has its own k and v, expanded from a latent.
  """

  kv_lora_rank: int | None = None  # the kv latent's width (kv_a_proj_with_mqa's, normed)
  q_lora_rank: int | None = None  # q's own latent (q_a_proj -> norm -> q_b_proj); None:
  # one q projection
  qk_rope_head_dim: int | None = None  # the rotary part of a q/k head (its last dims; k's
  # is one head shared by all heads); the rest (qk_nope_head_dim) has no positions
  v_head_dim: int | None = None  # a value head's width; None: head_dim
  rope_interleave: bool = False  # how a checkpoint stores the rotary rows of q and k:
  # interleaved pairs (DeepSeek's; permuted on load and back on save) or half-split. The
  # computation is the same: flax_tp's params hold them half-split.


@dataclasses.dataclass(frozen=True)
class Attention:
  """What a block's attention is: its heads, biases, norms, windows and scores."""

  num_heads: int = 4
  head_dim: int = 32
  num_kv_heads: int | None = None  # None: num_heads (multi-head attention)
  qkv_bias: bool = True
  out_bias: bool = True  # the output projection's
  qk_norm: bool = False  # a norm of q and k before rotary (Qwen3, Gemma 3), of the kind
  # the config's ``norm`` names
  qk_norm_span: str = "head"  # what a qk_norm spans: "head" (each head over head_dim) or
  # "projection" (all of q's heads, all of k's: OLMo 2/3; an RMSNorm split over "model",
  # flax_tp.SplitRMSNorm)
  layer_types: tuple[str, ...] | None = None  # per layer FULL or SLIDING; None: all FULL
  sliding_window: int | None = None  # a SLIDING layer's query sees its last this many keys
  scale: float | None = None  # the scores' scale; None: head_dim ** -0.5
  softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
  sinks: bool = False  # a learned logit per head in each row's softmax denominator,
  # taking no value (GPT-OSS's attention sinks; models.attention.AttentionSpec.sinks)
  latent: LatentAttention | None = None  # DeepSeek-V3's MLA; None: q, k, v projections


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary positions: their base, a rescaling for long contexts, how much of a head
  rotates, and sliding layers' own base."""

  base: float = 10_000.0  # HF's rope_theta
  scaling: RopeScaling | None = None  # on full-attention layers (all layers without
  # local_base)
  fraction: float = 1.0  # HF's partial_rotary_factor: rotary on the first
  # int(head_dim * fraction) dims of a head, the rest passes through
  local_base: float | None = None  # sliding layers' own plain-rotary base (Gemma 3)


@dataclasses.dataclass(frozen=True)
class FFN:
  """A dense block's MLP (and the width an expert takes when it names none)."""

  kind: str = "gelu"  # or "swiglu": down(silu(gate(x)) * up(x)), or "geglu"
  d_ff: int = 512
  bias: bool = True


@dataclasses.dataclass(frozen=True)
class Router:
  """How a token picks its experts and weighs them (``flax_tp.moe.Router``)."""

  score: str = "softmax"  # or "sigmoid": each expert's score on its own
  normalize_top_k: bool = True  # top-k weights renormalised to sum to 1 (HF norm_topk_prob)
  selection_bias: bool = False  # a float32 bias added to the scores to pick experts only
  # (HF's e_score_correction_bias; flax_tp.SelectionBias, not trained by the optimizer)
  groups: int = 1  # HF's n_group: experts in equal groups, ranked by their best two
  groups_per_token: int = 1  # HF's topk_group: the groups a token picks from
  routed_scale: float = 1.0  # HF's routed_scaling_factor: the routed output's weights x this
  bias: bool = False  # a trained bias on the router's logits (GPT-OSS: it weighs and picks)


@dataclasses.dataclass(frozen=True)
class Experts:
  """Mixture-of-experts layers (``flax_tp.MoE``; Mixtral, Qwen-MoE, DeepSeek-V3, GLM-4.5,
  GPT-OSS): routed SwiGLU experts, a router, an optional shared expert."""

  num_experts: int | None = None  # routed experts in each MoE layer (required)
  per_token: int = 2  # top-k
  d_ff: int | None = None  # each expert's FFN width; None: the dense FFN's d_ff
  shared_d_ff: int | None = None  # a shared expert's width; None: no shared expert
  shared_gated: bool = True  # the shared expert's sigmoid gate (Qwen2-MoE); False: added
  # as is (DeepSeek-V3, GLM-4.5's n_shared_experts x moe_intermediate_size)
  layers: tuple[int, ...] | None = None  # the layers that are MoE (the rest dense, of the
  # FFN's width); None: all of them
  aux_loss_coef: float = 0.0  # the load-balancing loss's weight in training
  capacity_factor: float | None = None  # None: dropless; else each expert takes
  # ceil(factor * tokens * top_k / num_experts) of a step's choices (flax_tp.MoE)
  drop_policy: str = "probs"  # which choices a full expert keeps: "probs" (the largest
  # routing weights) or "position" (the earliest tokens)
  bias: bool = False  # biases on each expert's gate, up and down matmuls (GPT-OSS)
  swiglu_limit: float | None = None  # None: silu(gate) * up; else GPT-OSS's clamped form
  # (flax_tp.moe.SwiGLU): gate <= limit, |up| <= limit, (up + 1) * gate *
  # sigmoid(swiglu_alpha * gate)
  swiglu_alpha: float = 1.702
  router: Router = Router()


# Every field under its flat name (the name a checkpoint's identity, an HF config reader,
# a preset and TransformerConfig(...) use) -> where it lives: () a TransformerConfig
# field of the same name; else the path of record fields. In the order identity() writes.
FLAT_FIELDS: dict[str, tuple[str, ...]] = {
    "vocab_size": (), "d_model": (), "num_heads": ("attention", "num_heads"),
    "head_dim": ("attention", "head_dim"), "d_ff": ("ffn", "d_ff"), "num_layers": (),
    "max_seq_len": (), "tie_embeddings": (), "dropout": (), "dtype": (),
    "rope_base": ("rope", "base"), "norm_eps": (), "norm": (), "mlp": ("ffn", "kind"),
    "num_kv_heads": ("attention", "num_kv_heads"), "qkv_bias": ("attention", "qkv_bias"),
    "attn_out_bias": ("attention", "out_bias"), "mlp_bias": ("ffn", "bias"),
    "rope_scaling": ("rope", "scaling"), "rotary_fraction": ("rope", "fraction"),
    "rope_local_base": ("rope", "local_base"), "qk_norm": ("attention", "qk_norm"),
    "qk_norm_span": ("attention", "qk_norm_span"),
    "layer_types": ("attention", "layer_types"),
    "sliding_window": ("attention", "sliding_window"), "embed_scale": (),
    "attn_scale": ("attention", "scale"), "attn_softcap": ("attention", "softcap"),
    "final_softcap": (), "sandwich_norm": (), "pre_norm": (), "family": (),
    "num_experts": ("experts", "num_experts"), "experts_per_token": ("experts", "per_token"),
    "expert_d_ff": ("experts", "d_ff"), "shared_expert_d_ff": ("experts", "shared_d_ff"),
    "normalize_top_k": ("experts", "router", "normalize_top_k"),
    "moe_layers": ("experts", "layers"), "router_aux_loss_coef": ("experts", "aux_loss_coef"),
    "expert_capacity_factor": ("experts", "capacity_factor"),
    "expert_drop_policy": ("experts", "drop_policy"),
    "router_score": ("experts", "router", "score"),
    "router_selection_bias": ("experts", "router", "selection_bias"),
    "expert_groups": ("experts", "router", "groups"),
    "expert_groups_per_token": ("experts", "router", "groups_per_token"),
    "routed_scale": ("experts", "router", "routed_scale"),
    "shared_expert_gated": ("experts", "shared_gated"),
    "kv_lora_rank": ("attention", "latent", "kv_lora_rank"),
    "q_lora_rank": ("attention", "latent", "q_lora_rank"),
    "qk_rope_head_dim": ("attention", "latent", "qk_rope_head_dim"),
    "v_head_dim": ("attention", "latent", "v_head_dim"),
    "rope_interleave": ("attention", "latent", "rope_interleave"),
    "attn_sinks": ("attention", "sinks"), "router_bias": ("experts", "router", "bias"),
    "expert_bias": ("experts", "bias"), "swiglu_limit": ("experts", "swiglu_limit"),
    "swiglu_alpha": ("experts", "swiglu_alpha"), "padding_idx": (),
}
# The fields every identity writes: the first TransformerConfig's, before the families.
# Every field added since is left out of an identity at its default, so a run written
# before it existed keeps its identity: adding a field is one FLAT_FIELDS entry.
FIRST_FIELDS = frozenset((
    "vocab_size", "d_model", "num_heads", "head_dim", "d_ff", "num_layers", "max_seq_len",
    "tie_embeddings", "dropout", "dtype", "rope_base", "norm_eps", "norm", "mlp",
    "num_kv_heads", "qkv_bias", "attn_out_bias", "mlp_bias"))
# The record class each step of a path names; the optional records (None when absent)
# and the flat field whose value turns each on (or, set to None, off).
_RECORDS = {"attention": Attention, "latent": LatentAttention, "rope": Rope, "ffn": FFN,
            "experts": Experts, "router": Router}
_TURNED_ON_BY = {"latent": "kv_lora_rank", "experts": "num_experts"}
_TURNS_ON = frozenset(_TURNED_ON_BY.values())
_OPTIONAL_WHAT = {"latent": "multi-head latent attention", "experts": "mixture-of-experts layers"}


def _default_of(path: tuple[str, ...]):
  """The default of the field at ``path``: a TransformerConfig field's, or its record's."""
  owner = TransformerConfig if len(path) == 1 else _RECORDS[path[-2]]
  return next(f.default for f in dataclasses.fields(owner) if f.name == path[-1])


def _with_field(record, kind: str, rest: tuple[str, ...], value, flat_name: str):
  """``record`` (of ``_RECORDS[kind]``, or None where optional) with the field at ``rest``
  below it set to ``value``, the flat field ``flat_name``'s."""
  turn_on = _TURNED_ON_BY.get(kind)
  if rest == (turn_on,) and value is None:
    return None
  if record is None:
    if rest == (turn_on,):
      record = _RECORDS[kind]()
    elif value == _default_of((kind,) + rest):
      return None
    else:
      raise ValueError(f"{flat_name} is a field of {_OPTIONAL_WHAT[kind]}, which {turn_on} "
                       "(None here) turns on")
  field, below = rest[0], rest[1:]
  if below:
    value = _with_field(getattr(record, field), field, below, value, flat_name)
  return dataclasses.replace(record, **{field: value})


@dataclasses.dataclass(frozen=True, init=False)
class TransformerConfig:
  """A decoder-only transformer with rotary positions: its skeleton's fields and one
  record per part (``attention``, ``rope``, ``ffn``; ``experts`` with mixture-of-experts
  layers, else None).

  One family, many styles: GPT-like (``norm="layernorm"``, a GELU ``ffn``, biases
  everywhere, today's default), Llama/Qwen2-like (``norm="rmsnorm"``, SwiGLU, fewer
  kv heads than heads, biases off or on q/k/v only), and the families of
  ``models/families/`` (windows, soft-caps, latent attention, experts...).

  Built from records or from flat fields, the names a checkpoint's ``identity()``, an
  HF config reader and a preset use (``FLAT_FIELDS``: ``num_heads`` is
  ``attention.num_heads``, ``router_score`` is ``experts.router.score``)::

    TransformerConfig(d_model=24, attention=Attention(num_heads=6, head_dim=4))
    TransformerConfig(d_model=24, num_heads=6, head_dim=4)  # the same config
    dataclasses.replace(cfg, num_kv_heads=2)  # flat fields change their record

  and read either way (``cfg.num_heads`` is ``cfg.attention.num_heads``; a field of an
  absent record reads as its default: ``cfg.num_experts`` is None on a dense model).
  A flat field of an absent optional record other than the one that turns it on
  (``kv_lora_rank``, ``num_experts``) is refused naming it, unless at its default.

  Shapes in the code use: b batch, s sequence, d ``d_model``, h heads,
  k ``head_dim``, f ``d_ff``, v ``vocab_size``. Neither ``num_heads``, ``d_ff``
  nor ``vocab_size`` need divide the model axis: flax_tp pads the shards.
  How a step runs (sequence parallelism, remat, scanned layers, FSDP) is not here:
  see ``models.execution.Execution``.
  """

  vocab_size: int = BYTE_VOCAB
  d_model: int = 128
  num_layers: int = 4
  max_seq_len: int = 128
  tie_embeddings: bool = True  # LM head = embedding.attend; else its own weight
  dropout: float = 0.0  # embedding, attention probabilities, both residual branches
  dtype: str = "float32"  # compute dtype; params stay float32
  norm_eps: float = 1e-5
  norm: str = "layernorm"  # "rmsnorm" or "rmsnorm_offset" (Gemma's 1 + w)
  # -- what the families beyond Llama/Qwen2 need (models/families/). At their
  # defaults they leave identity() as it was before they existed.
  embed_scale: bool = False  # embeddings times sqrt(d_model), in the compute dtype (Gemma)
  final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2, 3)
  sandwich_norm: bool = False  # a norm after attention and after the MLP too, before
  # each residual add (Gemma 2, 3: four norms per block)
  pre_norm: bool = True  # the norms before attention and before the MLP; False with
  # sandwich_norm: only the norms after them (OLMo 2/3)
  family: str | None = None  # the HF family it reads from / writes as (models/families/);
  # None: Llama, or Qwen2 where only q/k/v have biases
  padding_idx: int | None = None  # the token whose embedding lookups pass no gradient
  # (transformers builds nn.Embedding(..., padding_idx=config.pad_token_id))
  # -- the parts
  attention: Attention = Attention()
  rope: Rope = Rope()
  ffn: FFN = FFN()
  experts: Experts | None = None  # None: every MLP dense

  def __init__(self, **fields):
    values = {f.name: fields.pop(f.name, f.default) for f in dataclasses.fields(self)}
    # a field that turns an optional record on goes first: the others land in it
    for name in sorted(fields, key=lambda n: n not in _TURNS_ON):
      path = FLAT_FIELDS.get(name)
      if not path:
        raise TypeError(f"TransformerConfig got an unexpected keyword argument {name!r}")
      values[path[0]] = _with_field(values[path[0]], path[0], path[1:], fields[name], name)
    for name, value in values.items():
      object.__setattr__(self, name, value)
    self.__post_init__()

  def __getattr__(self, name: str):
    """A flat field's value, read from its record (called only for names that are not
    attributes: ``cfg.num_heads``, never ``cfg.attention``)."""
    path = FLAT_FIELDS.get(name)
    if not path:
      raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    value = self
    for step in path:
      if value is None:  # an absent optional record: its fields read as their defaults
        return _default_of(path)
      value = getattr(value, step)
    return value

  def __post_init__(self):
    for where, value, kind, optional in (
        ("attention", self.attention, Attention, False), ("rope", self.rope, Rope, False),
        ("ffn", self.ffn, FFN, False), ("experts", self.experts, Experts, True),
        ("attention.latent", getattr(self.attention, "latent", None), LatentAttention, True),
        ("experts.router", getattr(self.experts, "router", None), Router, self.experts is None)):
      if not isinstance(value, kind) and not (optional and value is None):
        raise ValueError(f"{where} must be a models.config.{kind.__name__}"
                         f"{' or None' if optional else ''}, got {value!r}")
    for name in ("vocab_size", "d_model", "num_heads", "head_dim", "d_ff", "num_layers",
                 "max_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.head_dim % 2 and self.qk_rope_head_dim is None:  # (MLA: its rope part, below)
      raise ValueError(f"head_dim must be even for rotary positions, got {self.head_dim}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
    if self.norm not in NORMS:
      raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
    if self.mlp not in MLPS:
      raise ValueError(f"mlp must be one of {MLPS}, got {self.mlp!r}")
    if self.qk_rope_head_dim is None and (  # (latent attention: its own check, below)
        not 0 < self.rotary_fraction <= 1 or self.rotary_dim % 2 or self.rotary_dim < 2):
      raise ValueError(f"rotary_fraction must be in (0, 1] and give an even rotary width of "
                       f"at least 2 of head_dim {self.head_dim}, got {self.rotary_fraction!r}")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
    if self.layer_types is not None:
      if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
        raise ValueError(f"layer_types must be a tuple of num_layers={self.num_layers} "
                         f"entries, got {self.layer_types!r}")
      wrong = sorted(set(self.layer_types) - {FULL, SLIDING})
      if wrong:
        raise ValueError(f"layer_types holds {wrong[0]!r}; expected {FULL!r} or {SLIDING!r}")
    if self.padding_idx is not None and not (
        isinstance(self.padding_idx, int) and not isinstance(self.padding_idx, bool)
        and 0 <= self.padding_idx < self.vocab_size):
      raise ValueError(f"padding_idx must be None or a token id in [0, vocab_size="
                       f"{self.vocab_size}), got {self.padding_idx!r}")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window!r}")
    if SLIDING in (self.layer_types or ()) and self.sliding_window is None:
      raise ValueError("layer_types has sliding layers but sliding_window is None")
    for name in ("attn_scale", "attn_softcap", "final_softcap", "rope_local_base"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0 or None, got {value!r}")
    kv = self.kv_heads
    if kv < 1 or self.num_heads % kv:
      raise ValueError(f"num_kv_heads must divide num_heads={self.num_heads}, got "
                       f"{self.num_kv_heads}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
    if self.qk_norm_span not in QK_NORM_SPANS:
      raise ValueError(f"qk_norm_span must be one of {QK_NORM_SPANS}, got "
                       f"{self.qk_norm_span!r}")
    if self.qk_norm_span == "projection" and self.norm != "rmsnorm":
      raise ValueError(f"qk_norm_span 'projection' is an RMSNorm (OLMo 2/3): norm must be "
                       f"'rmsnorm', got {self.norm!r}")
    if not self.pre_norm and not self.sandwich_norm:
      raise ValueError("pre_norm=False needs sandwich_norm=True: a block without either "
                       "has no norm at all")
    self._check_experts()
    self._check_latent_attention()
    if self.attn_sinks and self.latent_attention:
      raise ValueError("attn_sinks is not built for latent attention (no family has both)")
    expert_only = [n for n, on in (("router_bias", self.router_bias),
                                   ("expert_bias", self.expert_bias),
                                   ("swiglu_limit", self.swiglu_limit is not None)) if on]
    if expert_only and self.num_experts is None:
      raise ValueError(f"{expert_only[0]} is a field of mixture-of-experts layers, which "
                       "num_experts (None here) turns on")
    for name in ("swiglu_limit", "swiglu_alpha"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not 0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

  def _check_latent_attention(self) -> None:
    mla = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")
    for name in mla:
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 1):
        raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
    if self.kv_lora_rank is None:
      given = [n for n in mla[1:] if getattr(self, n) is not None]
      given += ["rope_interleave"] if self.rope_interleave else []
      if given:
        raise ValueError(f"{given[0]} is a field of multi-head latent attention, which "
                         "kv_lora_rank (None here) turns on")
      return
    rope = self.qk_rope_head_dim
    if rope is None or rope % 2 or rope >= self.head_dim:
      raise ValueError(f"latent attention needs qk_rope_head_dim even and below head_dim "
                       f"{self.head_dim} (qk_nope + qk_rope), got {rope!r}")
    if self.num_kv_heads not in (None, self.num_heads):
      raise ValueError(f"latent attention expands a k and v head per query head: "
                       f"num_kv_heads must be None, got {self.num_kv_heads!r}")
    wrong = [n for n, bad in (("qk_norm", self.qk_norm), ("rotary_fraction",
                                                         self.rotary_fraction != 1.0))
             if bad]
    if wrong:
      raise ValueError(f"{wrong[0]} is not part of latent attention (its latents have their "
                       "own norms; qk_rope_head_dim says what rotates)")

  def _check_experts(self) -> None:
    if self.experts is None:
      return
    if self.num_experts is None:
      raise ValueError("experts=Experts(...) needs num_experts (None here); for dense MLPs "
                       "pass experts=None")
    if self.num_experts < 1:
      raise ValueError(f"num_experts must be >= 1 or None, got {self.num_experts!r}")
    if not 1 <= self.experts_per_token <= self.num_experts:
      raise ValueError(f"experts_per_token must be in [1, num_experts={self.num_experts}], "
                       f"got {self.experts_per_token!r}")
    if self.mlp != "swiglu":
      raise ValueError(f"mixture-of-experts layers are SwiGLU experts: mlp must be 'swiglu', "
                       f"got {self.mlp!r}")
    for name in ("expert_d_ff", "shared_expert_d_ff"):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1 or None, got {value!r}")
    if self.moe_layers is not None:
      if not isinstance(self.moe_layers, tuple) or any(
          not 0 <= i < self.num_layers for i in self.moe_layers):
        raise ValueError(f"moe_layers must be a tuple of layer numbers in [0, "
                         f"{self.num_layers}), got {self.moe_layers!r}")
    if self.router_aux_loss_coef < 0:
      raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef!r}")
    factor = self.expert_capacity_factor
    if factor is not None and not (
        isinstance(factor, (int, float, np.integer, np.floating))
        and not isinstance(factor, (bool, np.bool_)) and 0 < factor < math.inf):
      raise ValueError(f"expert_capacity_factor must be a number > 0 or None (dropless), got "
                       f"{factor!r}")
    if self.expert_drop_policy not in DROP_POLICIES:
      raise ValueError(f"expert_drop_policy must be one of {DROP_POLICIES}, got "
                       f"{self.expert_drop_policy!r}")
    if self.router_score not in ROUTER_SCORES:
      raise ValueError(f"router_score must be one of {ROUTER_SCORES}, got "
                       f"{self.router_score!r}")
    groups, picked = self.expert_groups, self.expert_groups_per_token
    if not 1 <= picked <= groups or self.num_experts % groups:
      raise ValueError(f"expert_groups {groups} must divide num_experts {self.num_experts}, "
                       f"and expert_groups_per_token {picked} be in [1, {groups}]")
    per_group = self.num_experts // groups
    if groups > 1 and per_group < 2:
      raise ValueError(f"expert groups are ranked by their two best experts: expert_groups "
                       f"{groups} leaves {per_group} of num_experts {self.num_experts} in each")
    if self.experts_per_token > picked * per_group:
      raise ValueError(f"experts_per_token {self.experts_per_token} is more than the "
                       f"{picked} x {per_group} experts of the groups a token picks from")
    if not (isinstance(self.routed_scale, (int, float)) and 0 < self.routed_scale < math.inf):
      raise ValueError(f"routed_scale must be a finite number > 0, got {self.routed_scale!r}")

  def identity(self) -> dict:
    """The fields that define the model (what a checkpoint must match) under their flat
    names (``FLAT_FIELDS``), as JSON holds them. A field added since the first ones
    (``FIRST_FIELDS``) is left out at its default, so a run written before it existed
    keeps its identity."""
    out = {}
    for name in FLAT_FIELDS:
      value = getattr(self, name)
      if name not in FIRST_FIELDS and value == _default_of(FLAT_FIELDS[name] or (name,)):
        continue
      if isinstance(value, RopeScaling):
        value = dataclasses.asdict(value)
      elif isinstance(value, tuple):
        value = list(value)
      out[name] = value
    return out

  def flat(self) -> dict:
    """Every field under its flat name, values as held (nothing left out, unlike
    ``identity()``)."""
    return {name: getattr(self, name) for name in FLAT_FIELDS}

  @classmethod
  def from_identity(cls, fields: dict) -> TransformerConfig:
    """The config of an ``identity()`` read back from JSON (lists, nested dicts); a
    field this version does not know raises ``TypeError`` naming it."""
    fields = dict(fields)
    if isinstance(fields.get("rope_scaling"), dict):
      fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    for name in ("layer_types", "moe_layers"):
      if isinstance(fields.get(name), list):
        fields[name] = tuple(fields[name])
    return cls(**fields)

  @property
  def rotary_dim(self) -> int:
    """How many dims of a head rotary rotates (HF: ``int(head_dim * partial_rotary_factor)``;
    latent attention: ``qk_rope_head_dim``)."""
    if self.qk_rope_head_dim is not None:
      return self.qk_rope_head_dim
    return int(self.head_dim * self.rotary_fraction)

  @property
  def latent_attention(self) -> bool:
    """Whether attention is DeepSeek-V3's multi-head latent attention (``kv_lora_rank``)."""
    return self.kv_lora_rank is not None

  @property
  def value_dim(self) -> int:
    """A value head's width (latent attention's ``v_head_dim``; else ``head_dim``)."""
    return self.head_dim if self.v_head_dim is None else self.v_head_dim

  @property
  def attn_dim(self) -> int:
    """The width of the q, k and v heads attention runs on (and a KV cache holds): the
    wider of a q/k and a value head; the narrower ones are padded with zeros, which add
    nothing to a score and give zero output columns."""
    return max(self.head_dim, self.value_dim)

  def is_moe_layer(self, layer: int) -> bool:
    """Whether block ``layer``'s MLP is a mixture of experts."""
    return self.num_experts is not None and (self.moe_layers is None
                                             or layer in self.moe_layers)

  @property
  def has_experts(self) -> bool:
    return any(self.is_moe_layer(i) for i in range(self.num_layers))

  @property
  def expert_width(self) -> int:
    return self.d_ff if self.expert_d_ff is None else self.expert_d_ff

  def layer_type(self, layer: int) -> str:
    return FULL if self.layer_types is None else self.layer_types[layer]

  @property
  def has_sliding_layers(self) -> bool:
    return SLIDING in (self.layer_types or ())

  @property
  def plain_attention(self) -> bool:
    """Whether attention is the causal softmax at ``head_dim ** -0.5`` and nothing else."""
    return (not self.has_sliding_layers and self.attn_scale is None
            and self.attn_softcap is None and self.attn_dim == self.head_dim)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  def norm_layer(self, rngs: nnx.Rngs, width: int | None = None) -> nnx.Module:
    """A norm of the kind ``norm`` names over ``width`` (default d_model): a block's
    norms, the final norm, and (``qk_norm``) q/k's over head_dim."""
    width = self.d_model if width is None else width
    if self.norm == "rmsnorm_offset":
      return OffsetRMSNorm(width, epsilon=self.norm_eps, dtype=self.compute_dtype)
    cls = nnx.RMSNorm if self.norm == "rmsnorm" else nnx.LayerNorm
    return cls(width, epsilon=self.norm_eps, dtype=self.compute_dtype, rngs=rngs)

  @classmethod
  def tiny(cls, **overrides) -> TransformerConfig:
    """For tests: 6 heads, d_ff 90 and vocab 259 divide neither 4 nor 8."""
    return cls.preset("tiny", **overrides)

  @classmethod
  def small(cls, **overrides) -> TransformerConfig:
    """The default: learns Python's look in a few CPU minutes."""
    return cls.preset("small", **overrides)

  @classmethod
  def preset(cls, name: str, **overrides) -> TransformerConfig:
    check_architecture_fields(overrides)
    if name not in PRESETS:
      raise ValueError(f"unknown preset {name!r}; expected one of {tuple(PRESETS)}")
    # the preset, then the overrides over it: a record given whole replaces the preset's
    return dataclasses.replace(cls(**PRESETS[name]), **overrides)

  @classmethod
  def preset_names(cls) -> tuple[str, ...]:
    return tuple(PRESETS)




# The presets too large to build with random weights on one host (their params alone
# are terabytes): the benchmarks compile them from abstract shapes; a run starts from a
# checkpoint (train/run.py --init-from). Each with what it is.
ABSTRACT_ONLY = {"deepseek-v3": "DeepSeek-V3's 671B params (7.3 TiB with AdamW in float32)"}


def check_architecture_fields(overrides: dict) -> None:
  """Refuses, naming it, an execution option given where architecture fields go (they
  were ``TransformerConfig`` fields before the execution record)."""
  from models.execution import Execution  # (it imports flax_tp; this module need not)
  # (``attention`` is both: the config's record of what attention is, and the execution's
  # kernel choice; given here it is the record)
  wrong = sorted(set(overrides) & {f.name for f in dataclasses.fields(Execution)}
                 - {f.name for f in dataclasses.fields(TransformerConfig)})
  if wrong:
    raise ValueError(f"{wrong[0]} is how a step runs, not what the model is: pass "
                     f"execution=Execution({wrong[0]}=...) to Transformer or load_hf")


_LLAMA = dict(norm="rmsnorm", mlp="swiglu", qkv_bias=False, attn_out_bias=False,
              mlp_bias=False, norm_eps=1e-5, rope_base=10_000.0)
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=259, d_model=24, num_heads=6, head_dim=4, d_ff=90, num_layers=2,
                 max_seq_len=16),
    "small": {},
    # Llama-style. For tests: 6 query / 2 kv heads, d_ff 90, vocab 259 divide
    # neither 4 nor 8, so kv heads are replicated and every split is padded.
    "llama-tiny": dict(vocab_size=259, d_model=24, num_heads=6, num_kv_heads=2, head_dim=4,
                       d_ff=90, num_layers=2, max_seq_len=16, **_LLAMA),
    # Mixture of experts, Mixtral-style (top-2 of 6 SwiGLU experts in every layer,
    # load-balancing loss at Mixtral's 0.02). For tests and the CLI: 6 experts and
    # their FFN of 90 divide neither 4 nor 8, so experts and FFNs are padded.
    "moe-tiny": dict(vocab_size=259, d_model=24, num_heads=6, num_kv_heads=2, head_dim=4,
                     d_ff=90, num_layers=2, max_seq_len=16, num_experts=6,
                     experts_per_token=2, router_aux_loss_coef=0.02, family="mixtral",
                     **_LLAMA),
    # The 2026 families at test size, each its release's architecture over the byte
    # vocabulary, with sizes that divide neither 4 nor 8 (as llama-tiny's): a newcomer's
    # `--preset NAME-tiny --mesh 2x4` trains, generates and exports in seconds. The
    # shapes are tests/fixtures/hf's (made against transformers).
    # DeepSeek-V3: latent attention, yarn, the first layer dense then top-3 of 9 sigmoid
    # experts from the best 2 of 3 groups, a shared expert, loss-free balancing biases.
    "deepseek-v3-tiny": dict(vocab_size=259, d_model=24, num_heads=6, head_dim=10, d_ff=38,
                             num_layers=2, max_seq_len=16, tie_embeddings=False,
                             **{**_LLAMA, "norm_eps": 1e-6}, kv_lora_rank=10, q_lora_rank=7,
                             qk_rope_head_dim=4, v_head_dim=5, rope_interleave=True,
                             # (mscale 1, mscale_all_dim 0.8, as the fixture's config)
                             rope_scaling=RopeScaling(
                                 "yarn", 4.0, original_max_len=8,
                                 attention_factor=(0.1 * math.log(4.0) + 1)
                                 / (0.08 * math.log(4.0) + 1)),
                             attn_scale=10 ** -0.5 * (0.08 * math.log(4.0) + 1.0) ** 2,
                             family="deepseek_v3", num_experts=9, experts_per_token=3,
                             expert_d_ff=14, shared_expert_d_ff=28, shared_expert_gated=False,
                             moe_layers=(1,), router_score="sigmoid",
                             router_selection_bias=True, expert_groups=3,
                             expert_groups_per_token=2, routed_scale=2.5),
    # GLM-4.5: grouped-query attention with q/k norms and qkv biases, rotary on half of
    # each head, DeepSeek-V3's experts after a dense first layer.
    "glm4.5-tiny": dict(vocab_size=259, d_model=24, num_heads=6, num_kv_heads=2, head_dim=8,
                        d_ff=38, num_layers=2, max_seq_len=16, tie_embeddings=False,
                        **{**_LLAMA, "norm_eps": 1e-6, "qkv_bias": True}, rotary_fraction=0.5,
                        qk_norm=True, family="glm4_moe", num_experts=9, experts_per_token=3,
                        expert_d_ff=14, shared_expert_d_ff=28, shared_expert_gated=False,
                        moe_layers=(1,), router_score="sigmoid", router_selection_bias=True,
                        expert_groups=3, expert_groups_per_token=2, routed_scale=2.5),
    # GPT-OSS: sinks, biases, sliding and full layers alternating, yarn, top-2 of 6
    # biased, clamped experts by a biased router in every layer.
    "gpt-oss-tiny": dict(vocab_size=259, d_model=24, num_heads=6, num_kv_heads=2, head_dim=4,
                         d_ff=38, num_layers=2, max_seq_len=16, tie_embeddings=False,
                         **{**_LLAMA, "norm_eps": 1e-6, "qkv_bias": True,
                            "attn_out_bias": True}, attn_sinks=True,
                         rope_scaling=RopeScaling("yarn", 4.0, original_max_len=8,
                                                  truncate=False,
                                                  attention_factor=0.1 * math.log(4.0) + 1),
                         layer_types=(SLIDING, FULL), sliding_window=4, family="gpt_oss",
                         num_experts=6, experts_per_token=2, router_aux_loss_coef=0.1,
                         router_bias=True, expert_bias=True, swiglu_limit=0.8),
    # OLMo 2: q/k norms over the whole projection, norms after attention and the MLP only.
    "olmo2-tiny": dict(vocab_size=259, d_model=24, num_heads=6, num_kv_heads=2, head_dim=4,
                       d_ff=38, num_layers=2, max_seq_len=16, tie_embeddings=False,
                       **{**_LLAMA, "rope_base": 500_000.0, "norm_eps": 1e-6,
                          "qkv_bias": True, "attn_out_bias": True}, qk_norm=True,
                       qk_norm_span="projection", sandwich_norm=True, pre_norm=False,
                       family="olmo2"),
    # OLMo 3: OLMo 2's norms, sliding (base 10000) and full (yarn, base 500000) layers.
    "olmo3-tiny": dict(vocab_size=259, d_model=24, num_heads=6, num_kv_heads=2, head_dim=4,
                       d_ff=38, num_layers=2, max_seq_len=16, tie_embeddings=False,
                       **{**_LLAMA, "rope_base": 500_000.0, "norm_eps": 1e-6},
                       rope_scaling=RopeScaling("yarn", 4.0, original_max_len=8,
                                                attention_factor=0.1 * math.log(4.0) + 1),
                       rope_local_base=10_000.0, qk_norm=True, qk_norm_span="projection",
                       layer_types=(SLIDING, FULL), sliding_window=4, sandwich_norm=True,
                       pre_norm=False, family="olmo3"),
    # Benchmark sizes (untied head, 32000-token vocabulary): ~125M and ~336M params.
    "llama-125m": dict(vocab_size=32000, d_model=768, num_heads=12, num_kv_heads=4,
                       head_dim=64, d_ff=2048, num_layers=12, max_seq_len=1024,
                       tie_embeddings=False, **_LLAMA),
    "llama-350m": dict(vocab_size=32000, d_model=1024, num_heads=16, num_kv_heads=4,
                       head_dim=64, d_ff=2816, num_layers=24, max_seq_len=1024,
                       tie_embeddings=False, **_LLAMA),
    # The shapes of released checkpoints (no weights: benchmarks and memory figures
    # compile them from abstract shapes; load_hf reads the checkpoints themselves).
    # meta-llama/Llama-3.2-1B: llama3 rope (factor 32 over 8192 positions), tied head.
    "llama3.2-1b": dict(vocab_size=128256, d_model=2048, num_heads=32, num_kv_heads=8,
                        head_dim=64, d_ff=8192, num_layers=16, max_seq_len=2048,
                        tie_embeddings=True, **{**_LLAMA, "rope_base": 500_000.0},
                        rope_scaling=RopeScaling("llama3", 32.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0,
                                                 original_max_len=8192)),
    # Qwen/Qwen3-0.6B: q/k norms, head_dim 128 (not 1024 / 16), tied head.
    "qwen3-0.6b": dict(vocab_size=151936, d_model=1024, num_heads=16, num_kv_heads=8,
                       head_dim=128, d_ff=3072, num_layers=28, max_seq_len=2048,
                       tie_embeddings=True, qk_norm=True, family="qwen3",
                       **{**_LLAMA, "rope_base": 1_000_000.0, "norm_eps": 1e-6}),
    # google/gemma-3-1b-pt: 4 query heads of 256 over 1 kv head, 5 sliding layers (window
    # 512, base 10000) per full one (base 1e6), four (1 + w) norms per block.
    "gemma3-1b": dict(vocab_size=262144, d_model=1152, num_heads=4, num_kv_heads=1,
                      head_dim=256, d_ff=6912, num_layers=26, max_seq_len=2048,
                      tie_embeddings=True, norm="rmsnorm_offset", mlp="geglu",
                      qkv_bias=False, attn_out_bias=False, mlp_bias=False, norm_eps=1e-6,
                      rope_base=1_000_000.0, rope_local_base=10_000.0, qk_norm=True,
                      embed_scale=True, attn_scale=256 ** -0.5, sandwich_norm=True,
                      sliding_window=512, family="gemma3_text", padding_idx=0,
                      layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(26))),
    # deepseek-ai/DeepSeek-V3 (671B): latent attention (128 heads of 128 + 64, values 128,
    # latents 1536 / 512), yarn over 4096 positions (factor 40, mscale_all_dim 1 on the
    # scores), top-8 of 256 experts by sigmoid scores from the best 4 of 8 groups, one
    # shared expert, the first 3 layers dense; FP8 on disk (load_hf dequantizes it).
    "deepseek-v3": dict(vocab_size=129280, d_model=7168, num_heads=128, head_dim=192,
                        d_ff=18432, num_layers=61, max_seq_len=2048, tie_embeddings=False,
                        **{**_LLAMA, "norm_eps": 1e-6}, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
                        rope_scaling=RopeScaling("yarn", 40.0, original_max_len=4096),
                        attn_scale=192 ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2,
                        family="deepseek_v3", num_experts=256, experts_per_token=8,
                        expert_d_ff=2048, shared_expert_d_ff=2048, shared_expert_gated=False,
                        moe_layers=tuple(range(3, 61)), router_score="sigmoid",
                        router_selection_bias=True, expert_groups=8,
                        expert_groups_per_token=4, routed_scale=2.5),
    # openai/gpt-oss-20b (21B): 64 query heads of 64 over 8 kv heads with sinks and biases,
    # sliding (window 128) and full layers alternating, yarn (factor 32 over 4096 positions,
    # base 150000); top-4 of 32 biased, clamped experts of 2880 by a biased router, every
    # layer; MXFP4 experts on disk (load_hf dequantizes them). output_router_logits false:
    # no load-balancing loss, as transformers trains it by default.
    "gpt-oss-20b": dict(vocab_size=201088, d_model=2880, num_heads=64, num_kv_heads=8,
                        head_dim=64, d_ff=2880, num_layers=24, max_seq_len=2048,
                        tie_embeddings=False,
                        **{**_LLAMA, "rope_base": 150_000.0, "qkv_bias": True,
                           "attn_out_bias": True}, attn_sinks=True,
                        rope_scaling=RopeScaling("yarn", 32.0, original_max_len=4096,
                                                 truncate=False,  # (0.1 ln 32 + 1)
                                                 attention_factor=0.1 * math.log(32.0) + 1),
                        layer_types=tuple(SLIDING if (i + 1) % 2 else FULL for i in range(24)),
                        sliding_window=128, family="gpt_oss", num_experts=32,
                        experts_per_token=4, router_bias=True, expert_bias=True,
                        swiglu_limit=7.0, padding_idx=199_999),
    # allenai/Olmo-3-1025-7B's shapes: 32 heads of 128 (no grouping), q/k norms over the
    # whole projection, norms after attention and the MLP only, 3 sliding layers (window
    # 4096) per full one. Rope as a plain base 500000 on every layer (the release's yarn
    # on its full layers changes neither memory nor communication, which this preset is
    # for; load_hf reads a checkpoint's own).
    "olmo3-7b": dict(vocab_size=100278, d_model=4096, num_heads=32, num_kv_heads=32,
                     head_dim=128, d_ff=11008,
                     num_layers=32, max_seq_len=2048, tie_embeddings=False,
                     **{**_LLAMA, "rope_base": 500_000.0, "norm_eps": 1e-6}, qk_norm=True,
                     qk_norm_span="projection", sandwich_norm=True, pre_norm=False,
                     rope_local_base=500_000.0,
                     layer_types=tuple(SLIDING if (i + 1) % 4 else FULL for i in range(32)),
                     sliding_window=4096, family="olmo3", padding_idx=1),
}
