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

  def runs(self, index: int) -> tuple[tuple[int, int, int], ...]:
    """``((start in the shard, length, logical start), ...)``: the logical ranges shard
    ``index`` stores (one here; one per segment in a ``SegmentedLayout``)."""
    return ((0, self.sizes[index], self.offsets[index]),)

  @property
  def padded_total(self) -> int:
    """Size of the stored global dimension: ``parts * padded_size``."""
    return self.parts * self.padded_size

  @property
  def is_even(self) -> bool:
    """True when no shard carries padding."""
    return self.padded_total == self.size

  @property
  def stored_is_logical(self) -> bool:
    """True when the stored form is the logical tensor itself (no padding, in order)."""
    return self.is_even

  @property
  def replicated(self) -> bool:
    """Whether some logical element is stored on more than one shard (a
    ``KVHeadLayout``'s kv heads may be); here never."""
    return False

  def first_copy_runs(self, index: int) -> tuple[tuple[int, int, int], ...]:
    """``runs(index)`` less the elements an earlier shard already holds: each logical
    element once over all shards (what a checkpoint writes)."""
    return self.runs(index)

  def replica_weights(self) -> np.ndarray | None:
    """``[parts, padded_size]``: how much each stored element counts in a norm, ``1 /
    copies`` of the logical element it holds (0 for padding); None when each stored
    element counts once (padding is zero there)."""
    return None

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

  def stored_positions(self) -> np.ndarray:
    """``[parts, padded_size]``: the logical element each stored element holds, or
    ``size`` for padding. The one table that ``shard`` and ``pad`` read."""
    return self._stored_positions

  @functools.cached_property
  def _stored_positions(self) -> np.ndarray:
    table = np.full((self.parts, self.padded_size), self.size)
    for i in range(self.parts):
      for at, length, start in self.runs(i):
        table[i, at:at + length] = start + np.arange(length)
    table.flags.writeable = False
    return table

  def shard(self, tensor: Array, index: int, dim: int) -> Array:
    """Shard ``index`` of the logical ``tensor`` along ``dim``, zero-padded."""
    dim = _check_split_args(np.ndim(tensor), index, self.parts, dim)
    self._check_dim(tensor, dim)
    return _take_or_zero(tensor, self.stored_positions()[index], dim)

  def pad(self, tensor: Array, dim: int) -> Array:
    """The stored form ``[..., padded_total, ...]`` of a logical tensor.

    Built as one gather of the logical elements (padding reads zero), not as a
    concatenation of padded slices: XLA's SPMD partitioner (jax 0.10.2) partitions
    the transpose of that concatenation wrongly when the result is sharded over
    the axis (tests/test_dropin.py has a plain-JAX reproduction), so a standalone
    row layer's input gradient was wrong under ``jax.jit``.
    """
    dim = _check_split_args(np.ndim(tensor), 0, 1, dim)
    self._check_dim(tensor, dim)
    if self.stored_is_logical:
      return tensor
    return _take_or_zero(tensor, self.stored_positions().reshape(-1), dim)

  def unpad(self, stored: Array, dim: int) -> Array:
    """The logical tensor ``[..., size, ...]`` from its stored form."""
    dim = _check_split_args(np.ndim(stored), 0, 1, dim)
    if stored.shape[dim] != self.padded_total:
      raise ValueError(
          f"stored dimension {dim} has {stored.shape[dim]} elements, expected "
          f"{self.padded_total} ({self})"
      )
    if self.stored_is_logical:
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

  @functools.cached_property
  def query_layout(self) -> ShardLayout:
    """The query heads' layout: ``num_heads * unit`` split in whole heads."""
    return ShardLayout(self.num_heads * self.unit, self.parts, self.unit)

  @functools.cached_property
  def kv_for_query_heads(self) -> tuple[np.ndarray, np.ndarray]:
    """``[parts, local query heads]`` each: the local kv head each local query head
    uses, and whether that query head is real (not padding). Built once per layout."""
    q, unit = self.query_layout, self.unit
    group = self.num_heads // (self.size // unit)
    local = q.padded_size // unit
    index = np.zeros((q.parts, local), np.int32)
    real = np.zeros((q.parts, local), bool)
    for i in range(q.parts):
      first, count = q.offsets[i] // unit, q.sizes[i] // unit
      heads = first + np.arange(count)
      index[i, :count] = heads // group - self.offsets[i] // unit
      real[i, :count] = True
    return index, real

  @functools.cached_property
  def groups_line_up(self) -> bool:
    """Whether every shard's query heads are whole groups over its own kv heads, in
    order (padding over padding), so ``[hq_pad]`` reshapes to ``[hkv_pad, group]``."""
    group = self.num_heads // (self.size // self.unit)
    index, real = self.kv_for_query_heads
    kv_local = self.padded_size // self.unit
    if index.shape[1] != kv_local * group:
      return False
    expected = np.arange(index.shape[1]) // group
    kv_real = np.asarray(self.sizes) // self.unit
    return bool(np.all(np.where(real, index == expected, expected >= kv_real[:, None])))

  def first_copy_runs(self, index: int) -> tuple[tuple[int, int, int], ...]:
    held = max((o + s for o, s in zip(self.offsets[:index], self.sizes[:index], strict=True)
                if s), default=0)
    skip = max(0, min(held - self.offsets[index], self.sizes[index]))
    return ((skip, self.sizes[index] - skip, self.offsets[index] + skip),)

  def replica_weights(self) -> np.ndarray | None:
    if not self.replicated:
      return None
    positions = self.stored_positions()  # the logical element each stored one holds
    copies = np.bincount(positions.reshape(-1), minlength=self.size + 1)
    return np.where(positions < self.size, 1.0 / copies[positions], 0.0)

  def valid_indices(self) -> np.ndarray:
    """``[size]``: the stored position of each logical element's first copy."""
    first = np.full(self.size, -1)
    for i, (offset, size) in enumerate(self._bounds):
      positions = i * self.padded_size + np.arange(size)
      logical = offset + np.arange(size)
      unset = first[logical] < 0
      first[logical[unset]] = positions[unset]
    return first


@dataclasses.dataclass(frozen=True)
class SegmentedLayout(ShardLayout):
  """A dimension made of ``segments`` (e.g. a fused q/k/v projection's ``[q | k | v]``
  outputs), each split over the shards on its own, in whole ``unit`` blocks.

  Shard ``i`` stores one slot per segment, in order: segment ``s``'s part ``i`` (as
  ``ShardLayout(segments[s], parts, unit)`` splits it) padded to that segment's
  ``padded_size``. So every device holds whole heads of q, of k and of v, and the
  fused output splits into its segments locally, with no communication. Logical
  order is the segments' concatenation.

  A shard holds several logical ranges: use ``runs``, not ``offsets``.
  """

  segments: tuple[int, ...] = ()

  def __post_init__(self):
    if self.parts < 1:
      raise ValueError(f"parts must be >= 1, got {self.parts}")
    if not self.segments or sum(self.segments) != self.size:
      raise ValueError(f"segments {self.segments} must be non-empty and add up to size "
                       f"{self.size}")
    if self.unit < 1 or any(n < 1 or n % self.unit for n in self.segments):
      raise ValueError(f"every segment of {self.segments} must be a positive multiple of "
                       f"unit {self.unit} (e.g. whole heads)")

  @functools.cached_property
  def layouts(self) -> tuple[ShardLayout, ...]:
    """The layout of each segment on its own."""
    return tuple(ShardLayout(n, self.parts, self.unit) for n in self.segments)

  @functools.cached_property
  def slot_offsets(self) -> tuple[int, ...]:
    """Where each segment's slot starts inside a shard."""
    return tuple(int(o) for o in np.cumsum([0] + [s.padded_size for s in self.layouts])[:-1])

  @functools.cached_property
  def logical_offsets(self) -> tuple[int, ...]:
    """Where each segment starts in the logical dimension."""
    return tuple(int(o) for o in np.cumsum((0,) + self.segments)[:-1])

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(sum(s.sizes[i] for s in self.layouts) for i in range(self.parts))

  @property
  def offsets(self) -> tuple[int, ...]:
    raise TypeError("a SegmentedLayout shard holds one logical range per segment: use runs()")

  @property
  def padded_size(self) -> int:
    return sum(s.padded_size for s in self.layouts)

  @property
  def is_even(self) -> bool:
    """No shard carries padding. (The stored order is still not the logical one.)"""
    return all(s.is_even for s in self.layouts)

  @property
  def stored_is_logical(self) -> bool:
    # Without padding a shard still interleaves the segments, unless there is one shard.
    return self.is_even and (self.parts == 1 or len(self.segments) == 1)

  def runs(self, index: int) -> tuple[tuple[int, int, int], ...]:
    return tuple((slot, s.sizes[index], start + s.offsets[index])
                 for slot, start, s in zip(self.slot_offsets, self.logical_offsets,
                                           self.layouts, strict=True))

  def valid_mask(self) -> np.ndarray:
    per_shard = [np.concatenate([np.arange(s.padded_size) < s.sizes[i] for s in self.layouts])
                 for i in range(self.parts)]
    return np.concatenate(per_shard)

  def valid_indices(self) -> np.ndarray:
    out = []
    for slot, s in zip(self.slot_offsets, self.layouts, strict=True):
      own = s.valid_indices()  # positions in the segment's own stored form
      out.append(own // s.padded_size * self.padded_size + slot + own % s.padded_size)
    return np.concatenate(out)

  def local_mask(self, shard_index: Array) -> jax.Array:
    return jnp.concatenate([s.local_mask(shard_index) for s in self.layouts])


def _take_or_zero(tensor: Array, positions: np.ndarray, dim: int) -> Array:
  """``tensor`` gathered along ``dim`` at ``positions``; a position equal to the
  dimension's size reads zero (padding)."""
  if isinstance(tensor, jax.Array):
    return jnp.take(tensor, positions, axis=dim, mode="fill", fill_value=0)
  size = tensor.shape[dim]
  if size == 0:
    return np.zeros(tensor.shape[:dim] + positions.shape + tensor.shape[dim + 1:], tensor.dtype)
  # One copy on the host (a whole embedding table can be large): gather, then zero the
  # padding in place.
  out = np.take(tensor, np.minimum(positions, size - 1), axis=dim)
  padding = positions >= size
  if padding.any():
    out[(slice(None),) * dim + (padding,)] = 0
  return out
