"""Ring attention: context parallelism's second strategy (``Execution(context_parallel="ring")``).

Each of the ``C`` context devices holds its two chunks of the sequence (``ContextSplit``):
``q [b, L, h, d]`` and its own ``k, v [b, L, g, d]`` (``L = 2 * chunk``). Instead of
all-gathering every device's k and v, the k/v blocks travel around the ring of context
devices with ``ppermute`` (device ``i`` sends to ``i + 1``): at step ``j`` device ``i``
holds device ``(i - j) mod C``'s block and folds it into an online softmax kept in
float32 (running max ``m``, denominator and unnormalised output ``o``, merged exactly as
the log-sum-exp of the whole row), so no device ever holds more than two blocks.

Work is done per pair of chunks (a query chunk and a key chunk): a pair wholly masked
by causality, or by a sliding window, is skipped (``lax.cond`` on this device's
positions). Under head-tail balancing every off-diagonal block has exactly two of its
four pairs masked, so each device does the same half of the work.

The backward is a second ring (``jax.custom_vjp``): the forward saves only this device's
``q, k, v``, the output and the rows' log-sum-exp; the backward passes each k/v block
around again, the other way round, together with the accumulators of its gradient,
which arrive back at their owner after ``C`` steps (FlashAttention-2's backward per block). Memory stays
that of two blocks, not the ``C`` blocks autodiff of the forward would keep.

Attention sinks (GPT-OSS: a learned logit per head in each row's denominator, taking no
value) join at the end: the keys' log-sum-exp ``lse`` becomes ``logaddexp(lse, sink)`` and
the output is scaled by ``exp(lse_keys - lse)``. The backward ring reads the joint ``lse``
(so its probabilities are the sink-inclusive softmax's), and the sink's gradient is
``-sum_rows exp(sink - lse) * (dO . O)``: its column's value is zero.

Dropout (on the probabilities) reads the whole sequence's keep-mask at the pair's
positions, as the all-gather path does, so the result does not depend on the split.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flax_tp.collectives import shard_index
from flax_tp.context import ContextSplit
from flax_tp.mesh import CONTEXT_AXIS

_NEG = float(np.finfo(np.float32).min)


@dataclasses.dataclass(frozen=True)
class RingSpec:
  """What the ring needs to know statically: the split, the scores' scale and
  soft-cap, and whether a window, dropout and sinks apply."""

  split: ContextSplit
  scale: float
  softcap: float | None = None
  windowed: bool = False
  rate: float = 0.0  # dropout on the probabilities (0: none)
  sinks: bool = False  # a sink logit per head in each row's denominator


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_index: jax.Array, *,
                   split: ContextSplit, scale: float | None = None,
                   softcap: float | None = None, window: int | jax.Array | None = None,
                   keep_rows: jax.Array | None = None, rate: float = 0.0,
                   sinks: jax.Array | None = None) -> jax.Array:
  """Causal attention of this device's queries over every context device's keys.

  q: ``[b, L, h, d]``, this device's slots (``split.positions()``); k, v: ``[b, L, g, d]``
  its own keys and values; kv_index: ``[h]`` int, the local kv head each local query
  head reads (grouped-query attention). window: a sliding window (``visible_keys``),
  possibly traced. keep_rows: dropout on the probabilities at ``rate``, the whole
  sequence's keep-mask ``[b, h, L, S]`` (bool) read at this device's query slots (the
  mask one device draws for the logical sequence), or None. sinks: ``[h]``, each local
  query head's sink logit (None: none).
  returns ``[b, L, h, d]`` in q's dtype. Inside a ``shard_map`` over ``"context"``.
  """
  scale = float(q.shape[-1] ** -0.5) if scale is None else float(scale)
  dropped = keep_rows is not None and rate > 0.0
  spec = RingSpec(split, scale, softcap, window is not None, rate if dropped else 0.0,
                  sinks is not None)
  window = jnp.asarray(0 if window is None else window, jnp.int32)
  keep_rows = keep_rows if dropped else jnp.zeros((1, 1, 1, 1), bool)  # never read
  # Typed as varying like q (over data and context): the gradient the backward ring
  # gives is each device's rows', and this cast's transpose sums it over them.
  sinks = _varying_like(jnp.zeros((q.shape[2],), jnp.float32) if sinks is None
                        else sinks.astype(jnp.float32), q)
  return _ring(spec, q, k, v, kv_index, window, keep_rows, sinks)


# -- the pieces of both rings ----------------------------------------------------------


def _varying_like(x, *templates):
  """``x`` typed as varying over every mesh axis any of ``templates`` varies over (so
  the accumulators and both branches of a skipped pair agree under ``check_vma``)."""
  axes = set()
  for t in templates:
    axes |= set(jax.typeof(t).manual_axis_type.varying)
  missing = tuple(sorted(axes - set(jax.typeof(x).manual_axis_type.varying)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _shift(x, direction=1):
  """One step around the ring: device ``i``'s ``x`` to device ``i + direction``."""
  parts = jax.lax.axis_size(CONTEXT_AXIS)
  return jax.lax.ppermute(x, CONTEXT_AXIS,
                          [(i, (i + direction) % parts) for i in range(parts)])


def _visible(spec, qpos, kpos, window):
  """``[cq, ck]``: which keys each query sees (causal, and the window)."""
  seen = kpos[None, :] <= qpos[:, None]
  if spec.windowed:
    seen = seen & (kpos[None, :] > qpos[:, None] - window)
  return seen


def _keep_pair(spec, keep_rows, qs, kpos):
  """``[b, h, cq, ck]`` keep factor (``keep / (1 - rate)``) of the pair of query slots
  ``qs`` and keys at ``kpos``, or None."""
  if spec.rate == 0.0:
    return None
  keep = jnp.take(keep_rows[:, :, qs], jnp.minimum(kpos, spec.split.seq_len - 1), axis=3)
  return jnp.where(keep, 1.0 / (1.0 - spec.rate), 0.0).astype(jnp.float32)


def _scores(spec, qc, kc):
  """``([b, h, cq, ck]`` capped scores, raw scores) in float32."""
  raw = jnp.einsum("bqhd,bthd->bhqt", qc, kc, preferred_element_type=jnp.float32) * spec.scale
  return (raw if spec.softcap is None else jnp.tanh(raw / spec.softcap) * spec.softcap), raw


def _pairs(spec):
  """The (query chunk, key chunk) pairs of a block: slices of the ``L`` slots."""
  c = spec.split.chunk
  return [(slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c))
          for a in range(2) for b in range(2)]


def _block_positions(spec, step, direction=1):
  """This device's query positions and the positions of the block it holds at ``step``
  of a ring turning ``direction`` (device ``i - direction * step``'s block)."""
  order = jnp.asarray(spec.split.order, jnp.int32)
  me = shard_index(CONTEXT_AXIS)
  return order[me], order[(me - direction * step) % spec.split.parts]


# -- forward ring ---------------------------------------------------------------------


def _forward(spec, q, k, v, kv_index, window, keep_rows, sinks):
  """(out ``[b, L, h, d]`` q.dtype, lse ``[b, h, L]`` float32, the sinks' included)."""
  b, length, h, d = q.shape
  parts = spec.split.parts
  qpos, _ = _block_positions(spec, 0)
  like = (q, k, v, kv_index, window, keep_rows)
  m = _varying_like(jnp.full((b, h, length), _NEG, jnp.float32), *like)
  denom = _varying_like(jnp.zeros((b, h, length), jnp.float32), *like)
  o = _varying_like(jnp.zeros((b, length, h, d), jnp.float32), *like)
  kv = jnp.stack([k, v])
  for step in range(parts):
    _, kpos = _block_positions(spec, step)
    for qs, ks in _pairs(spec):
      seen = _visible(spec, qpos[qs], kpos[ks], window)

      def fold(carry, kv_pair=kv[:, :, ks], qs=qs, ks=ks, kpos=kpos, seen=seen):
        m, denom, o = carry
        kc, vc = (jnp.take(t, kv_index, axis=2) for t in kv_pair)
        s, _ = _scores(spec, q[:, qs], kc)
        s = jnp.where(seen, s, _NEG)
        m_old = m[:, :, qs]
        m_new = jnp.maximum(m_old, s.max(-1))
        p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
        fix = jnp.exp(m_old - m_new)
        keep = _keep_pair(spec, keep_rows, qs, kpos[ks])
        pv = p if keep is None else p * keep
        o_new = (o[:, qs] * jnp.swapaxes(fix, 1, 2)[..., None]
                 + jnp.einsum("bhqt,bthd->bqhd", pv, vc.astype(jnp.float32)))
        return (m.at[:, :, qs].set(m_new),
                denom.at[:, :, qs].set(denom[:, :, qs] * fix + p.sum(-1)),
                o.at[:, qs].set(o_new))

      m, denom, o = jax.lax.cond(seen.any(), fold, lambda carry: carry, (m, denom, o))
    if step < parts - 1:
      kv = _shift(kv)
  safe = jnp.where(denom > 0, denom, 1.0)  # a row that sees nothing (padding): output 0
  out = o / jnp.swapaxes(safe, 1, 2)[..., None]
  lse = m + jnp.log(safe)
  if spec.sinks:  # the sink's column in the denominator: rescale by the keys' share
    joint = jnp.logaddexp(lse, sinks[None, :, None])
    out = out * jnp.swapaxes(jnp.exp(lse - joint), 1, 2)[..., None]
    lse = joint
  return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(spec, q, k, v, kv_index, window, keep_rows, sinks):
  return _forward(spec, q, k, v, kv_index, window, keep_rows, sinks)[0]


def _ring_fwd(spec, q, k, v, kv_index, window, keep_rows, sinks):
  out, lse = _forward(spec, q, k, v, kv_index, window, keep_rows, sinks)
  return out, (q, k, v, kv_index, window, keep_rows, sinks, out, lse)


# -- backward ring --------------------------------------------------------------------


def _ring_bwd(spec, saved, d_out):
  q, k, v, kv_index, window, keep_rows, sinks, out, lse = saved
  b, length, h, d = q.shape
  g = k.shape[2]
  parts = spec.split.parts
  qpos, _ = _block_positions(spec, 0)
  d_out = d_out.astype(jnp.float32)
  # D = rowsum(dP * P) = dO . O (dropout included: O already carries the keep factor)
  delta = jnp.swapaxes(jnp.sum(d_out * out.astype(jnp.float32), -1), 1, 2)  # [b, h, L]
  like = (q, k, v, kv_index, window, keep_rows, d_out)
  dq = _varying_like(jnp.zeros((b, length, h, d), jnp.float32), *like)
  dkv = _varying_like(jnp.zeros((2, b, length, g, d), jnp.float32), *like)
  # This ring turns the other way (device i to i - 1): its shifts are then not the
  # forward's, which XLA would otherwise merge with them (common subexpressions) and
  # so keep all C of the forward's blocks alive until the backward, the all-gather's
  # memory that the ring is there to avoid.
  kv = jnp.stack([k, v])
  for step in range(parts):
    _, kpos = _block_positions(spec, step, direction=-1)
    for qs, ks in _pairs(spec):
      seen = _visible(spec, qpos[qs], kpos[ks], window)

      def unfold(carry, kv_pair=kv[:, :, ks], qs=qs, ks=ks, kpos=kpos, seen=seen):
        dq, dkv = carry
        kc, vc = (jnp.take(t, kv_index, axis=2) for t in kv_pair)
        qc, doc = q[:, qs], d_out[:, qs]
        s, raw = _scores(spec, qc, kc)
        p = jnp.where(seen, jnp.exp(s - lse[:, :, qs, None]), 0.0)
        dp = jnp.einsum("bqhd,bthd->bhqt", doc, vc.astype(jnp.float32))
        keep = _keep_pair(spec, keep_rows, qs, kpos[ks])
        pv = p if keep is None else p * keep
        dp = dp if keep is None else dp * keep
        ds = p * (dp - delta[:, :, qs, None])
        if spec.softcap is not None:  # d(cap * tanh(x / cap)) = 1 - tanh^2
          ds = ds * (1.0 - jnp.square(jnp.tanh(raw / spec.softcap)))
        ds = ds * spec.scale
        dq_c = jnp.einsum("bhqt,bthd->bqhd", ds, kc.astype(jnp.float32))
        dk_h = jnp.einsum("bhqt,bqhd->bthd", ds, qc.astype(jnp.float32))
        dv_h = jnp.einsum("bhqt,bqhd->bthd", pv, doc)
        # query heads sharing a kv head add into it
        dk_g = jnp.zeros(dk_h.shape[:2] + (g, d), jnp.float32).at[:, :, kv_index].add(dk_h)
        dv_g = jnp.zeros(dv_h.shape[:2] + (g, d), jnp.float32).at[:, :, kv_index].add(dv_h)
        return (dq.at[:, qs].add(dq_c),
                dkv.at[:, :, ks].add(jnp.stack([dk_g, dv_g])))

      dq, dkv = jax.lax.cond(seen.any(), unfold, lambda carry: carry, (dq, dkv))
    if step < parts - 1:
      kv = _shift(kv, -1)
    dkv = _shift(dkv, -1)  # the gradient travels with its block; after C steps it is home
  # the sink's column: probability exp(sink - lse), value zero, so dS = -P * delta
  d_sinks = (-jnp.sum(jnp.exp(sinks[None, :, None] - lse) * delta, axis=(0, 2))
             if spec.sinks else jnp.zeros_like(sinks))
  return (dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype),
          None, None, None, d_sinks)


_ring.defvjp(_ring_fwd, _ring_bwd)
