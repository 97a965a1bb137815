"""Splitting one tensor dimension over devices, evenly or not.

JAX can only shard a dimension that the mesh axis divides. flax_tp splits any
dimension with ``numpy.array_split`` semantics (the first ``n % k`` shards get
one extra element) and stores every shard padded to the largest shard's size, so
that the stored global array divides evenly and JAX can shard it. The padding is
held at exactly zero by every layer.

``ShardLayout`` is the one place that knows this layout: sizes, offsets, padded
sizes, masks, and how to pad and unpad. Layers, ``unshard``, checkpoints and the
benchmarks all use it, so the uneven logic exists once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = Any  # a numpy or jax array


def _check_split_args(ndim: int, index: int, device_count: int, dim: int) -> int:
  """Validates the arguments of a split and returns ``dim`` made non-negative."""
  if not isinstance(device_count, (int, np.integer)) or device_count < 1:
    raise ValueError(f"device_count must be an integer >= 1, got {device_count!r}")
  if not isinstance(index, (int, np.integer)) or not 0 <= index < device_count:
    raise ValueError(
        f"index must be in [0, {device_count}) for device_count={device_count}, "
        f"got {index!r}"
    )
  if not isinstance(dim, (int, np.integer)) or not -ndim <= dim < ndim:
    raise ValueError(
        f"dim {dim!r} is out of range for a tensor of rank {ndim} "
        f"(expected -{ndim} <= dim < {ndim})"
    )
  return int(dim) % ndim


def split_tensor_for_parallelism(
    tensor: Array, index: int, device_count: int, dim: int
) -> Array:
  """Returns shard ``index`` of ``device_count`` along ``dim``.

  Follows ``numpy.array_split``: a dimension of size ``n`` gives the first
  ``n % device_count`` shards ``n // device_count + 1`` elements and the rest
  ``n // device_count``; a ``device_count`` larger than ``n`` gives empty shards
  at the end. Works on numpy and jax arrays and keeps the array's type.

  Example: a ``(10, 1)`` tensor over 3 devices on dim 0 gives rows ``0..3``,
  ``4..6`` and ``7..9``.
  """
  dim = _check_split_args(np.ndim(tensor), index, device_count, dim)
  start, size = _array_split_bounds(tensor.shape[dim], device_count)[index]
  return jax.lax.slice_in_dim(tensor, start, start + size, axis=dim) if isinstance(
      tensor, jax.Array) else np.take(tensor, np.arange(start, start + size), axis=dim)


@functools.cache
def _array_split_bounds(n: int, parts: int) -> tuple[tuple[int, int], ...]:
  """(offset, size) of each of ``parts`` shards of ``n`` elements, array_split style."""
  base, extra = divmod(n, parts)
  sizes = [base + 1 if i < extra else base for i in range(parts)]
  offsets = np.cumsum([0] + sizes[:-1]).tolist()
  return tuple(zip(offsets, sizes, strict=True))


@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """How one logical dimension of ``size`` elements is stored over ``parts`` shards.

  The dimension is split in whole blocks of ``unit`` elements (``unit=head_dim``
  keeps an attention head on one device), with ``array_split`` semantics over the
  blocks. Shard ``i`` holds logical elements ``offsets[i] : offsets[i] +
  sizes[i]`` followed by ``padded_size - sizes[i]`` zeros, so the stored
  dimension has ``parts * padded_size`` elements and always divides evenly.
  """

  size: int
  parts: int
  unit: int = 1

  def __post_init__(self):
    if self.parts < 1:
      raise ValueError(f"parts must be >= 1, got {self.parts}")
    if self.unit < 1 or self.size % self.unit:
      raise ValueError(
          f"size {self.size} must be a multiple of unit {self.unit} (e.g. "
          "out_features a multiple of head_dim)"
      )

  @functools.cached_property
  def _bounds(self) -> tuple[tuple[int, int], ...]:
    return tuple((o * self.unit, s * self.unit)
                 for o, s in _array_split_bounds(self.size // self.unit, self.parts))

  @property
  def sizes(self) -> tuple[int, ...]:
    """Logical elements held by each shard."""
    return tuple(s for _, s in self._bounds)

  @property
  def offsets(self) -> tuple[int, ...]:
    """Logical index of each shard's first element."""
    return tuple(o for o, _ in self._bounds)

  @property
  def padded_size(self) -> int:
    """Elements every shard stores (its logical part plus zero padding)."""
    return max(self.sizes)

  @property
  def padded_total(self) -> int:
    """Size of the stored global dimension: ``parts * padded_size``."""
    return self.parts * self.padded_size

  @property
  def is_even(self) -> bool:
    """True when no shard carries padding (stored == logical)."""
    return self.padded_total == self.size

  def valid_mask(self) -> np.ndarray:
    """``[padded_total]`` bool: True at stored positions that hold logical data."""
    local = np.arange(self.padded_size)
    return (local[None, :] < np.asarray(self.sizes)[:, None]).reshape(-1)

  def valid_indices(self) -> np.ndarray:
    """``[size]`` int: stored position of each logical element, in order."""
    return np.flatnonzero(self.valid_mask())

  def local_mask(self, shard_index: Array) -> jax.Array:
    """``[padded_size]`` bool mask of shard ``shard_index`` (may be traced)."""
    return jnp.arange(self.padded_size) < jnp.asarray(self.sizes)[shard_index]

  def shard(self, tensor: Array, index: int, dim: int) -> Array:
    """Shard ``index`` of the logical ``tensor`` along ``dim``, zero-padded."""
    dim = _check_split_args(np.ndim(tensor), index, self.parts, dim)
    self._check_dim(tensor, dim)
    xp = jnp if isinstance(tensor, jax.Array) else np
    blocks = tensor.reshape(tensor.shape[:dim] + (self.size // self.unit, self.unit)
                            + tensor.shape[dim + 1:])
    part = split_tensor_for_parallelism(blocks, index, self.parts, dim)
    part = part.reshape(tensor.shape[:dim] + (-1,) + tensor.shape[dim + 1:])
    pad = [(0, 0)] * tensor.ndim
    pad[dim] = (0, self.padded_size - part.shape[dim])
    return xp.pad(part, pad)

  def pad(self, tensor: Array, dim: int) -> Array:
    """The stored form ``[..., padded_total, ...]`` of a logical tensor."""
    dim = _check_split_args(np.ndim(tensor), 0, 1, dim)
    if self.is_even:
      self._check_dim(tensor, dim)
      return tensor
    xp = jnp if isinstance(tensor, jax.Array) else np
    return xp.concatenate([self.shard(tensor, i, dim) for i in range(self.parts)],
                          axis=dim)

  def unpad(self, stored: Array, dim: int) -> Array:
    """The logical tensor ``[..., size, ...]`` from its stored form."""
    dim = _check_split_args(np.ndim(stored), 0, 1, dim)
    if stored.shape[dim] != self.padded_total:
      raise ValueError(
          f"stored dimension {dim} has {stored.shape[dim]} elements, expected "
          f"{self.padded_total} ({self})"
      )
    if self.is_even:
      return stored
    xp = jnp if isinstance(stored, jax.Array) else np
    return xp.take(stored, self.valid_indices(), axis=dim)

  def _check_dim(self, tensor: Array, dim: int) -> None:
    if tensor.shape[dim] != self.size:
      raise ValueError(
          f"dimension {dim} of a {tuple(tensor.shape)} tensor has "
          f"{tensor.shape[dim]} elements, expected the logical size {self.size}"
      )


@dataclasses.dataclass(frozen=True)
class KVHeadLayout(ShardLayout):
  """The key/value heads of grouped-query attention, placed beside the query heads.

  ``size = num_kv_heads * unit`` (``unit = head_dim``). Query heads are split
  whole with ``array_split`` semantics; shard ``i`` holds exactly the kv heads
  its own query heads use (query head ``h`` uses kv head ``h // group``), a
  contiguous range. When the model axis does not line up with the groups, a kv
  head is *replicated* on every shard that needs it (6 query / 2 kv heads over
  4 shards: kv heads 0, 0-1, 1, 1), and a shard without query heads holds none.
  ``offsets``/``sizes`` give each shard's range, so padding, masks and
  ``shard`` work as for ``ShardLayout``; ``unpad`` keeps each head's first copy.
  """

  num_heads: int = 0

  def __post_init__(self):
    super().__post_init__()
    kv = self.size // self.unit
    if kv < 1 or self.num_heads < 1 or self.num_heads % kv:
      raise ValueError(f"num_heads={self.num_heads} must be a positive multiple of the "
                       f"{kv} kv heads")

  @functools.cached_property
  def _bounds(self) -> tuple[tuple[int, int], ...]:
    group = self.num_heads // (self.size // self.unit)
    bounds = []
    for first, count in _array_split_bounds(self.num_heads, self.parts):
      lo = first // group
      hi = (first + count - 1) // group + 1 if count else lo
      bounds.append((lo * self.unit, (hi - lo) * self.unit))
    return tuple(bounds)

  @property
  def replicated(self) -> bool:
    """Whether some kv head is stored on more than one shard."""
    ends = [o + s for o, s in self._bounds if s]
    starts = [o for o, s in self._bounds if s]
    return any(b < a for a, b in zip(ends, starts[1:], strict=False))

  def shard(self, tensor: Array, index: int, dim: int) -> Array:
    dim = _check_split_args(np.ndim(tensor), index, self.parts, dim)
    self._check_dim(tensor, dim)
    xp = jnp if isinstance(tensor, jax.Array) else np
    offset, size = self._bounds[index]
    part = xp.take(tensor, np.arange(offset, offset + size), axis=dim)
    pad = [(0, 0)] * tensor.ndim
    pad[dim] = (0, self.padded_size - size)
    return xp.pad(part, pad)

  def valid_indices(self) -> np.ndarray:
    """``[size]``: the stored position of each logical element's first copy."""
    first = np.full(self.size, -1)
    for i, (offset, size) in enumerate(self._bounds):
      positions = i * self.padded_size + np.arange(size)
      logical = offset + np.arange(size)
      unset = first[logical] < 0
      first[logical[unset]] = positions[unset]
    return first

  def stored_positions(self) -> np.ndarray:
    """``[parts, padded_size]``: the logical element each stored element copies, or
    ``size`` for padding."""
    table = np.full((self.parts, self.padded_size), self.size)
    for i, (offset, size) in enumerate(self._bounds):
      table[i, :size] = offset + np.arange(size)
    return table
