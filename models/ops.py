"""Pure array functions both models share: rotary positions, causal attention, dropout.

Nothing here knows about devices. Dropout masks are keyed by *logical* position
(global batch row, global head), never by device, so a mesh cannot change them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def inverse_frequencies(dim: int, base: float, scaling=None) -> tuple[jax.Array, float]:
  """Rotary's inverse frequencies ``[dim / 2]`` (float32) for ``dim`` rotated dims, and
  the factor cos/sin are scaled by: transformers' ``ROPE_INIT_FUNCTIONS`` for the
  ``default``, ``linear``, ``llama3`` and ``yarn`` kinds, step for step in float32.

  scaling: a ``models.config.RopeScaling`` or None (plain rotary).
  """
  inv_freq = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  if scaling is None:
    return inv_freq, 1.0
  factor = scaling.factor
  if scaling.kind == "linear":
    return inv_freq / factor, 1.0
  if scaling.kind == "llama3":
    old = scaling.original_max_len
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return jnp.where(medium, smoothed, scaled), 1.0
  # yarn: extrapolated (plain) frequencies on the fast dims, interpolated (/ factor) on
  # the slow ones, a linear ramp between the correction dims.
  def correction_dim(rotations):
    return (dim * math.log(scaling.original_max_len / (rotations * 2 * math.pi))
            / (2 * math.log(base)))
  low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
  if scaling.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # (transformers': prevents a zero-width ramp)
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  pos_freqs = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
              + (1.0 / pos_freqs) * extrapolation)
  return inv_freq, scaling.attention_factor


def rotary(x: jax.Array, base: float, positions: jax.Array | None = None, *,
           scaling=None, rotary_dim: int | None = None) -> jax.Array:
  """Rotary position embedding. x: ``[b, s, h, k]`` -> same shape and dtype.

  positions: ``[b, s]`` int position of each token (a KV-cached step's tokens
  start where the cache ends); None means ``0 .. s-1`` for every row.
  scaling: a ``RopeScaling`` (see ``inverse_frequencies``) or None; rotary_dim: how
  many leading dims of a head rotate (HF's partial rotary; the rest pass through),
  default all ``k``.
  """
  s, k = x.shape[1], x.shape[-1]
  rotary_dim = k if rotary_dim is None else rotary_dim
  if positions is None:
    positions = jnp.arange(s)[None, :]
  if scaling is None and rotary_dim == k:  # (kept op for op as before the families)
    inv_freq = 1.0 / (base ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b | 1, s, k/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                           axis=-1).astype(x.dtype)
  inv_freq, attention_factor = inverse_frequencies(rotary_dim, base, scaling)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  sin = (jnp.sin(angles) * attention_factor)[:, :, None, :]
  cos = (jnp.cos(angles) * attention_factor)[:, :, None, :]
  rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
  x1, x2 = jnp.split(rotated.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return jnp.concatenate([out, passed], axis=-1) if passed.shape[-1] else out


GATED = ("swiglu", "geglu")  # MLP kinds with a gate projection beside up


def mlp_hidden(kind: str, gate: jax.Array | None, up: jax.Array) -> jax.Array:
  """The MLP's hidden activations from its projections ``[..., f]``: ``gelu(up)``,
  ``silu(gate) * up`` (swiglu) or ``gelu_tanh(gate) * up`` (geglu, Gemma's
  ``gelu_pytorch_tanh``). Each maps 0 to 0, so padded columns stay zero."""
  if kind == "gelu":
    return jax.nn.gelu(up)
  if kind == "swiglu":
    return jax.nn.silu(gate) * up
  return jax.nn.gelu(gate, approximate=True) * up


def scale_embeddings(cfg, x: jax.Array) -> jax.Array:
  """Gemma's ``x * sqrt(d_model)``, the factor rounded to ``x``'s dtype first as
  transformers rounds it; ``x`` unchanged without ``cfg.embed_scale``."""
  if not cfg.embed_scale:
    return x
  return x * jnp.asarray(cfg.d_model ** 0.5, x.dtype)


def softcap_of(x: jax.Array, cap: float | None) -> jax.Array:
  """``cap * tanh(x / cap)`` (Gemma 2's soft-capping); ``x`` unchanged when cap is None."""
  return x if cap is None else jnp.tanh(x / cap) * cap


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


def keep_rows(key: jax.Array, rate: float, rows: jax.Array, heads: jax.Array,
              query_pos: jax.Array, seq_len: int) -> jax.Array:
  """``[b, h, q, seq_len]`` bool: the rows at ``query_pos [q]`` of the whole sequence's
  keep-mask on the attention probabilities (``[b, h, seq_len, seq_len]``, as one device
  draws it), so that no split of the sequence changes which entries drop. A padding
  query (``>= seq_len``) reads the last row, which its zero loss leaves unused."""
  keep = keep_mask(key, rate, rows, (seq_len, seq_len), heads)
  return jnp.take(keep, jnp.minimum(query_pos, seq_len - 1), axis=2)


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


def _scores(q, k, scale, softcap):
  """``[b, h, q, t]`` float32 scores of ``q [b, q, h, k]`` over ``k [b, t, h, k]``."""
  scores = jnp.einsum("bqhk,bthk->bhqt", q, k, preferred_element_type=jnp.float32) * scale
  return softcap_of(scores, softcap)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     dropout_key: jax.Array | None, rate: float, rows: jax.Array,
                     heads: jax.Array, window: int | jax.Array | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     query_pos: jax.Array | None = None, key_pos: jax.Array | None = None,
                     seq_len: int | None = None) -> jax.Array:
  """Softmax attention with a causal mask.

  q: ``[b, s, h, k]``; k, v: ``[b, s, g, k]`` with ``g`` dividing ``h`` (query head
  ``i`` reads kv head ``i // (h // g)``: grouped-query attention without copying
  the kv heads); rows/heads: logical ids for dropout.
  window: a sliding window (see ``visible_keys``; a traced int under scanned layers),
  scale: the scores' scale (default ``k ** -0.5``), softcap: scores ->
  ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
  returns ``[b, s, h, k]``. Softmax runs in float32 whatever the input dtype.

  Without dropout or soft-capping this is ``jax.nn.dot_product_attention`` (XLA's
  implementation: the same formula, scores in float32; a window is its mask).
  Dropout on the probabilities needs them materialised, which no fused kernel
  exposes, and no fused kernel here soft-caps, so those keep the explicit form.

  query_pos ``[s]`` / key_pos ``[t]``: the queries' and keys' global positions when they
  are not the same ``0 .. s-1`` (context parallelism: this device's queries over every
  device's keys, ``k, v [b, t, g, k]``); the mask is then ``visible_keys`` of them, and
  dropout's keep-mask is the whole ``seq_len`` sequence's, read at those positions (so
  it does not depend on the split). Positions ``>= seq_len`` are padding.
  """
  if query_pos is not None:
    return _positioned_attention(q, k, v, query_pos, key_pos, seq_len,
                                 dropout_key=dropout_key, rate=rate, rows=rows, heads=heads,
                                 window=window, scale=scale, softcap=softcap)
  s = q.shape[1]
  mask = None
  if window is not None:
    pos = jnp.arange(s)
    mask = visible_keys(pos[:, None], pos[None, :], window)[None, None]
  if (dropout_key is None or rate == 0.0) and softcap is None:
    if mask is None and scale is None:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True)
  group = q.shape[2] // k.shape[2]
  if group > 1:
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1])) if scale is None else scale
  scores = _scores(q, k, scale, softcap)
  if mask is None:
    mask = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = dropout(probs, dropout_key, rate, rows, heads).astype(v.dtype)
  return jnp.einsum("bhqt,bthk->bqhk", probs, v)


def _positioned_attention(q, k, v, query_pos, key_pos, seq_len, *, dropout_key, rate, rows,
                          heads, window, scale, softcap):
  """``causal_attention`` of queries and keys at given global positions."""
  mask = visible_keys(query_pos[:, None], key_pos[None, :], window)[None, None]
  if (dropout_key is None or rate == 0.0) and softcap is None:
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
  group = q.shape[2] // k.shape[2]
  if group > 1:
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1])) if scale is None else scale
  scores = jnp.where(mask, _scores(q, k, scale, softcap), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  if dropout_key is not None and rate > 0.0:
    # The whole sequence's keep-mask [b, h, S, S] (as one device draws it), read at
    # these queries' rows and these keys' columns; padding reads a real entry (clipped)
    # that its zero weight (a key) or zero loss (a query) leaves unused.
    keep = keep_rows(dropout_key, rate, rows, heads, query_pos, seq_len)
    keep = jnp.take(keep, jnp.minimum(key_pos, seq_len - 1), axis=3)
    probs = apply_keep(probs, keep, rate)
  return jnp.einsum("bhqt,bthk->bqhk", probs.astype(v.dtype), v)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *,
                     window: int | None = None, scale: float | None = None,
                     softcap: float | None = None) -> jax.Array:
  """Attention of new tokens over a KV cache, causal by position.

  q: ``[b, s, g, r, k]``, the new tokens' query heads in ``g`` groups of ``r``
    (query head ``(g, r)`` reads kv head ``g``; ``r = 1`` for one kv head per query head).
  k, v: ``[b, L, g, k]`` the cache, already holding the new tokens' keys/values.
  positions: ``[b, s]`` each new token's position; it sees cache slots ``<= position``
    (slots past it hold padding or stale values and are masked), and with a sliding
    ``window`` only the last ``window`` of them. scale, softcap: as ``causal_attention``.
  returns ``[b, s, g, r, k]``. Softmax runs in float32, as in ``causal_attention``.
  """
  scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1])) if scale is None else scale
  scores = softcap_of(jnp.einsum("bqgrk,btgk->bgrqt", q, k,
                                 preferred_element_type=jnp.float32) * scale, softcap)
  visible = visible_keys(positions[:, :, None], jnp.arange(k.shape[1])[None, None, :],
                         window)  # [b, s, L]
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bgrqt,btgk->bqgrk", probs, v)


def site_key(key: jax.Array | None, layer: int, site: int) -> jax.Array | None:
  """A separate key for each dropout site (layer, site) of one step."""
  return None if key is None else jax.random.fold_in(jax.random.fold_in(key, layer), site)


# Dropout sites within a layer (the embedding's is layer 0, site EMBED).
EMBED, ATTN_PROBS, ATTN_OUT, MLP_OUT = 0, 1, 2, 3
