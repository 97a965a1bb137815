"""A decoder-only transformer built from flax_tp layers (Megatron's layout).

Per block, inside one ``shard_map`` over the mesh's axes ("data", "model", and any of
"context", "stage", "expert"):

    x [b, s, d] replicated over "model" (sequence parallel: this device's s / m rows)
      -> the config's norm (RMSNorm, LayerNorm, Gemma's offset RMSNorm)
      -> copy_to_parallel (or all-gather) -> q, k, v column-parallel by whole heads
      -> rotary, attention on this device's heads (models/attention.py's cores)
      -> o row-parallel (all-reduce #1, or reduce-scatter) -> residual
      -> the norm -> the MLP (gate/up column-parallel, the config's activation, down
         row-parallel: all-reduce #2), or the experts (flax_tp/moe/) -> residual

The LM head (tied or not) gives this device's vocabulary shard of the logits, which
``flax_tp.vocab_parallel_cross_entropy`` consumes without gathering them (by pieces of
the sequence with ``Execution.loss_chunks``).
Param names, nesting and key-draw order match ``models/reference.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec as P

import flax_tp
from flax_tp.collectives import is_varying
from flax_tp.context import ContextSplit
from flax_tp.data_parallel import gather_for_step, global_rows, whole_over_data
from flax_tp.padding import masked
from flax_tp.params import place_on_mesh, sharded_param
from flax_tp.remat import KEY_PROJ, OUT_PROJ, QUERY_PROJ, VALUE_PROJ, run_blocks
from flax_tp.sequence import ActivationLayout
from models import attention, execution as execution_lib, layer_kinds, ops
from models.config import TransformerConfig
from models.execution import Execution
from models.ops import GATED


def _dropout(x, key, rate, rows, layout=None):
  """Residual/embedding dropout of ``x [b, n, d]``; with the sequence split (``layout``,
  a ``flax_tp.sequence.ActivationLayout``) the mask is the whole sequence's (logical
  positions), read at this device's slots."""
  if layout is None or not layout.is_split or key is None or rate == 0.0:
    return ops.dropout(x, key, rate, rows)
  keep = ops.keep_mask(key, rate, rows, (layout.logical_len,) + x.shape[2:])
  return ops.apply_keep(x, layout.of_whole(keep), rate)


# transformers' GptOssPreTrainedModel init of the sinks (normal, initializer_range 0.02),
# drawn after o in models/reference.py too
SINK_INIT = nnx.initializers.normal(0.02)


class ParallelAttention(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, mesh: Mesh, rngs: nnx.Rngs):
    width = cfg.num_heads * cfg.head_dim
    # Query heads are split whole (shard_unit=head_dim); each device holds the
    # kv heads its query heads use, replicated where the axis does not line up
    # with the groups (KVHeadLayout), so attention needs no communication.
    kv_layout = flax_tp.KVHeadLayout(cfg.kv_heads * cfg.head_dim, mesh.shape[flax_tp.MODEL_AXIS],
                                     cfg.head_dim, num_heads=cfg.num_heads)
    kw = dict(mesh=mesh, dtype=cfg.compute_dtype, rngs=rngs)
    qkv = dict(gather_output=False, use_bias=cfg.qkv_bias, **kw)
    self.q = flax_tp.ColumnParallelDense(cfg.d_model, width, shard_unit=cfg.head_dim, **qkv)
    self.k = flax_tp.ColumnParallelDense(cfg.d_model, kv_layout.size, layout=kv_layout, **qkv)
    self.v = flax_tp.ColumnParallelDense(cfg.d_model, kv_layout.size, layout=kv_layout, **qkv)
    self.o = flax_tp.RowParallelDense(width, cfg.d_model, input_is_parallel=True,
                                      shard_unit=cfg.head_dim, use_bias=cfg.attn_out_bias,
                                      **kw)
    if cfg.attn_sinks:  # one logit per query head, split as the heads are (GPT-OSS)
      self.sinks = sharded_param(
          SINK_INIT, rngs.params(), (cfg.num_heads,), jnp.float32, mesh=mesh,
          axis_name=flax_tp.MODEL_AXIS, dim=0, name="sinks",
          layout=flax_tp.ShardLayout(cfg.num_heads, mesh.shape[flax_tp.MODEL_AXIS]))
    if cfg.qk_norm and cfg.qk_norm_span == "projection":
      # Over the whole projection (OLMo 2/3), whose heads are split: each device norms
      # its own heads by the row's mean square, one [b, s, 1] all-reduce per norm.
      norm = dict(mesh=mesh, epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, rngs=rngs)
      self.q_norm = flax_tp.SplitRMSNorm(width, layout=self.q.layout, **norm)
      self.k_norm = flax_tp.SplitRMSNorm(kv_layout.size, layout=kv_layout, **norm)
    elif cfg.qk_norm:  # over head_dim, replicated: each device norms its own heads
      self.q_norm = cfg.norm_layer(rngs, cfg.head_dim)
      self.k_norm = cfg.norm_layer(rngs, cfg.head_dim)
    # The kernel of training attention over a whole sequence, "xla" or "splash"
    # (models.execution.apply sets it from Execution.attention).
    self.attention_kernel = "xla"
    self.cfg = cfg

  @property
  def _query_dense(self) -> flax_tp.ColumnParallelDense:
    """The column layer whose output columns are this device's query heads."""
    return self.q

  def cache_heads(self) -> int:
    """The kv heads this device's KV cache holds (stored, padded ones included)."""
    return self.k.layout.padded_size // self.cfg.head_dim

  def _project(self, x_bsd, layer, positions=None, layout=None):
    """This device's query heads ``[b, s, hq_pad, k]`` and kv heads ``[b, s, hkv_pad, k]``
    (q/k normed if ``qk_norm``, then rotary as ``layer``'s kind has it, at ``positions
    [b, s]``, default ``0 .. s-1``). Padded heads stay zero: a norm of zero is zero.
    ``layout`` (an ``ActivationLayout``): with SP ``x`` is the device's block, gathered
    first."""
    x_bsd = x_bsd if layout is None else layout.gather(x_bsd)
    b, s, _ = x_bsd.shape
    # One matmul for q, k and v (their local kernels joined), one all-reduce of
    # the input gradient in backward.
    split = lambda t: t.reshape(b, s, -1, self.cfg.head_dim)
    q, k, v = flax_tp.fused_column_parallel((self.q, self.k, self.v), x_bsd)
    if self.cfg.qk_norm and self.cfg.qk_norm_span == "projection":
      q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = split(q), split(k), split(v)
    if self.cfg.qk_norm and self.cfg.qk_norm_span == "head":
      q, k = self.q_norm(q), self.k_norm(k)
    rotate = functools.partial(layer_kinds.rotate, self.cfg, positions=positions, layer=layer)
    return rotate(q), rotate(k), v

  def _head_map(self):
    """How this device's query heads read its kv heads: (``kv_index [hq_pad]``, the
    local kv head of each query head, or None where this device's query heads are whole
    groups over its kv heads in order (``attend``'s ``i // (h / g)``, each kv head read
    once for its group); ``real [hq_pad]`` bool, which query heads are not padding, or
    None without grouped-query attention; ``heads [hq_pad]``, their global ids)."""
    cfg = self.cfg
    query = self._query_dense
    device = flax_tp.shard_index(query.axis_name)
    kv_index = real = None
    if cfg.kv_heads != cfg.num_heads:
      index, real = (jnp.asarray(t)[device] for t in self.k.layout.kv_for_query_heads)
      if not self.k.layout.groups_line_up:  # replicated kv heads straddle its groups
        kv_index = index
    first_head = jnp.asarray(query.layout.offsets)[device]
    heads = first_head // cfg.head_dim + jnp.arange(query.layout.padded_size // cfg.head_dim)
    return kv_index, real, heads

  def _attend(self, q, k, v, layer, q_positions=None, k_positions=None, **kw):
    """``attend`` with this layer's spec and this device's head map -> ``[b, s, hq_pad *
    k]``; a padded query head (zero q, which would average real values under
    grouped-query attention) gives zero, as plain attention's padded heads do."""
    kv_index, real, _ = self._head_map()
    spec = attention.AttentionSpec.of(self.cfg, layer).with_sinks(self._local_sinks())
    out = attention.attend(q, k, v, spec, q_positions, k_positions, kv_index=kv_index, **kw)
    if real is not None:
      out = jnp.where(real[:, None], out, jnp.zeros((), out.dtype))
    return self._merge_heads(out)

  def _local_sinks(self):
    """This device's query heads' sink logits ``[hq_pad]`` (padding zero), or None."""
    if not self.cfg.attn_sinks:
      return None
    layout = flax_tp.ShardLayout(self.cfg.num_heads, self._query_dense.layout.parts)
    return masked(self.sinks[...], layout, 0, self._query_dense.axis_name)

  def _merge_heads(self, out):
    """Attention's ``[b, s, hq_pad, k]`` -> the output projection's input ``[b, s, hq_pad
    * k]``."""
    return out.reshape(out.shape[:2] + (-1,))

  def __call__(self, x_bsd, key, layer, rows, layout=None, *, return_kv=False):
    """x: ``[b, s, d]`` replicated -> ``[b, s, d]`` replicated (after one all-reduce);
    ``return_kv``: also this device's keys and values ``[b, s, hkv_pad, k]`` (after
    q/k norm and rotary, as a cache holds them; its context slots on a context mesh).

    ``layout`` (a ``flax_tp.sequence.ActivationLayout``): with sequence parallelism
    ``x`` is this device's block ``[b, s_pad, d]``: one all-gather over "model" gives
    q, k and v the device's tokens, and the output projection reduce-scatters back to
    the block. With context parallelism those tokens are this device's two chunks of
    the sequence at their global positions (rotary and the mask read them), and the
    context strategy's core (``attention.core_of``) reaches the other devices' keys.
    """
    layout = layout or ActivationLayout()
    q, k, v = self._project(x_bsd, layer, layout.positions(), layout)
    q, k, v = (checkpoint_name(t, name) for t, name in ((q, QUERY_PROJ), (k, KEY_PROJ),
                                                        (v, VALUE_PROJ)))
    dropout_key = ops.site_key(key, layer, ops.ATTN_PROBS)
    dropout = None
    if dropout_key is not None:
      dropout = attention.Dropout(dropout_key, rows, self._head_map()[2])
    out = self._attend(q, k, v, layer, dropout=dropout,
                       core=attention.core_of(layout.context, self.attention_kernel))
    out = checkpoint_name(self.o(layout.for_scatter(out)), OUT_PROJ)  # (what remat's
    # named policies keep, as q, k and v above and attention's output in ``attend``)
    return (out, (k, v)) if return_kv else out

  def extend(self, x_bsd, cache, positions, layer):
    """One cached step of block ``layer``: ``x [b, s, d]`` replicated at ``positions
    [b, s]`` (consecutive per row) -> (``[b, s, d]`` replicated after one all-reduce,
    the updated cache).

    cache: ``(k, v)``, each ``[b, L, hkv_pad, k]``, this device's kv heads (the heads
    its query heads use, replicated ones included, padding zero). The new tokens'
    keys and values are written at their positions, then every query attends to
    the cache slots at or before its own position (the slots past it hold padding
    or stale values).
    """
    q, k, v = self._project(x_bsd, layer, positions)
    write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice_in_dim(
        c, new.astype(c.dtype), at, axis=0))
    cache_k, cache_v = (write(c, new, positions[:, 0]) for c, new in zip(cache, (k, v),
                                                                           strict=True))
    slots = jnp.arange(cache_k.shape[1])
    out = self._attend(q, cache_k, cache_v, layer, positions, slots)
    return self.o(out), (cache_k, cache_v)


# transformers' DeepseekV3RMSNorm default, which its latent norms keep whatever
# rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class LatentAttention(ParallelAttention):
  """DeepSeek-V3's multi-head latent attention (MLA), split as transformers' plan, SGLang
  and Megatron split it.

  Per block, inside the step's ``shard_map``:

      x [b, s, d] replicated over "model"
        -> q_a [d, q_lora] -> RMSNorm -> q_b column-parallel by head -> q [.., h, nope | rope]
           (or, without q_lora_rank, one column-parallel q)
        -> kv_a [d, kv_lora + rope] -> the latent RMSNormed | one rotary key head
        -> kv_b column-parallel by head -> each head's k_nope | v
        -> rotary on q's rope part and on the shared key head, copied to every head
        -> attention over heads of ``attn_dim`` (the narrower of q/k and v zero-padded)
        -> o row-parallel (all-reduce) -> [b, s, d]

  The down projections and their norms are replicated: each is small (DeepSeek-V3:
  7168 -> 1536 and 7168 -> 576) and splitting them would cost a collective for what a
  head split already divides. Megatron's ``f`` (``copy_to_parallel``) marks the latents,
  not x, so the backward all-reduce sums their cotangents (1536 + 576 wide, the shared
  rotary key's included, instead of 7168). With sequence parallelism the down
  projections run on the device's sequence block and the latents are all-gathered
  instead of the hidden state (Megatron's choice: 3.4x fewer bytes at DeepSeek-V3's
  sizes); without ``q_lora_rank`` q needs the hidden state, which is gathered (and its
  cotangent summed) as usual.

  Rotary runs half-split (``ops.rotary``) on the last ``qk_rope_head_dim`` dims of a q/k
  head; a checkpoint storing them interleaved (``rope_interleave``) has those rows
  permuted on load and back on save (``models/families.py``), so no rotary changes.

  The KV cache holds the expanded per-head k and v (``attn_dim`` wide), not the latent:
  every attention core, context parallelism and the cache code then run unchanged, at
  ``2 * h * attn_dim`` against ``kv_lora + rope`` values per token and layer (DeepSeek-V3:
  49152 against 576, split over "model"); absorbing kv_b into q and o to attend over the
  latent is the decode-time optimisation this leaves out.
  """

  def __init__(self, cfg: TransformerConfig, *, mesh: Mesh, rngs: nnx.Rngs):
    attention, latent = cfg.attention, cfg.attention.latent
    heads, qk, rope = attention.num_heads, attention.head_dim, latent.qk_rope_head_dim
    nope, value = qk - rope, cfg.value_dim
    kw = dict(mesh=mesh, dtype=cfg.compute_dtype, rngs=rngs)
    column = dict(gather_output=False, use_bias=False, **kw)
    dense = dict(dtype=cfg.compute_dtype, use_bias=attention.qkv_bias, rngs=rngs)
    norm = dict(epsilon=LATENT_NORM_EPS, dtype=cfg.compute_dtype, rngs=rngs)
    # (built in transformers' order, which is the reference's key-draw order)
    if latent.q_lora_rank is None:
      self.q = flax_tp.ColumnParallelDense(cfg.d_model, heads * qk, shard_unit=qk, **column)
    else:
      self.q_a = nnx.Linear(cfg.d_model, latent.q_lora_rank, **dense)
      self.q_a_norm = nnx.RMSNorm(latent.q_lora_rank, **norm)
      self.q_b = flax_tp.ColumnParallelDense(latent.q_lora_rank, heads * qk, shard_unit=qk,
                                             **column)
    self.kv_a = nnx.Linear(cfg.d_model, latent.kv_lora_rank + rope, **dense)
    self.kv_a_norm = nnx.RMSNorm(latent.kv_lora_rank, **norm)
    self.kv_b = flax_tp.ColumnParallelDense(latent.kv_lora_rank, heads * (nope + value),
                                            shard_unit=nope + value, **column)
    self.o = flax_tp.RowParallelDense(heads * value, cfg.d_model, input_is_parallel=True,
                                      shard_unit=value, use_bias=attention.out_bias, **kw)
    # The kernel of training attention over a whole sequence, "xla" or "splash"
    # (models.execution.apply sets it from Execution.attention).
    self.attention_kernel = "xla"
    self.cfg = cfg

  @property
  def _query_dense(self) -> flax_tp.ColumnParallelDense:
    return self.q if self.cfg.q_lora_rank is None else self.q_b

  def cache_heads(self) -> int:
    return self._query_dense.layout.padded_size // self.cfg.head_dim

  def _latents(self, x_bsd, layout):
    """``(q's input, the normed kv latent [b, s, kv_lora], the rotary key [b, s,
    rope])`` of the device's tokens, ready for per-device work: their cotangents are
    summed over "model" in one all-reduce in backward (Megatron's ``f`` on the latents,
    not x), or with SP (``x`` the device's block) the latents, not ``x``, are
    all-gathered (where q has its own latent)."""
    cfg = self.cfg
    kv_rank = cfg.kv_lora_rank
    if cfg.q_lora_rank is None:  # q reads the hidden state: x is gathered, as usual
      x_bsd = x_bsd if layout is None else layout.gather(x_bsd)
      kv = self.kv_a(x_bsd)
      latents = jnp.concatenate([self.kv_a_norm(kv[..., :kv_rank]), kv[..., kv_rank:]], -1)
      latents = flax_tp.copy_to_parallel(latents)
      return x_bsd, latents[..., :kv_rank], latents[..., kv_rank:]
    kv = self.kv_a(x_bsd)
    latents = jnp.concatenate([self.q_a_norm(self.q_a(x_bsd)), self.kv_a_norm(kv[..., :kv_rank]),
                               kv[..., kv_rank:]], axis=-1)
    latents = latents if layout is None else layout.gather(latents)  # SP: one all-gather
    latents = flax_tp.copy_to_parallel(latents)  # (a no-op after SP's gather)
    q_in, kv_latent, k_rope = jnp.split(
        latents, [cfg.q_lora_rank, cfg.q_lora_rank + kv_rank], axis=-1)
    return q_in, kv_latent, k_rope

  def _project(self, x_bsd, layer, positions=None, layout=None):
    """This device's heads of q, k and v, each ``[b, s, h_pad, attn_dim]``: q and k
    ``[nope | rope]`` with rotary on the rope part at ``positions`` (the key's rope part
    one head shared by all), v its ``v_head_dim``; zero-padded to ``attn_dim``. Padded
    heads have zero q and v (their keys' shared rope part meets a zero query)."""
    cfg = self.cfg
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    q_in, kv_latent, k_rope = self._latents(x_bsd, layout)
    q = self._query_dense(q_in)
    b, s, _ = q.shape
    q = q.reshape(b, s, -1, cfg.head_dim)
    kv = self.kv_b(kv_latent).reshape(b, s, -1, nope + cfg.value_dim)
    rotate = functools.partial(layer_kinds.rotate, cfg, positions=positions, layer=layer)
    q = jnp.concatenate([q[..., :nope], rotate(q[..., nope:])], axis=-1)
    k_rope = jnp.broadcast_to(rotate(k_rope[:, :, None, :]),
                              kv.shape[:3] + (cfg.qk_rope_head_dim,))
    k = jnp.concatenate([kv[..., :nope], k_rope.astype(kv.dtype)], axis=-1)
    v = kv[..., nope:]
    pad = lambda t: jnp.pad(t, [(0, 0)] * 3 + [(0, cfg.attn_dim - t.shape[-1])])
    return pad(q), pad(k), pad(v)

  def _merge_heads(self, out):
    """``[b, s, h_pad, attn_dim]`` -> the value columns ``[b, s, h_pad * v_head_dim]``."""
    out = out[..., :self.cfg.value_dim]
    return out.reshape(out.shape[:2] + (-1,))


class ParallelMLP(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, mesh: Mesh, rngs: nnx.Rngs):
    kw = dict(mesh=mesh, dtype=cfg.compute_dtype, use_bias=cfg.mlp_bias, rngs=rngs)
    # gate and up are split identically, so the gating stays on each device.
    if cfg.mlp in GATED:
      self.gate = flax_tp.ColumnParallelDense(cfg.d_model, cfg.d_ff, gather_output=False, **kw)
    self.up = flax_tp.ColumnParallelDense(cfg.d_model, cfg.d_ff, gather_output=False, **kw)
    self.down = flax_tp.RowParallelDense(cfg.d_ff, cfg.d_model, input_is_parallel=True, **kw)
    self.kind = cfg.mlp

  def __call__(self, x_bsd, layout=None):
    """``[b, s, d]`` replicated -> ``[b, s, d]`` replicated; GELU(0) = SiLU(0) = 0 keeps
    padding at 0 (``ops.mlp_hidden``). With sequence parallelism (``layout.sequence``),
    this device's sequence block in and out (one all-gather in, one reduce-scatter out)."""
    layout = layout or ActivationLayout()
    x_bsd = layout.gather(x_bsd)
    # gate and up as one matmul (one backward all-reduce, or with SP reduce-scatter)
    if self.kind in GATED:
      hidden = ops.mlp_hidden(self.kind, *flax_tp.fused_column_parallel((self.gate, self.up),
                                                                       x_bsd))
    else:
      hidden = ops.mlp_hidden(self.kind, None, self.up(x_bsd))
    return self.down(layout.for_scatter(hidden))


def moe_layer(cfg: TransformerConfig, *, mesh: Mesh, rngs: nnx.Rngs,
              expert_axes: tuple[str, ...] = flax_tp.MeshAxes.DEFAULT_EXPERT_ROLES,
              dispatcher: str = "all_gather") -> flax_tp.MoE:
  """A block's mixture of experts: experts over ``expert_axes`` (``Execution``'s; "data"
  by default), each expert's FFN over "model" unless the experts split over it."""
  experts, routing = cfg.experts, cfg.experts.router
  router = flax_tp.Router(experts.per_token, score=routing.score,
                          normalize=routing.normalize_top_k, groups=routing.groups,
                          top_groups=routing.groups_per_token, scale=routing.routed_scale)
  return flax_tp.MoE(cfg.d_model, cfg.expert_width, experts.num_experts, experts.per_token,
                     mesh=mesh, router=router, selection_bias=routing.selection_bias,
                     router_bias=routing.bias, expert_bias=experts.bias,
                     activation=flax_tp.SwiGLU(experts.swiglu_limit, experts.swiglu_alpha),
                     expert_axes=expert_axes, shared_d_ff=experts.shared_d_ff,
                     shared_gated=experts.shared_gated, dispatcher=dispatcher,
                     capacity_factor=experts.capacity_factor,
                     drop_policy=experts.drop_policy, dtype=cfg.compute_dtype, rngs=rngs)


class ParallelBlock(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, mesh: Mesh, rngs: nnx.Rngs, layer: int = 0,
               expert_axes: tuple[str, ...] = flax_tp.MeshAxes.DEFAULT_EXPERT_ROLES,
               dispatcher: str = "all_gather"):
    self.ln1 = cfg.norm_layer(rngs) if cfg.pre_norm else None
    attention_of = LatentAttention if cfg.latent_attention else ParallelAttention
    self.attn = attention_of(cfg, mesh=mesh, rngs=rngs)
    self.ln2 = cfg.norm_layer(rngs) if cfg.pre_norm else None
    self.mlp = (moe_layer(cfg, mesh=mesh, rngs=rngs, expert_axes=expert_axes,
                          dispatcher=dispatcher)
                if cfg.is_moe_layer(layer)
                else ParallelMLP(cfg, mesh=mesh, rngs=rngs))
    if cfg.sandwich_norm:  # Gemma 2/3: each branch's output normed before its residual add
      self.ln_attn_out = cfg.norm_layer(rngs)
      self.ln_mlp_out = cfg.norm_layer(rngs)
    self.cfg = cfg

  def _attn_out(self, x):
    return self.ln_attn_out(x) if self.cfg.sandwich_norm else x

  def _mlp_out(self, x):
    return self.ln_mlp_out(x) if self.cfg.sandwich_norm else x

  @property
  def is_moe(self) -> bool:
    return isinstance(self.mlp, flax_tp.MoE)

  def _mlp(self, x_bsd, layout=None, dropless=False):
    """The MLP's output and, for a MoE, its router statistics (else None)."""
    if not self.is_moe:
      return self.mlp(x_bsd, layout), None
    if layout is None:
      return self.mlp(x_bsd, dropless=dropless)
    return self.mlp(x_bsd, layout.sequence, dropless=dropless, context=layout.context)

  def extend(self, x_bsd, cache, positions, layer):
    """Block ``layer`` on new tokens with a KV cache (no dropout: inference). A MoE
    routes each new token alone, as in training, and drops nothing (a capacity factor
    is for training's static shapes; transformers decodes dropless)."""
    attn, cache = self.attn.extend(ops.pre_norm(self.ln1, x_bsd), cache, positions, layer)
    x_bsd = x_bsd + self._attn_out(attn)
    mlp = self._mlp(ops.pre_norm(self.ln2, x_bsd), dropless=True)[0]
    return x_bsd + self._mlp_out(mlp), cache

  def prefill(self, x_bsd, layer, layout):
    """Block ``layer`` on a prompt split as ``layout`` says (context parallel; no
    dropout, a MoE dropless as in decoding) -> (``x`` likewise, this device's ``(k, v)``
    ``[b, n, hkv_pad, k]`` of its slots)."""
    rows = jnp.arange(x_bsd.shape[0])
    attn, kv = self.attn(ops.pre_norm(self.ln1, x_bsd), None, layer, rows, layout,
                         return_kv=True)
    x_bsd = x_bsd + self._attn_out(attn)
    mlp = self._mlp(ops.pre_norm(self.ln2, x_bsd), layout, dropless=True)[0]
    return x_bsd + self._mlp_out(mlp), kv

  def __call__(self, x_bsd, key, layer, rows, layout=None):
    """``[b, s, d]`` replicated, or split as ``layout`` says (an ``ActivationLayout``:
    this device's SP block ``[b, s_pad, d]`` and/or its context slots; norms, dropout
    and residuals then run on those only). A MoE block returns ``(x, RouterStats)``."""
    drop = functools.partial(_dropout, rate=self.cfg.dropout, rows=rows, layout=layout)
    attn = self._attn_out(self.attn(ops.pre_norm(self.ln1, x_bsd), key, layer, rows, layout))
    x_bsd = x_bsd + drop(attn, ops.site_key(key, layer, ops.ATTN_OUT))
    mlp, stats = self._mlp(ops.pre_norm(self.ln2, x_bsd), layout)
    x_bsd = x_bsd + drop(self._mlp_out(mlp), ops.site_key(key, layer, ops.MLP_OUT))
    return x_bsd if stats is None else (x_bsd, stats)


def _logits(head: nnx.Module, x_bsd: jax.Array, cfg: TransformerConfig) -> jax.Array:
  """The head (the tied embedding's ``attend``, or a column-parallel ``head``) on
  ``x [b, s, d]`` -> this device's vocabulary shard ``[b, s, vocab_pad]``, soft-capped."""
  return ops.softcap_of(head.attend(x_bsd) if cfg.tie_embeddings else head(x_bsd),
                        cfg.final_softcap)


class _Tail(nnx.Module):
  """What follows the blocks: the final norm and the head (the embedding, tied)."""

  def __init__(self, ln_f: nnx.Module, head: nnx.Module):
    self.ln_f = ln_f
    self.head = head


def per_microbatch(stats: flax_tp.RouterStats) -> flax_tp.RouterStats:
  """``stats`` with a leading microbatch axis: as they are when a step's microbatches kept
  theirs apart (``tokens [M]``), else as one microbatch (``[1, ...]``)."""
  return stats if jnp.ndim(stats.tokens) else jax.tree.map(lambda a: a[None], stats)


class Transformer(nnx.Module):
  """tokens ``[b, s]`` -> logits, tensor-parallel over the mesh's ``"model"`` axis.

  Inside ``shard_map`` over the mesh: tokens ``[b_local, s]`` (sharded over
  ``"data"``, replicated over ``"model"``) -> this device's padded vocabulary
  shard of the logits ``[b_local, s, vocab_pad]``.
  Standalone: tokens ``[b, s]`` -> logits ``[b, s, vocab]`` (it maps itself,
  batch sharded over ``"data"``), equal to ``ReferenceTransformer``'s.
  """

  def __setstate__(self, state):
    # Unpickled arrays are host copies: put every param back on the mesh.
    super().__setstate__(state)
    place_on_mesh(self)

  def __init__(self, cfg: TransformerConfig, *, mesh: Mesh, rngs: nnx.Rngs,
               execution: Execution = Execution(), lora: flax_tp.LoRAConfig | None = None):
    """``lora``: adapters on the layers its targets match (``flax_tp.add_adapters``),
    added before the execution is applied, so they are stacked and split as their base."""
    self.embed = flax_tp.VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, mesh=mesh,
                                                dtype=cfg.compute_dtype, rngs=rngs,
                                                padding_idx=cfg.padding_idx)
    # The experts' layout (Execution.expert_axes) is their params' placement: chosen
    # as they are built, not by apply.
    self.blocks = nnx.List([ParallelBlock(cfg, mesh=mesh, rngs=rngs, layer=i,
                                          expert_axes=execution.expert_axes,
                                          dispatcher=execution.expert_dispatcher)
                            for i in range(cfg.num_layers)])
    self.ln_f = cfg.norm_layer(rngs)
    if not cfg.tie_embeddings:
      self.head = flax_tp.ColumnParallelDense(cfg.d_model, cfg.vocab_size, use_bias=False,
                                              gather_output=False, mesh=mesh,
                                              dtype=cfg.compute_dtype, rngs=rngs)
    flax_tp.replicate_on_mesh(self, mesh)  # the norms
    self.cfg = cfg
    self.mesh = mesh
    self.lora = lora
    self.lora_targets = tuple(flax_tp.add_adapters(self, lora)) if lora else ()
    # Sequence parallelism, scanned layers, FSDP: in one place, in a documented order.
    execution_lib.apply(self, execution)

  @property
  def vocab_layout(self) -> flax_tp.ShardLayout:
    """How the logits' vocabulary dimension is split and padded."""
    return self.embed.layout

  def __call__(self, tokens_bs, *, dropout_key=None, with_aux=False, rows=None,
               per_token_loss=None, per_token=()):
    """``with_aux`` (inside the step's map): ``(logits, aux)``, where ``aux`` is what the
    model's own losses and metrics (``aux_losses``, ``aux_metrics``) are computed from:
    a dict of sums over this device's tokens (its data shard's, and on a context mesh its
    context slots' holding a token), which the step sums over ``batch_axes()`` first.
    Empty for a model without mixture-of-experts layers; with them ``"router"``, the MoE
    layers' ``flax_tp.RouterStats`` added up, and ``"layer_loads"``, each MoE layer's
    counts ``[MoE layers, E]`` in layer order (the selection biases' balancing reads
    them). ``rows``: the global ids of ``tokens_bs``' rows (dropout's keys), where they are
    not this data shard's rows in order (an accumulated step's microbatch).

    ``per_token_loss(logits, *per_token) -> [b, c]`` (inside the step's map): instead of
    the logits, the sum of every scored token's loss, the logits made
    ``execution.loss_chunks`` pieces of the sequence at a time
    (``flax_tp.chunked_token_loss``: ``per_token``, the labels ``[b, m]``, cut alike)."""
    if not flax_tp.axis_is_bound(flax_tp.MODEL_AXIS):
      if with_aux:
        raise ValueError("with_aux is for a call inside the step's shard_map")
      return self._standalone(tokens_bs, dropout_key)
    cfg = self.cfg
    # Each row's global number (dropout's key), or for a batch replicated over "data"
    # its own row number on every shard.
    if rows is None:
      rows = (global_rows(tokens_bs.shape[0]) if is_varying(tokens_bs, flax_tp.DATA_AXIS)
              else jnp.arange(tokens_bs.shape[0]))
    layout = self.activation_layout(tokens_bs.shape[1])
    x = ops.scale_embeddings(cfg, self.embed(layout.tokens(tokens_bs)))  # sequence
    # parallel: reduce-scattered to this device's block
    x = layout.zero_padding(x)
    x = _dropout(x, ops.site_key(dropout_key, 0, ops.EMBED), cfg.dropout, rows, layout)
    x, stats, loads = self._blocks(x, dropout_key, rows, layout)
    x = self.ln_f(x)
    x = flax_tp.copy_to_parallel(x) if layout.sequence is None else layout.gather(x)
    head = self.embed if cfg.tie_embeddings else self.head
    if per_token_loss is None:
      out = _logits(head, x, cfg)
    else:
      out = flax_tp.chunked_token_loss(x, lambda x: _logits(head, x, cfg), per_token_loss,
                                       per_token, chunks=self.execution.loss_chunks)
    if not with_aux:
      return out
    return out, ({} if stats is None else {"router": stats, "layer_loads": loads})

  def step_tokens(self, tokens_bs):
    """What the model runs of a next-token step's tokens ``[b, S + 1]``: the first ``S``,
    or with mixture-of-experts layers all ``S + 1``, as transformers runs its
    ``input_ids`` (the last token predicts nothing, but its routing counts in the
    load-balancing loss; its logits are dropped)."""
    return tokens_bs if self.cfg.has_experts else tokens_bs[:, :-1]

  def aux_losses(self, aux, options) -> dict:
    """The losses the model adds to a step's, by name, weighted, from ``aux`` (``__call__``'s,
    summed over the whole batch): with experts, ``router_aux_loss_coef`` times the
    load-balancing loss and ``options.router_z_loss`` times the router z-loss, both over
    every MoE layer (as transformers concatenates the layers' router logits). A step of
    several microbatches (a pipeline's, or accumulated: ``aux``'s statistics ``[M, ...]``)
    adds their mean, each microbatch's losses from its own routing (Megatron's rule, the
    one a pipeline can follow: it never sees the whole batch's routing at once)."""
    losses = {}
    if "router" in aux:
      stats = per_microbatch(aux["router"])
      if self.cfg.router_aux_loss_coef:
        losses["router_aux_loss"] = (self.cfg.router_aux_loss_coef * jnp.mean(
            jax.vmap(flax_tp.load_balancing_loss)(stats)))
      if options.router_z_loss:
        losses["router_z_loss"] = options.router_z_loss * jnp.mean(
            jax.vmap(flax_tp.router_z_loss)(stats))
    return losses

  def aux_metrics(self, aux) -> dict:
    """What a step logs of ``aux`` (summed over the whole batch, per microbatch or not):
    with experts, the load-balancing and z losses (unweighted; the microbatches' mean),
    each expert's share of the routed choices summed over layers (1 / num_experts each
    when balanced), and the share of choices a capacity dropped (0 when dropless)."""
    if "router" not in aux:
      return {}
    stats, top_k = per_microbatch(aux["router"]), self.cfg.experts_per_token
    whole = jax.tree.map(lambda a: jnp.sum(a, axis=0), stats)
    return {"router_aux_loss": jnp.mean(jax.vmap(flax_tp.load_balancing_loss)(stats)),
            "router_z_loss": jnp.mean(jax.vmap(flax_tp.router_z_loss)(stats)),
            "expert_load": whole.counts / (whole.tokens * top_k),
            "expert_dropped": whole.dropped / (whole.tokens * top_k)}

  def pipelined_loss(self, tokens_bs, per_token_loss, batched=(), *, count,
                     dropout_key=None):
    """Inside the step's map, a model whose stages run the 1F1B schedule
    (``Execution(pipeline_schedule="1f1b")``): the loss of this device's rows, each
    microbatch's taken as soon as it leaves the last stage
    (``flax_tp.pipeline.pipeline_1f1b_loss``).

    ``per_token_loss(logits, *rows) -> [b / M, s]``: each token's loss from its logits
    (this device's vocabulary shard, ``[b / M, s, vocab_pad]``, as ``__call__`` gives
    them, made ``execution.loss_chunks`` pieces at a time) and its rows of ``batched``
    (arrays ``[b, ...]``: the labels); a microbatch's share is their sum over ``count``.
    Returns the sum of the shares over microbatches (a scalar, the same on every stage),
    which ``jax.grad`` differentiates as it would the same loss of ``__call__``'s
    logits."""
    if self.pipeline is None or self.pipeline.schedule != "1f1b":
      raise ValueError(f"pipelined_loss is for a model pipelined with the 1f1b schedule; "
                       f"this one's is {None if self.pipeline is None else self.pipeline}")
    cfg = self.cfg
    rows = (global_rows(tokens_bs.shape[0]) if is_varying(tokens_bs, flax_tp.DATA_AXIS)
            else jnp.arange(tokens_bs.shape[0]))
    layout = self.activation_layout(tokens_bs.shape[1])
    x = ops.scale_embeddings(cfg, self.embed(layout.tokens(tokens_bs)))
    x = layout.zero_padding(x)
    x = _dropout(x, ops.site_key(dropout_key, 0, ops.EMBED), cfg.dropout, rows, layout)
    tail = _Tail(self.ln_f, self.embed if cfg.tie_embeddings else self.head)

    def tail_loss(tail, x, *rows):
      x = tail.ln_f(x)
      x = flax_tp.copy_to_parallel(x) if layout.sequence is None else layout.gather(x)
      return flax_tp.chunked_token_loss(x, lambda x: _logits(tail.head, x, cfg),
                                        per_token_loss, rows,
                                        chunks=self.execution.loss_chunks) / count

    return flax_tp.pipeline.pipeline_1f1b_loss(
        self.blocks, tail, x,
        lambda block, x, layer, rows, *_: block(x, dropout_key, layer, rows, layout),
        lambda tail, x, rows, *batched_rows: tail_loss(tail, x, *batched_rows),
        (rows, *batched), plan=self.pipeline, microbatches=self.execution.microbatches,
        remat=self.execution.remat)

  def activation_layout(self, seq_len: int) -> ActivationLayout:
    """Inside the step's map: how a sequence of ``seq_len`` tokens is split (over
    "context" whenever that axis has more than one device; over "model" between
    blocks under sequence parallelism). Its ``context`` says which positions this
    device's logits are for (``ContextSplit.local`` of the labels lines them up)."""
    return ActivationLayout.here(seq_len, sequence_parallel=self.execution.sequence_parallel,
                                 model_size=self.mesh.shape[flax_tp.MODEL_AXIS],
                                 context_parallel=self.execution.context_parallel)

  def _runs(self):
    """``(module, first layer, layers)`` per run of blocks: all the blocks (an
    ``nnx.List``) unscanned; scanned, each stacked run (``flax_tp.layer_runs``: one,
    or one per run of dense or MoE blocks); pipelined, the one stacked module."""
    if self.pipeline is not None:
      return [(self.blocks, 0, self.cfg.num_layers)]
    if not self.execution.scan_layers:
      return [(self.blocks, 0, self.cfg.num_layers)]
    return flax_tp.layer_runs(self.blocks)

  def _blocks(self, x, key, rows, layout):
    """The blocks in order (``flax_tp.remat.run_blocks``): a Python loop, or one
    ``lax.scan`` per stacked run of blocks; each recomputed in backward under ``remat``.
    Returns ``(x, the MoE layers' RouterStats summed, or None, their counts [MoE layers,
    E] in layer order, or None)``."""
    execution = self.execution
    moe = self.cfg.has_experts
    stats, loads = None, []
    for blocks, first, count in self._runs():
      def call(block, x, layer, key, rows, first=first):
        out = block(x, key, layer + first, rows, layout)
        return out if not moe or block.is_moe else (out, None)

      if self.pipeline is not None:  # microbatches through the stages (flax_tp.pipeline)
        out = flax_tp.run_pipeline(
            blocks, x, lambda block, x, layer, rows: call(block, x, layer, key, rows),
            (rows,), plan=self.pipeline, microbatches=execution.microbatches,
            remat=execution.remat, with_aux=moe)
      else:
        out = run_blocks(blocks, x, call, key, rows, num_layers=count,
                         scanned=execution.scan_layers, remat=execution.remat, with_aux=moe)
      if not moe:
        x = out
        continue
      x, run_stats = out
      if run_stats is not None:  # (stacked: [MoE layers of the run, ...]; pipelined:
        # [microbatches, MoE layers of the run, ...], each microbatch's kept apart)
        layer_axis = 0 if self.pipeline is None else 1
        loads.append(run_stats.counts if self.pipeline is None else run_stats.counts.sum(0))
        run_stats = jax.tree.map(functools.partial(jnp.sum, axis=layer_axis), run_stats)
        stats = run_stats if stats is None else stats + run_stats
    return x, stats, (jnp.concatenate(loads) if loads else None)

  def _each_block(self):
    """The blocks one by one (a stacked model's as views of one layer's params)."""
    if self.pipeline is not None:
      raise ValueError("the KV-cached decoder runs layers one by one, and this model's "
                       "are split into pipeline stages: decode models.execution."
                       "unpipeline(model) (the same params, replicated over 'stage')")
    if not self.execution.scan_layers:
      yield from self.blocks
      return
    for blocks, _, count in self._runs():
      graphdef, stacked = nnx.split(blocks)
      for layer in range(count):
        yield nnx.merge(graphdef, jax.tree.map(lambda p, i=layer: p[i], stacked))

  def kv_cache_heads(self) -> int:
    """kv heads each device's cache holds (its stored, padded kv heads)."""
    first = self._runs()[0][0]
    first = first[0] if isinstance(first, nnx.List) else first
    return first.attn.cache_heads()

  def extend(self, tokens_bs, cache, positions_bs, last_b):
    """Inside ``shard_map``: new tokens through the model with a KV cache.

    tokens_bs: ``[b, s]`` at ``positions_bs [b, s]`` (consecutive per row);
    cache: one ``(k, v)`` per block, each ``[b, L, hkv_pad, head_dim]`` on this device;
    last_b: ``[b]`` which of the ``s`` tokens' logits to return.
    returns this device's vocabulary shard of those logits ``[b, vocab_pad]`` and
    the updated cache. Per block the communication is Megatron's two all-reduces.
    """
    x = ops.scale_embeddings(self.cfg, self.embed(tokens_bs))
    new_cache = []
    for layer, (block, layer_cache) in enumerate(zip(self._each_block(), cache, strict=True)):
      x, layer_cache = block.extend(x, layer_cache, positions_bs, layer)
      new_cache.append(layer_cache)
    # The final norm and the head only for the position whose logits are wanted.
    x = jnp.take_along_axis(x, last_b[:, None, None], axis=1)[:, 0]  # [b, d]
    x = flax_tp.copy_to_parallel(self.ln_f(x))
    logits = self.embed.attend(x) if self.cfg.tie_embeddings else self.head(x)
    return ops.softcap_of(logits, self.cfg.final_softcap), tuple(new_cache)

  def prefill(self, tokens_bs, cache_len, last_b):
    """Inside ``shard_map`` on a mesh with a context axis: a prompt through the model
    split over ``"context"`` as training splits it (each device its two chunks), filling
    a cache that every context device then holds whole.

    tokens_bs: ``[b, s]`` (the same on every context device) at positions ``0 .. s-1``;
    last_b: ``[b]`` which position's logits to return. Returns this device's vocabulary
    shard of those logits ``[b, vocab_pad]`` and one ``(k, v)`` per block, each ``[b,
    cache_len, hkv_pad, head_dim]``: positions ``0 .. s-1`` filled, as ``extend``
    leaves them. The cache is gathered rather than kept split because a decode step
    is one token: split, every step would gather or ring the cache over context for
    one query; whole, it reads it in place, at ``C`` times a split cache's memory
    (``kv_cache_bytes``). The prefill's work and activations are split ``C`` ways;
    each block all-gathers its k and v over "context" once (which the all-gather
    strategy's attention shares).
    """
    cfg = self.cfg
    b, s = tokens_bs.shape
    layout = self.activation_layout(s)
    context = layout.context
    if context is None or layout.sequence is not None:
      raise ValueError("Transformer.prefill is for a context mesh without sequence "
                       "parallelism (a decoder's view); use extend")
    x = ops.scale_embeddings(cfg, self.embed(layout.tokens(tokens_bs)))
    cache = []
    for layer, block in enumerate(self._each_block()):
      x, own_kv = block.prefill(x, layer, layout)
      # Every context device's slots, in position order (padding slots left out).
      whole = [context.whole(t).astype(cfg.compute_dtype) for t in own_kv]
      cache.append(tuple(jnp.zeros((b, cache_len) + t.shape[2:], t.dtype).at[:, :s].set(t)
                         for t in whole))
    # The wanted position's hidden state sits on one context device: the others add 0.
    wanted = context.positions()[None, :] == last_b[:, None]  # [b, local_len]
    x = jnp.sum(jnp.where(wanted[..., None], x, jnp.zeros((), x.dtype)), axis=1)
    x = flax_tp.all_reduce(x, "sum", flax_tp.CONTEXT_AXIS)
    x = flax_tp.copy_to_parallel(self.ln_f(x))
    logits = self.embed.attend(x) if cfg.tie_embeddings else self.head(x)
    return ops.softcap_of(logits, cfg.final_softcap), tuple(cache)

  def _standalone(self, tokens_bs, dropout_key):
    graphdef, state = nnx.split(self)
    # A batch the data axis divides is split over it; any other (one prompt on the
    # training mesh) runs whole on every data shard, as the layers run such a batch.
    # (With FSDP, such a call first gathers the params whole over "data": a shard's
    # share of one batch row cannot be computed from a shard's share of the params.)
    split = tokens_bs.shape[0] % self.mesh.shape[flax_tp.DATA_AXIS] == 0
    if not split:
      state = whole_over_data(state)
    return _standalone_logits(graphdef, self.mesh, self.vocab_layout, split, state,
                              tokens_bs, dropout_key)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _standalone_logits(graphdef, mesh: Mesh, vocab_layout: flax_tp.ShardLayout, split: bool,
                       state, tokens_bs, dropout_key):
  """A model called outside any map: logits ``[b, s, vocab]`` (split over the vocabulary),
  the batch split over "data" when ``split``, else replicated over it.

  One compiled program per model graph and mesh (eagerly, ``shard_map`` would run the
  model op by op: 30 s for the tiny preset); inside a caller's ``jit`` it is inlined.
  The step's gathering: FSDP params are gathered over "data" as the step gathers them
  (the blocks' inside each block); without FSDP nothing changes.
  """
  rows = flax_tp.DATA_AXIS if split else None

  def logits_of(state, tokens, key):
    logits = nnx.merge(graphdef, gather_for_step(state, per_replica=split))(
        tokens, dropout_key=key)
    context = ContextSplit.here(tokens.shape[1])
    # Context parallel: each device's logits are its slots'; all of them, in order.
    return logits if context is None else context.whole(logits)

  logits = jax.shard_map(
      logits_of, mesh=mesh,
      in_specs=(nnx.get_partition_spec(state), P(rows), P()),
      out_specs=P(rows, None, flax_tp.MODEL_AXIS),
  )(state, tokens_bs, dropout_key)
  return vocab_layout.unpad(logits, -1)
