"""Pure array functions both models share: rotary positions, causal attention, dropout.

Nothing here knows about devices. Dropout masks are keyed by *logical* position
(global batch row, global head), never by device, so a mesh cannot change them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotary(x: jax.Array, base: float, positions: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding. x: ``[b, s, h, k]`` -> same shape and dtype.

  positions: ``[b, s]`` int position of each token (a KV-cached step's tokens
  start where the cache ends); None means ``0 .. s-1`` for every row.
  """
  s, k = x.shape[1], x.shape[-1]
  inv_freq = 1.0 / (base ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
  if positions is None:
    positions = jnp.arange(s)[None, :]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b | 1, s, k/2]
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def keep_mask(key: jax.Array, rate: float, rows: jax.Array, shape: tuple[int, ...],
              heads: jax.Array | None = None) -> jax.Array:
  """Bernoulli keep-mask ``[len(rows), (len(heads),) *shape]`` keyed by logical ids.

  rows: global batch-row ids of the local rows; heads: global head ids.
  """
  def row_mask(row):
    row_key = jax.random.fold_in(key, row)
    if heads is None:
      return jax.random.bernoulli(row_key, 1.0 - rate, shape)
    return jax.vmap(lambda h: jax.random.bernoulli(jax.random.fold_in(row_key, h),
                                                   1.0 - rate, shape))(heads)
  return jax.vmap(row_mask)(rows)


def dropout(x: jax.Array, key: jax.Array | None, rate: float, rows: jax.Array,
            heads: jax.Array | None = None) -> jax.Array:
  """Inverted dropout of ``x [b, (h,) ...]``; identity when ``key`` is None or rate 0."""
  if key is None or rate == 0.0:
    return x
  keep = keep_mask(key, rate, rows, x.shape[2 if heads is not None else 1:], heads)
  return apply_keep(x, keep, rate)


def apply_keep(x: jax.Array, keep: jax.Array, rate: float) -> jax.Array:
  """Inverted dropout of ``x`` with a keep-mask of its shape."""
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     dropout_key: jax.Array | None, rate: float, rows: jax.Array,
                     heads: jax.Array) -> jax.Array:
  """Softmax attention with a causal mask.

  q: ``[b, s, h, k]``; k, v: ``[b, s, g, k]`` with ``g`` dividing ``h`` (query head
  ``i`` reads kv head ``i // (h // g)``: grouped-query attention without copying
  the kv heads); rows/heads: logical ids for dropout.
  returns ``[b, s, h, k]``. Softmax runs in float32 whatever the input dtype.

  Without dropout this is ``jax.nn.dot_product_attention`` (XLA's implementation:
  the same formula, scores in float32). Dropout on the probabilities needs them
  materialised, which no fused kernel exposes, so it keeps the explicit form.
  """
  if dropout_key is None or rate == 0.0:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
  group = q.shape[2] // k.shape[2]
  if group > 1:
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
  scores = jnp.einsum("bqhk,bthk->bhqt", q, k, preferred_element_type=jnp.float32) * scale
  s = q.shape[1]
  causal = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = dropout(probs, dropout_key, rate, rows, heads).astype(v.dtype)
  return jnp.einsum("bhqt,bthk->bqhk", probs, v)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     positions: jax.Array) -> jax.Array:
  """Attention of new tokens over a KV cache, causal by position.

  q: ``[b, s, g, r, k]``, the new tokens' query heads in ``g`` groups of ``r``
    (query head ``(g, r)`` reads kv head ``g``; ``r = 1`` for one kv head per query head).
  k, v: ``[b, L, g, k]`` the cache, already holding the new tokens' keys/values.
  positions: ``[b, s]`` each new token's position; it sees cache slots ``<= position``
    (slots past it hold padding or stale values and are masked).
  returns ``[b, s, g, r, k]``. Softmax runs in float32, as in ``causal_attention``.
  """
  scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
  scores = jnp.einsum("bqgrk,btgk->bgrqt", q, k, preferred_element_type=jnp.float32) * scale
  visible = jnp.arange(k.shape[1])[None, None, :] <= positions[:, :, None]  # [b, s, L]
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bgrqt,btgk->bqgrk", probs, v)


def site_key(key: jax.Array | None, layer: int, site: int) -> jax.Array | None:
  """A separate key for each dropout site (layer, site) of one step."""
  return None if key is None else jax.random.fold_in(jax.random.fold_in(key, layer), site)


# Dropout sites within a layer (the embedding's is layer 0, site EMBED).
EMBED, ATTN_PROBS, ATTN_OUT, MLP_OUT = 0, 1, 2, 3
