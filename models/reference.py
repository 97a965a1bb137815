"""The transformer in plain Flax NNX: the reference flax_tp must reproduce exactly.

Same architecture, same param names and nesting, same order of key draws as
``models/transformer.py``, so one seed gives the same model in both. It imports
nothing from flax_tp.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention, layer_kinds, ops
from models.config import TransformerConfig


class Attention(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    width, kv_width = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    dense = dict(dtype=cfg.compute_dtype, rngs=rngs)
    self.q = nnx.Linear(cfg.d_model, width, use_bias=cfg.qkv_bias, **dense)
    self.k = nnx.Linear(cfg.d_model, kv_width, use_bias=cfg.qkv_bias, **dense)
    self.v = nnx.Linear(cfg.d_model, kv_width, use_bias=cfg.qkv_bias, **dense)
    self.o = nnx.Linear(width, cfg.d_model, use_bias=cfg.attn_out_bias, **dense)
    if cfg.attn_sinks:  # GPT-OSS: one logit per head in each row's denominator
      self.sinks = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.num_heads,)))
    if cfg.qk_norm:  # over each head, or (OLMo 2/3) over the whole projection
      whole = cfg.qk_norm_span == "projection"
      self.q_norm = cfg.norm_layer(rngs, width if whole else cfg.head_dim)
      self.k_norm = cfg.norm_layer(rngs, kv_width if whole else cfg.head_dim)
    self.cfg = cfg

  def __call__(self, x_bsd, key, layer):
    cfg = self.cfg
    b, s, _ = x_bsd.shape
    split = lambda t: t.reshape(b, s, -1, cfg.head_dim)
    q, k, v = self.q(x_bsd), self.k(x_bsd), self.v(x_bsd)
    if cfg.qk_norm and cfg.qk_norm_span == "projection":
      q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = split(q), split(k), split(v)
    if cfg.qk_norm and cfg.qk_norm_span == "head":
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = (layer_kinds.rotate(cfg, t, None, layer) for t in (q, k))
    # k, v keep their kv heads: query head i reads kv head i // (query heads per kv head)
    dropout_key = ops.site_key(key, layer, ops.ATTN_PROBS)
    dropout = None if dropout_key is None else attention.Dropout(
        dropout_key, jnp.arange(b), jnp.arange(cfg.num_heads))
    spec = attention.AttentionSpec.of(cfg, layer).with_sinks(
        self.sinks[...] if cfg.attn_sinks else None)
    out = attention.attend(q, k, v, spec, dropout=dropout)
    return self.o(out.reshape(b, s, -1))


class LatentAttention(nnx.Module):
  """DeepSeek-V3's multi-head latent attention as transformers' ``DeepseekV3Attention``
  writes it (half-split rotary on the last ``qk_rope_head_dim`` dims of each q/k head):
  q from its own latent (or one projection), each head's k_nope and v from the normed kv
  latent, one rotary key head shared by all heads, scores at ``head_dim ** -0.5`` unless
  ``attn_scale`` says otherwise."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    heads, qk, value, rope = cfg.num_heads, cfg.head_dim, cfg.value_dim, cfg.qk_rope_head_dim
    dense = dict(dtype=cfg.compute_dtype, rngs=rngs)
    norm = dict(epsilon=1e-6, dtype=cfg.compute_dtype, rngs=rngs)  # DeepseekV3RMSNorm's
    if cfg.q_lora_rank is None:
      self.q = nnx.Linear(cfg.d_model, heads * qk, use_bias=False, **dense)
    else:
      self.q_a = nnx.Linear(cfg.d_model, cfg.q_lora_rank, use_bias=cfg.qkv_bias, **dense)
      self.q_a_norm = nnx.RMSNorm(cfg.q_lora_rank, **norm)
      self.q_b = nnx.Linear(cfg.q_lora_rank, heads * qk, use_bias=False, **dense)
    self.kv_a = nnx.Linear(cfg.d_model, cfg.kv_lora_rank + rope, use_bias=cfg.qkv_bias, **dense)
    self.kv_a_norm = nnx.RMSNorm(cfg.kv_lora_rank, **norm)
    self.kv_b = nnx.Linear(cfg.kv_lora_rank, heads * (qk - rope + value), use_bias=False,
                           **dense)
    self.o = nnx.Linear(heads * value, cfg.d_model, use_bias=cfg.attn_out_bias, **dense)
    self.cfg = cfg

  def __call__(self, x_bsd, key, layer):
    cfg = self.cfg
    b, s, _ = x_bsd.shape
    nope, rope, value = cfg.head_dim - cfg.qk_rope_head_dim, cfg.qk_rope_head_dim, cfg.value_dim
    q = self.q(x_bsd) if cfg.q_lora_rank is None else self.q_b(self.q_a_norm(self.q_a(x_bsd)))
    q = q.reshape(b, s, cfg.num_heads, nope + rope)
    compressed = self.kv_a(x_bsd)
    latent, k_rope = compressed[..., :cfg.kv_lora_rank], compressed[..., cfg.kv_lora_rank:]
    kv = self.kv_b(self.kv_a_norm(latent)).reshape(b, s, cfg.num_heads, nope + value)
    rotate = lambda t: layer_kinds.rotate(cfg, t, None, layer)
    q = jnp.concatenate([q[..., :nope], rotate(q[..., nope:])], axis=-1)
    k_rope = jnp.broadcast_to(rotate(k_rope[:, :, None, :]), (b, s, cfg.num_heads, rope))
    k = jnp.concatenate([kv[..., :nope], k_rope], axis=-1)
    v = kv[..., nope:]
    # scores over q/k's head_dim; v's own width (the explicit form: no fused kernel needs
    # q, k and v of one width here)
    scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k, preferred_element_type=jnp.float32) * scale
    pos = jnp.arange(s)
    mask = attention.visible_keys(pos[:, None], pos[None, :],
                                  attention.AttentionSpec.of(cfg, layer).window)
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)
    dropout_key = ops.site_key(key, layer, ops.ATTN_PROBS)
    if dropout_key is not None:
      keep = ops.keep_mask(dropout_key, cfg.dropout, jnp.arange(b), (s, s),
                           jnp.arange(cfg.num_heads))
      probs = ops.apply_keep(probs, keep, cfg.dropout)
    out = jnp.einsum("bhqt,bthk->bqhk", probs.astype(v.dtype), v)
    return self.o(out.reshape(b, s, -1))


class MLP(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    dense = dict(use_bias=cfg.mlp_bias, dtype=cfg.compute_dtype, rngs=rngs)
    if cfg.mlp in ops.GATED:
      self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, **dense)
    self.up = nnx.Linear(cfg.d_model, cfg.d_ff, **dense)
    self.down = nnx.Linear(cfg.d_ff, cfg.d_model, **dense)
    self.kind = cfg.mlp

  def __call__(self, x_bsd):
    gate = self.gate(x_bsd) if self.kind in ops.GATED else None
    return self.down(ops.mlp_hidden(self.kind, gate, self.up(x_bsd)))


# Each expert's weight drawn with fan-in over its own input (the leading axis is the
# experts'), as flax_tp.moe draws them.
EXPERT_INIT = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))


class LoopMoE(nnx.Module):
  """A mixture of SwiGLU experts as a loop: every expert runs on every token and its
  output is weighted by the token's routing weight for it (zero if not chosen)."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    d, e, f = cfg.d_model, cfg.num_experts, cfg.expert_width
    self.router = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d, e)))
    if cfg.router_bias:  # GPT-OSS (zeros draw no key, as in flax_tp.moe)
      self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
    if cfg.router_selection_bias:  # (zeros draw no key, as in flax_tp.moe)
      from flax_tp.moe import SelectionBias  # the optimizer's filter leaves it out
      self.selection_bias = SelectionBias(jnp.zeros((e,), jnp.float32))
    self.gate = nnx.Param(EXPERT_INIT(rngs.params(), (e, d, f)))
    self.up = nnx.Param(EXPERT_INIT(rngs.params(), (e, d, f)))
    self.down = nnx.Param(EXPERT_INIT(rngs.params(), (e, f, d)))
    if cfg.expert_bias:  # GPT-OSS (zeros draw no key, as in flax_tp.moe)
      self.gate_bias, self.up_bias = (nnx.Param(jnp.zeros((e, f), jnp.float32)) for _ in "gu")
      self.down_bias = nnx.Param(jnp.zeros((e, d), jnp.float32))
    if cfg.shared_expert_d_ff:
      dense = dict(use_bias=False, dtype=cfg.compute_dtype, rngs=rngs)
      self.shared_gate = nnx.Linear(d, cfg.shared_expert_d_ff, **dense)
      self.shared_up = nnx.Linear(d, cfg.shared_expert_d_ff, **dense)
      self.shared_down = nnx.Linear(cfg.shared_expert_d_ff, d, **dense)
      if cfg.shared_expert_gated:
        self.shared_expert_gate = nnx.Param(
            nnx.initializers.lecun_normal()(rngs.params(), (d, 1)))
    self.cfg = cfg

  def _gated(self, g, u):
    """silu(g) * u, or GPT-OSS's clamped form (transformers' ``_apply_gate``)."""
    limit = self.cfg.swiglu_limit
    if limit is None:
      return jax.nn.silu(g) * u
    g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return (u + 1) * g * jax.nn.sigmoid(g * self.cfg.swiglu_alpha)

  def route(self, logits):
    """float32 ``logits [t, E]`` -> ``(weights [t, k], experts [t, k])``, as transformers'
    routers compute them: Mixtral's and Qwen's softmax top-k, or DeepSeek-V3's and
    GLM-4.5's sigmoid scores, picked with the selection bias from the best groups."""
    cfg = self.cfg
    if cfg.router_score == "softmax":
      scores = jax.nn.softmax(logits, axis=-1)
    else:
      scores = jax.nn.sigmoid(logits)
    choice = scores
    if cfg.router_selection_bias:
      choice = scores + self.selection_bias[...]
    if cfg.expert_groups > 1:  # Glm4MoeTopkRouter: groups by their two best, top groups
      t, per = logits.shape[0], cfg.num_experts // cfg.expert_groups
      group_scores = jnp.sum(jax.lax.top_k(choice.reshape(t, cfg.expert_groups, per), 2)[0],
                             axis=-1)
      _, groups = jax.lax.top_k(group_scores, cfg.expert_groups_per_token)
      mask = jnp.zeros_like(group_scores).at[jnp.arange(t)[:, None], groups].set(1.0)
      mask = jnp.broadcast_to(mask[:, :, None], (t, cfg.expert_groups, per)).reshape(t, -1)
      choice = jnp.where(mask > 0, choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.normalize_top_k:
      eps = 0.0 if cfg.router_score == "softmax" else 1e-20
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + eps)
    return weights * cfg.routed_scale, experts

  def __call__(self, x_bsd):
    """-> (y [b, s, d], (the router's logits [b * s, E] in float32, the experts [b * s,
    k] each token picked))."""
    cfg = self.cfg
    dtype = cfg.compute_dtype
    x = x_bsd.reshape(-1, cfg.d_model)
    logits = x.astype(jnp.float32) @ self.router[...]
    if cfg.router_bias:
      logits = logits + self.router_bias[...]
    weights, experts = self.route(logits)
    weights = weights.astype(dtype)
    if cfg.expert_capacity_factor is not None:  # dropped choices weigh nothing
      capacity = max(1, math.ceil(cfg.expert_capacity_factor * x.shape[0]
                                  * cfg.experts_per_token / cfg.num_experts))
      kept = capacity_kept(experts, weights, capacity, cfg.expert_drop_policy)
      weights = jnp.where(kept, weights, jnp.zeros((), weights.dtype))
    xc = x.astype(dtype)
    y = jnp.zeros_like(xc)
    for e in range(cfg.num_experts):
      gate, up, down = (w[...][e].astype(dtype) for w in (self.gate, self.up, self.down))
      g, u = xc @ gate, xc @ up
      if cfg.expert_bias:
        g, u = g + self.gate_bias[...][e].astype(dtype), u + self.up_bias[...][e].astype(dtype)
      out = self._gated(g, u) @ down
      if cfg.expert_bias:
        out = out + self.down_bias[...][e].astype(dtype)
      y = y + jnp.sum(jnp.where(experts == e, weights, 0), axis=-1)[:, None] * out
    if cfg.shared_expert_d_ff:
      shared = self.shared_down(jax.nn.silu(self.shared_gate(xc)) * self.shared_up(xc))
      if cfg.shared_expert_gated:
        shared = jax.nn.sigmoid(xc @ self.shared_expert_gate[...].astype(dtype)) * shared
      y = y + shared
    return y.reshape(x_bsd.shape), (logits, experts)


def capacity_kept(experts, weights, capacity: int, policy: str):
  """``[t, k]`` bool: the choices (``experts, weights [t, k]``) their experts keep when
  each takes at most ``capacity``: a choice is kept when fewer than ``capacity`` choices
  of its expert come before it, by weight (largest first on ``flax_tp.moe``'s
  ``rank_weight`` grid, ``"probs"``) then position,
  or by position alone (``"position"``). Written as pairwise comparisons."""
  from flax_tp.moe import rank_weight  # the drop policy's definition of "larger"
  e, w = experts.reshape(-1), rank_weight(weights.reshape(-1))
  at = jnp.arange(e.shape[0])
  earlier = at[None, :] < at[:, None]  # [c, c']: c' comes before c
  if policy == "probs":
    earlier = (w[None, :] > w[:, None]) | ((w[None, :] == w[:, None]) & earlier)
  ahead = jnp.sum((e[None, :] == e[:, None]) & earlier, axis=1)
  return (ahead < capacity).reshape(experts.shape)


def load_balancing_loss(router_logits: list, top_k: int, score: str = "softmax",
                        picked: list | None = None):
  """transformers' ``load_balancing_loss_func`` (no attention mask) of the MoE layers'
  router logits, concatenated as it concatenates them. A sigmoid router (``score``):
  the same formula over the experts each token ``picked`` and its scores normalised per
  token (DeepSeek-V3's balance loss's probabilities)."""
  logits = jnp.concatenate(router_logits, axis=0)
  if score == "softmax":
    probs = jax.nn.softmax(logits, axis=-1)
    _, selected = jax.lax.top_k(probs, top_k)
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    selected = jnp.concatenate(picked, axis=0)
  mask = jax.nn.one_hot(selected, logits.shape[-1])  # [t, k, E]
  tokens_per_expert = jnp.mean(mask, axis=0)
  prob_per_expert = jnp.mean(probs, axis=0)
  return jnp.sum(tokens_per_expert * prob_per_expert[None]) * logits.shape[-1]


class Block(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, layer: int = 0):
    self.ln1 = cfg.norm_layer(rngs) if cfg.pre_norm else None
    self.attn = (LatentAttention if cfg.latent_attention else Attention)(cfg, rngs=rngs)
    self.ln2 = cfg.norm_layer(rngs) if cfg.pre_norm else None
    self.mlp = LoopMoE(cfg, rngs=rngs) if cfg.is_moe_layer(layer) else MLP(cfg, rngs=rngs)
    if cfg.sandwich_norm:
      self.ln_attn_out = cfg.norm_layer(rngs)
      self.ln_mlp_out = cfg.norm_layer(rngs)
    self.cfg = cfg

  def __call__(self, x_bsd, key, layer):
    """-> (x [b, s, d], the router's logits, or None for a dense MLP)."""
    rate, rows = self.cfg.dropout, jnp.arange(x_bsd.shape[0])
    attn = self.attn(ops.pre_norm(self.ln1, x_bsd), key, layer)
    if self.cfg.sandwich_norm:
      attn = self.ln_attn_out(attn)
    x_bsd = x_bsd + ops.dropout(attn, ops.site_key(key, layer, ops.ATTN_OUT), rate, rows)
    mlp, router = self.mlp(ops.pre_norm(self.ln2, x_bsd)), None
    if isinstance(self.mlp, LoopMoE):
      mlp, router = mlp
    if self.cfg.sandwich_norm:
      mlp = self.ln_mlp_out(mlp)
    x_bsd = x_bsd + ops.dropout(mlp, ops.site_key(key, layer, ops.MLP_OUT), rate, rows)
    return x_bsd, router


class ReferenceTransformer(nnx.Module):
  """tokens ``[b, s]`` int -> logits ``[b, s, v]``."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs, layer=i) for i in range(cfg.num_layers)])
    self.ln_f = cfg.norm_layer(rngs)
    if not cfg.tie_embeddings:
      self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                             dtype=cfg.compute_dtype, rngs=rngs)
    self.cfg = cfg

  def __call__(self, tokens_bs, *, dropout_key=None, return_router_logits=False,
               return_picked=False):
    """``return_router_logits``: also the MoE layers' router logits (a list of
    ``[b * s, E]``, as transformers' ``output_router_logits``); ``return_picked`` too:
    and the experts each token picked (a list of ``[b * s, k]``)."""
    cfg = self.cfg
    x = ops.scale_embeddings(cfg, self.embed(tokens_bs))
    x = ops.dropout(x, ops.site_key(dropout_key, 0, ops.EMBED), cfg.dropout,
                    jnp.arange(tokens_bs.shape[0]))
    router_logits, picked = [], []
    for layer, block in enumerate(self.blocks):
      x, router = block(x, dropout_key, layer)
      if router is not None:
        router_logits.append(router[0])
        picked.append(router[1])
    x = self.ln_f(x)
    logits = ops.softcap_of(self.embed.attend(x) if cfg.tie_embeddings else self.head(x),
                            cfg.final_softcap)
    if return_picked:
      return logits, router_logits, picked
    return (logits, router_logits) if return_router_logits else logits


def reference_loss(model: ReferenceTransformer, tokens_bs1, *, dropout_key=None,
                   label_smoothing: float = 0.0, z_loss: float = 0.0, microbatches: int = 1):
  """Mean next-token cross-entropy of ``tokens [b, s + 1]`` (optax's formula); with
  mixture-of-experts layers plus ``router_aux_loss_coef`` times the load-balancing loss,
  as transformers' MoE models add it. ``microbatches``: the mean of this loss over the
  step's microbatches (rows ``m, m + M, ...``), each routed on its own: how a step of
  several microbatches (accumulated, or a pipeline's) computes a mixture of experts'."""
  import optax
  if microbatches > 1:
    if dropout_key is not None:
      raise ValueError("the reference's microbatches take no dropout key")
    return jnp.mean(jnp.stack([
        reference_loss(model, tokens_bs1[m::microbatches], label_smoothing=label_smoothing,
                       z_loss=z_loss) for m in range(microbatches)]))

  # A mixture of experts sees all S + 1 tokens, as transformers runs its input_ids: the
  # last one predicts nothing, but its routing counts in the load-balancing loss.
  experts = model.cfg.has_experts
  logits, router_logits, picked = model(tokens_bs1 if experts else tokens_bs1[:, :-1],
                                        dropout_key=dropout_key, return_picked=True)
  logits = (logits[:, :-1] if experts else logits).astype(jnp.float32)
  targets = optax.smooth_labels(jax.nn.one_hot(tokens_bs1[:, 1:], logits.shape[-1]),
                                label_smoothing)
  loss = optax.softmax_cross_entropy(logits, targets)
  if z_loss:
    loss = loss + z_loss * jax.nn.logsumexp(logits, axis=-1) ** 2
  loss = jnp.mean(loss)
  if router_logits and model.cfg.router_aux_loss_coef:  # as transformers' MoE models add it
    loss = loss + model.cfg.router_aux_loss_coef * load_balancing_loss(
        router_logits, model.cfg.experts_per_token, model.cfg.router_score, picked)
  return loss


def param_count(cfg) -> int:
  """The model's logical params (no padding), counted without allocating them."""
  abstract = nnx.eval_shape(lambda: ReferenceTransformer(cfg, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
