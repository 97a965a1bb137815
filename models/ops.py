"""Pure array functions both models share: rotary positions, activations, dropout
(attention has its own home, ``models/attention.py``).

Nothing here knows about devices. Dropout masks are keyed by *logical* position
(global batch row, global head), never by device, so a mesh cannot change them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(dim: int, base: float, scaling=None) -> tuple[np.ndarray, float]:
  """Rotary's inverse frequencies ``[dim / 2]`` (float32, on the host) for ``dim``
  rotated dims, and the factor cos/sin are scaled by: transformers'
  ``ROPE_INIT_FUNCTIONS`` for the ``default``, ``linear``, ``llama3`` and ``yarn`` kinds,
  step for step in float32 as it computes them (NumPy keeps float32 with Python
  scalars). Constants of any step that uses them: nothing here is traced or compiled.

  scaling: a ``models.config.RopeScaling`` or None (plain rotary).
  """
  inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  if scaling is None:
    return inv_freq, 1.0
  factor = scaling.factor
  if scaling.kind == "linear":
    return inv_freq / factor, 1.0
  if scaling.kind == "llama3":
    old = scaling.original_max_len
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled), 1.0
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
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
              + (1.0 / pos_freqs) * extrapolation)
  return inv_freq, scaling.attention_factor


# The most table entries (positions x frequencies) a step holds as constants: 4 MiB
# of float32 per table (a sequence of 16k at 128 rotated dims). A longer sequence
# computes its cos/sin in the step instead, from the same angles (within an ulp).
ROTARY_TABLE_LIMIT = 1 << 20


def rotary(x: jax.Array, base: float, positions: jax.Array | None = None, *,
           scaling=None, rotary_dim: int | None = None) -> jax.Array:
  """Rotary position embedding. x: ``[b, s, h, k]`` -> same shape and dtype.

  positions: ``[b, s]`` int position of each token (a KV-cached step's tokens
  start where the cache ends); None means ``0 .. s-1`` for every row.
  scaling: a ``RopeScaling`` (see ``inverse_frequencies``) or None; rotary_dim: how
  many leading dims of a head rotate (HF's partial rotary; the rest pass through),
  default all ``k``.

  The inverse frequencies, and for positions ``0 .. s-1`` the whole cos/sin table
  (``rotary_table``), are computed on the host and enter the step as constants: computed
  inside the step, XLA:CPU fuses them into every fusion that reads them and evaluates
  ``pow``, ``sin`` and ``cos`` again in each, per device, per step (about 4% of a small
  model's step). Traced positions (a cached step) multiply the same constant frequencies
  and take XLA's ``sin``/``cos`` of the same float32 angles, which agree with the
  table's (rounded from float64) to a few units in the last place.
  """
  s, k = x.shape[1], x.shape[-1]
  rotary_dim = k if rotary_dim is None else rotary_dim
  if positions is None and s * (rotary_dim // 2) <= ROTARY_TABLE_LIMIT:
    cos, sin = (jnp.asarray(t)[None, :, None, :]
                for t in rotary_table(s, rotary_dim, base, scaling))
  else:
    inv_freq, attention_factor = _frequencies(rotary_dim, base, scaling)
    if positions is None:
      positions = jnp.arange(s)[None, :]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b | 1, s, dim / 2]
    cos = (jnp.cos(angles) * attention_factor)[:, :, None, :]
    sin = (jnp.sin(angles) * attention_factor)[:, :, None, :]
  rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
  x1, x2 = jnp.split(rotated.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return jnp.concatenate([out, passed], axis=-1) if passed.shape[-1] else out


@functools.lru_cache(maxsize=32)
def _frequencies(dim: int, base: float, scaling) -> tuple[np.ndarray, float]:
  """``inverse_frequencies``, computed once per rotary and shared (read-only)."""
  inv_freq, attention_factor = inverse_frequencies(dim, base, scaling)
  return _read_only(np.asarray(inv_freq, np.float32)), float(attention_factor)


# A table per (length, dims, base, scaling): a run's train and eval lengths, a few
# prompt lengths; at most 8 (64 MiB at the size limit) are kept.
@functools.lru_cache(maxsize=8)
def rotary_table(length: int, dim: int, base: float, scaling=None
                 ) -> tuple[np.ndarray, np.ndarray]:
  """``(cos, sin)``, each ``[length, dim / 2]`` float32 on the host: rotary's factors at
  positions ``0 .. length-1`` for ``dim`` rotated dims (``inverse_frequencies``' scaling
  and attention factor applied). The float32 angles a step would form (position times
  frequency), their cos and sin computed in float64 and rounded to float32, times the
  factor in float32; kept for the next trace (read-only)."""
  inv_freq, attention_factor = _frequencies(dim, base, scaling)
  angles = np.arange(length, dtype=np.float32)[:, None] * inv_freq  # float32 products
  factor = np.float32(attention_factor)
  return (_read_only(np.cos(angles.astype(np.float64)).astype(np.float32) * factor),
          _read_only(np.sin(angles.astype(np.float64)).astype(np.float32) * factor))


def _read_only(a: np.ndarray) -> np.ndarray:
  a = np.array(a, copy=True)
  a.flags.writeable = False
  return a


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


def site_key(key: jax.Array | None, layer: int, site: int) -> jax.Array | None:
  """A separate key for each dropout site (layer, site) of one step."""
  return None if key is None else jax.random.fold_in(jax.random.fold_in(key, layer), site)


# Dropout sites within a layer (the embedding's is layer 0, site EMBED).
EMBED, ATTN_PROBS, ATTN_OUT, MLP_OUT = 0, 1, 2, 3


def pre_norm(norm, x):
  """A block's norm before attention or the MLP, or ``x`` itself where the block has
  none (``TransformerConfig.pre_norm`` False: OLMo 2/3 norm only the branches' outputs)."""
  return x if norm is None else norm(x)
