"""Attention's one home: what a layer's attention computes and the core that computes it.

``AttentionSpec.of(cfg, layer)`` says what one layer's attention is (its sliding window,
the scores' scale and soft-cap, dropout on the probabilities); ``attend(q, k, v, spec,
q_positions, k_positions)`` computes it. Training and prefill (``models/transformer.py``),
cached decoding (the same call over the cache's slots) and the plain-Flax reference
(``models/reference.py``) all call ``attend``; context parallelism does not change a call
site, it swaps the core (``core_of``): the keys given are every key (``local``), every
context device's keys are all-gathered first (``all_gather``), or their blocks travel the
ring (``ring``, ``flax_tp.ring_attention``). Where the sequence is not split, the kernel
is chosen per model (``splash.choose_kernel``, ``Execution.attention``): XLA's einsums
(``local``) or jax's Pallas splash attention kernel (``Splash``: the ``[b, h, s, s]``
scores never reach HBM), which runs on a TPU and, in Pallas interpret mode, anywhere.

Positions: ``None`` for both means ``0 .. s-1`` for queries and keys alike (one device's
causal attention over its whole sequence); otherwise the mask is ``visible_keys`` of the
queries' and keys' global positions (a context shard's slots, a KV cache's). Softmax runs
in float32 whatever the inputs' dtype. Nothing here knows about the mesh except the
context cores, which run inside the step's ``shard_map``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flax_tp.context import ContextSplit
from flax_tp.remat import ATTENTION_OUT
from flax_tp.ring_attention import ring_attention
from models import layer_kinds, ops, splash
from models.config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """What one layer's attention computes, whichever core runs it.

  window: the sliding window (``visible_keys``: each query sees its last ``window``
    keys), None for full attention; a traced int under scanned layers (``layer_kinds``).
  scale: the scores' scale, None for ``head_dim ** -0.5``.
  softcap: scores -> ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
  dropout: the rate of dropout on the probabilities (applied only with a ``Dropout``).
  sinks: per query head ``[h]`` (the heads q holds), a learned logit in each row's
    softmax denominator that takes no value (GPT-OSS's attention sinks: a row may give
    less than all its weight to the keys); None for none. Set by the attention module
    from its params (``with_sinks``).
  """

  window: int | jax.Array | None = None
  scale: float | None = None
  softcap: float | None = None
  dropout: float = 0.0
  sinks: jax.Array | None = None
  # The sliding window a traced ``window`` is when it is not ``layer_kinds.UNBOUNDED``
  # (a scanned model mixing sliding and full layers), for a kernel whose mask is static.
  sliding: int | None = None

  @classmethod
  def of(cls, cfg: TransformerConfig, layer) -> AttentionSpec:
    """Block ``layer``'s attention (a Python int, or traced inside scanned layers)."""
    scale = cfg.attn_scale
    if scale is None and cfg.attn_dim != cfg.head_dim:  # heads padded to the value width
      scale = cfg.head_dim ** -0.5
    window = layer_kinds.window_of(cfg, layer)
    sliding = cfg.sliding_window if isinstance(window, jax.Array) else None
    return cls(window, scale, cfg.attn_softcap, cfg.dropout, sliding=sliding)

  def with_sinks(self, sinks: jax.Array | None) -> AttentionSpec:
    """This spec with the heads' sink logits ``sinks [h]`` (None: unchanged)."""
    return self if sinks is None else dataclasses.replace(self, sinks=sinks)


@dataclasses.dataclass(frozen=True)
class Dropout:
  """Where the keep-mask of attention's dropout is drawn: ``key`` (this layer's site),
  the local rows' global batch ids ``rows [b]`` and the local heads' global ids ``heads
  [h]``. The mask is the whole ``seq_len``-token sequence's ``[b, h, S, S]`` as one
  device draws it, read at the queries' and keys' positions, so no split of the batch,
  the heads or the sequence changes which entries drop. seq_len None: the queries'
  own length (the sequence is not split)."""

  key: jax.Array
  rows: jax.Array
  heads: jax.Array
  seq_len: int | None = None

  def keep_rows(self, rate: float, q_positions: jax.Array) -> jax.Array:
    """``[b, h, q, S]`` bool: the mask's rows at ``q_positions [q]``."""
    return ops.keep_rows(self.key, rate, self.rows, self.heads, q_positions, self.seq_len)

  def keep_at(self, rate: float, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """``[b, h, q, t]`` bool: the mask at ``q_positions [q]`` x ``k_positions [t]``;
    padding (``>= seq_len``) reads a real entry (clipped) that its zero weight (a key)
    or zero loss (a query) leaves unused."""
    keep = self.keep_rows(rate, q_positions)
    return jnp.take(keep, jnp.minimum(k_positions, self.seq_len - 1), axis=3)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, spec: AttentionSpec,
           q_positions: jax.Array | None = None, k_positions: jax.Array | None = None, *,
           kv_index: jax.Array | None = None, dropout: Dropout | None = None,
           core=None) -> jax.Array:
  """Causal softmax attention of ``q [b, s, h, d]`` over ``k, v [b, t, g, d]`` -> ``[b, s,
  h, d]`` in q's dtype.

  q_positions ``[s]`` (or ``[b, s]``, each row its own: a cached step) and k_positions
  ``[t]``: the global positions of the queries and keys, both None for ``0 .. s-1``.
  kv_index ``[h]``: the kv head each query head reads; None for grouped-query
  attention's ``i // (h / g)`` (``g`` divides ``h``; the kv heads are not copied).
  dropout: where the keep-mask is drawn (``Dropout``), None for none.
  core: how the keys are reached, ``core_of(context)``; None for ``local``.

  The output is named ``ATTENTION_OUT`` for a recomputing block to keep (``remat``'s
  "save_attention"); splash's kernel names its own residuals instead (its output among
  them, laid out as the kernel keeps it), so that the block keeps it once.
  """
  out = (core or local)(q, k, v, spec, q_positions, k_positions, kv_index, dropout)
  return out if isinstance(core, Splash) else checkpoint_name(out, ATTENTION_OUT)


def core_of(context: ContextSplit | None, kernel: str = "xla"):
  """The core that attends over a sequence split as ``context`` says: when it is not
  split (the keys given are every key) ``kernel``'s, ``local`` ("xla") or ``Splash``
  ("splash"); else its strategy's (``all_gather`` or ``ring``), whose queries and keys
  are this context device's slots (XLA's; ``splash.choose_kernel`` refuses splash there)."""
  if kernel not in ("xla", "splash"):
    raise ValueError(f"attention kernel must be 'xla' or 'splash', got {kernel!r}")
  if context is None:
    return Splash(interpret=jax.default_backend() != "tpu") if kernel == "splash" else local
  if kernel == "splash":
    raise ValueError("the splash attention kernel does not run on a context-split sequence")
  return AllGather(context) if context.strategy == "all_gather" else Ring(context)


@dataclasses.dataclass(frozen=True)
class Splash:
  """The core of jax's Pallas splash attention kernel over every key (``local``'s
  arguments, the sequence not split): causal, a sliding window (static, or a traced one
  choosing between the model's two kinds), soft-capped scores, GPT-OSS's sinks; q scaled
  before the kernel. Grouped-query attention runs the kernel's shared-kv form per kv
  head; kv heads copied across groups (``kv_index``) run it per query head. The sequence
  is padded to the block (``splash.block_for``): a padded key is later than every query, so
  the causal mask hides it, and the padded queries are cut off. ``interpret``: Pallas
  interpret mode (any backend: the tests' CPU)."""

  interpret: bool = False

  def __call__(self, q, k, v, spec, q_positions, k_positions, kv_index, dropout):
    if q_positions is not None or k_positions is not None or dropout is not None:
      raise ValueError("the splash core attends one whole causal sequence without dropout")
    b, s, h, d = q.shape
    g = k.shape[2]
    scale = d ** -0.5 if spec.scale is None else spec.scale
    block = splash.block_for(s)
    seq = -(-s // block) * block
    pad = lambda t: jnp.pad(t, ((0, 0), (0, seq - s), (0, 0), (0, 0)))
    q, k, v = pad((q * scale).astype(q.dtype)), pad(k), pad(v)
    if kv_index is not None:  # each query head's own kv head
      k, v = jnp.take(k, kv_index, axis=2), jnp.take(v, kv_index, axis=2)
      g = h
    shared = g != h
    heads = h // g if shared else h
    sinks = None if spec.sinks is None else spec.sinks.astype(jnp.float32)
    q, k, v, sinks = splash.alike(q, k, v, sinks)

    def run(window):
      key = splash.KernelKey(seq, heads, window, spec.softcap, shared, self.interpret)
      if not shared:  # [b, h, S, d] over [b, h, S, d]
        return splash.attend(key, *(t.transpose(0, 2, 1, 3) for t in (q, k, v)), sinks)
      # [b, g, h/g, S, d] over [b, g, S, d]: the kernel's shared-kv form per kv head
      grouped = q.reshape(b, seq, g, heads, d).transpose(0, 2, 3, 1, 4)
      group_sinks = None if sinks is None else sinks.reshape(g, heads)
      out = splash.attend(key, grouped, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                          group_sinks)
      return out.reshape(b, h, seq, d)

    window = spec.window
    if isinstance(window, jax.Array):  # scanned layers of two kinds: the layer's kernel
      out = jax.lax.cond(window < layer_kinds.UNBOUNDED, lambda: run(spec.sliding),
                         lambda: run(None))
    else:
      out = run(window)
    return out.transpose(0, 2, 1, 3)[:, :s].astype(q.dtype)


def local(q, k, v, spec, q_positions, k_positions, kv_index, dropout):
  """The core over keys that are every key a query sees (``attend``'s arguments).

  Every case is the one explicit form (``_explicit``: scores in float32, a window or
  positions as its mask, soft-caps, sinks and dropout where asked). It is
  ``jax.nn.dot_product_attention``'s XLA implementation written out without the vmap over
  query groups, whose transposes made XLA:CPU's step 0-8% slower (BENCHMARKS.md §2); no
  fused kernel takes a sink, soft-cap or dropout on the probabilities anyway.
  """
  if kv_index is not None:  # each query head's own kv head (replicas straddling groups)
    k, v = jnp.take(k, kv_index, axis=2), jnp.take(v, kv_index, axis=2)
  rate = spec.dropout if dropout is not None else 0.0
  if q_positions is None:
    s = q.shape[1]
    pos = jnp.arange(s)
    mask = visible_keys(pos[:, None], pos[None, :], spec.window)  # [s, s]
    keep = None if rate == 0.0 else ops.keep_mask(dropout.key, rate, dropout.rows, (s, s),
                                                  dropout.heads)
    return _explicit(q, k, v, mask, spec, keep)
  mask = visible_keys(q_positions[..., :, None], k_positions[None, :], spec.window)
  mask = mask[None, None] if mask.ndim == 2 else mask[:, None]  # [b | 1, 1, s, t]
  keep = None if rate == 0.0 else dropout.keep_at(rate, q_positions, k_positions)
  return _explicit(q, k, v, mask, spec, keep)


@dataclasses.dataclass(frozen=True)
class AllGather:
  """Context parallelism's default core: this device's k and v (only the kv heads its
  model shard holds) all-gathered over ``"context"``, so its queries see every key;
  the backward reduce-scatters their cotangents. Positions are the split's."""

  split: ContextSplit

  def __call__(self, q, k, v, spec, q_positions, k_positions, kv_index, dropout):
    k, v = self.split.gather(k), self.split.gather(v)
    k_positions = jnp.asarray(self.split.gathered_positions, jnp.int32)
    return local(q, k, v, spec, self.split.positions(), k_positions, kv_index,
                 _over(dropout, self.split))


@dataclasses.dataclass(frozen=True)
class Ring:
  """Context parallelism's ring core (``flax_tp.ring_attention``): the k/v blocks
  travel around the context devices, two in memory whatever ``C``. Positions are the
  split's."""

  split: ContextSplit

  def __call__(self, q, k, v, spec, q_positions, k_positions, kv_index, dropout):
    if kv_index is None:
      kv_index = jnp.arange(q.shape[2]) // (q.shape[2] // k.shape[2])
    dropout = _over(dropout, self.split)
    rate = spec.dropout if dropout is not None else 0.0
    keep_rows = dropout.keep_rows(rate, self.split.positions()) if rate > 0.0 else None
    return ring_attention(q, k, v, kv_index, split=self.split, scale=spec.scale,
                          softcap=spec.softcap, window=spec.window, keep_rows=keep_rows,
                          rate=rate, sinks=spec.sinks)


def _over(dropout: Dropout | None, split: ContextSplit) -> Dropout | None:
  """``dropout`` drawn for the whole sequence the split holds."""
  return None if dropout is None else dataclasses.replace(dropout, seq_len=split.seq_len)


def visible_keys(query_pos: jax.Array, key_pos: jax.Array,
                 window: int | jax.Array | None) -> jax.Array:
  """Which keys each query sees: ``key_pos <= query_pos``, and with a sliding
  ``window`` only its last ``window`` ones (transformers' ``kv_idx > q_idx - window``).

  query_pos ``[..., q, 1]`` and key_pos ``[..., 1, t]`` broadcast to ``[..., q, t]``.
  """
  seen = key_pos <= query_pos
  if window is not None:
    seen = seen & (key_pos > query_pos - window)
  return seen


def _explicit(q, k, v, mask, spec, keep):
  """Softmax attention with the probabilities materialised: scores ``[b, h, s, t]`` in
  float32 (soft-capped), ``mask`` (broadcasting to them), dropout's ``keep`` mask or
  None. With ``spec.sinks`` each head's sink logit joins every row's softmax as one more
  column whose value is zero (transformers' GPT-OSS: the logits and the sink, less their
  max, through one softmax, the sink's column dropped)."""
  b, s, h, d = q.shape
  t, g = k.shape[1], k.shape[2]
  scale = 1.0 / jnp.sqrt(jnp.float32(d)) if spec.scale is None else spec.scale
  if g == h:
    # one query head per kv head: the plain form, whose transposes XLA:CPU folds into
    # the dots (the grouped form's size-1 group axis costs it a copy each way)
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k, preferred_element_type=jnp.float32) * scale
  else:
    # grouped-query attention without copying k and v per query head: query head i reads
    # kv head i // (h / g), so q's heads are split [g, h / g] and the scores joined back
    grouped = q.reshape(b, s, g, h // g, d)
    scores = jnp.einsum("bqgrk,btgk->bgrqt", grouped, k,
                        preferred_element_type=jnp.float32).reshape(b, h, s, t) * scale
  scores = jnp.where(mask, ops.softcap_of(scores, spec.softcap), jnp.finfo(jnp.float32).min)
  if spec.sinks is None:
    probs = jax.nn.softmax(scores, axis=-1)
  else:
    sink = spec.sinks.astype(jnp.float32)[None, :, None, None]  # [1, h, 1, 1]
    top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, -1, keepdims=True), sink))
    weights = jnp.exp(scores - top)
    probs = weights / (jnp.sum(weights, -1, keepdims=True) + jnp.exp(sink - top))
  if keep is not None:
    probs = ops.apply_keep(probs, keep, spec.dropout)
  if g == h:
    return jnp.einsum("bhqt,bthk->bqhk", probs.astype(v.dtype), v)
  probs = probs.astype(v.dtype).reshape(b, g, h // g, s, t)
  return jnp.einsum("bgrqt,btgk->bqgrk", probs, v).reshape(b, s, h, d)
