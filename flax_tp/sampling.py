"""Picking the next token from logits split over the vocabulary, never gathering them.

The head of a tensor-parallel model leaves each device ``[..., vocab_pad]``
logits, its shard of the vocabulary. Gathering ``[batch, vocab]`` per decoded
token would be the largest message of a decode step; instead every choice here
is made from ``[batch]``-sized reductions:

- greedy: each device's best (value, logical id), then a max and a min
  all-reduce (ties go to the lowest id, as ``argmax`` does);
- sampling: the Gumbel-max trick, ``argmax(logits / T + g)`` with ``g`` standard
  Gumbel noise drawn per *logical* vocabulary id from one key per row, which
  samples ``softmax(logits / T)`` exactly. The noise does not depend on how the
  vocabulary is split, so a seed gives the same tokens on every mesh;
- top-k / top-p (HF's order: temperature, then top-k, then top-p): the cut-off
  is found by bisection on the float's bits, one ``[batch]`` all-reduce per
  step (32 steps): counts for top-k (integers, so exact on every mesh), sums of
  probabilities for top-p.

Padded vocabulary columns never win.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_tp.collectives import all_reduce, axis_is_bound, shard_index
from flax_tp.mesh import MODEL_AXIS
from flax_tp.partition import ShardLayout

_BISECTION_STEPS = 32  # the bits of a float32


def vocab_parallel_sample(
    local_logits: jax.Array,
    *,
    vocab_size: int,
    keys: jax.Array | None = None,
    temperature: float | jax.Array = 0.0,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array | None = None,
    axis_name: str = MODEL_AXIS,
) -> jax.Array:
  """The next token ids ``[...]`` (int32, replicated over ``axis_name``).

  local_logits: ``[..., vocab_pad]``, this device's padded vocabulary shard (the
    head's output inside ``shard_map``); outside ``shard_map`` the full
    ``[..., vocab_size]`` logits and the same computation on one device.
  keys: typed PRNG keys of shape ``[...]``, one per row (e.g. folded from the
    row's global index), used when sampling.
  temperature: 0 (a Python number) is greedy and ignores ``keys``, ``top_k`` and
    ``top_p``; otherwise a positive number (may be traced).
  top_k: keep the ``top_k`` largest logits (all tied with the k-th too, as HF
    does); None is off. May be traced; values past the vocabulary keep all.
  top_p: keep the smallest set of most likely tokens whose probability reaches
    ``top_p`` (after top-k); None is off. May be traced, in ``(0, 1]``.
  """
  sharded = axis_is_bound(axis_name)
  parts = jax.lax.axis_size(axis_name) if sharded else 1
  layout = ShardLayout(vocab_size, parts)
  if local_logits.shape[-1] != layout.padded_size:
    raise ValueError(
        f"local_logits has {local_logits.shape[-1]} vocabulary columns, expected "
        f"{layout.padded_size} (vocab_size={vocab_size} over {parts} devices, padded)")
  index = shard_index(axis_name) if sharded else 0

  def reduce(x, op):
    return all_reduce(x, op, axis_name) if sharded else x

  valid = layout.local_mask(index)
  logits = jnp.where(valid, local_logits.astype(jnp.float32), -jnp.inf)
  first_id = jnp.asarray(layout.offsets)[index]
  greedy = isinstance(temperature, (int, float)) and temperature == 0
  if not greedy:
    if keys is None:
      raise ValueError("sampling (temperature > 0) needs keys, one per row")
    logits = logits / temperature
    if top_k is not None:
      logits = _keep_top_k(logits, valid, top_k, reduce)
    if top_p is not None:
      logits = _keep_top_p(logits, top_p, reduce)
    logits = logits + _local_gumbel(keys, layout, index)
  return _argmax(logits, first_id, vocab_size, reduce)


def _argmax(logits, first_id, vocab_size, reduce) -> jax.Array:
  """Global argmax of vocab-sharded ``[..., vocab_pad]`` (lowest id among ties)."""
  local_best = jnp.max(logits, axis=-1)
  local_id = first_id + jnp.argmax(logits, axis=-1).astype(jnp.int32)
  best = reduce(local_best, "max")
  candidate = jnp.where(local_best == best, local_id, jnp.int32(vocab_size))
  return reduce(candidate, "min")


def _local_gumbel(keys, layout: ShardLayout, index) -> jax.Array:
  """``[..., vocab_pad]``: this device's slice of Gumbel noise drawn per logical id."""
  flat = keys.reshape(-1)
  noise = jax.vmap(lambda k: jax.random.gumbel(k, (layout.size,), jnp.float32))(flat)
  noise = layout.pad(noise, -1)
  local = jax.lax.dynamic_slice_in_dim(noise, index * layout.padded_size, layout.padded_size,
                                       axis=-1)
  return local.reshape(keys.shape + (layout.padded_size,))


def _ordered_bits(x: jax.Array) -> jax.Array:
  """uint32 keys that order like the float32 values (``-inf`` lowest)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _bisect(ok, lo, hi, *, largest: bool):
  """Per row, the largest (or smallest) uint32 ``t`` in ``[lo, hi]`` with ``ok(t)``,
  for ``ok`` monotone (true up to / from that point); ``ok(lo)`` (``ok(hi)``) must hold."""
  def step(_, bounds):
    lo, hi = bounds
    open_ = lo < hi
    if largest:
      mid = lo + ((hi - lo) >> 1) + open_.astype(jnp.uint32)
      good = ok(mid)
      return jnp.where(open_ & good, mid, lo), jnp.where(open_ & ~good, mid - 1, hi)
    mid = lo + ((hi - lo) >> 1)
    good = ok(mid)
    return jnp.where(open_ & ~good, mid + 1, lo), jnp.where(open_ & good, mid, hi)
  lo, hi = jax.lax.fori_loop(0, _BISECTION_STEPS, step, (lo, hi))
  return lo if largest else hi


def _search_range(logits, reduce) -> tuple[jax.Array, jax.Array]:
  """``[...]`` uint32 bounds of every cut-off: 0 and the bits of the row's largest logit.

  Derived from the logits (not made from a shape) so that, inside ``shard_map``,
  the bounds vary over the same axes as the values the search compares them with.
  """
  best = _ordered_bits(reduce(jnp.max(logits, axis=-1), "max"))
  return best & jnp.uint32(0), best


def _keep_top_k(logits, valid, top_k, reduce) -> jax.Array:
  """-inf outside each row's ``top_k`` largest (ties with the k-th kept)."""
  bits = _ordered_bits(logits)
  k = jnp.asarray(top_k, jnp.int32)

  def at_least_k(t):  # at least k valid logits >= t (an exact integer on any mesh)
    count = jnp.sum((valid & (bits >= t[..., None])).astype(jnp.int32), axis=-1)
    return reduce(count, "sum") >= k

  lo, hi = _search_range(logits, reduce)
  threshold = _bisect(at_least_k, lo, hi, largest=True)
  return jnp.where(bits >= threshold[..., None], logits, -jnp.inf)


def _keep_top_p(logits, top_p, reduce) -> jax.Array:
  """-inf outside each row's nucleus: token ``v`` stays when the probability of the
  tokens more likely than it is below ``top_p`` (HF's ``TopPLogitsWarper``)."""
  bits = _ordered_bits(logits)
  shift = reduce(jnp.max(logits, axis=-1), "max")
  weights = jnp.exp(logits - shift[..., None])  # 0 where -inf
  target = jnp.asarray(top_p, jnp.float32) * reduce(jnp.sum(weights, axis=-1), "sum")

  def above_is_short(t):  # mass of the tokens above t is below top_p
    above = jnp.sum(jnp.where(bits > t[..., None], weights, 0.0), axis=-1)
    return reduce(above, "sum") < target

  lo, hi = _search_range(logits, reduce)
  threshold = _bisect(above_is_short, lo, hi, largest=False)
  return jnp.where(bits >= threshold[..., None], logits, -jnp.inf)
