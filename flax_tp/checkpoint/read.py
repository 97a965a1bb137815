"""Reading a checkpoint step's pieces into device blocks: positioned reads, checked."""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_tp.checkpoint.boxes import logical_boxes
from flax_tp.checkpoint.errors import CheckpointError
from flax_tp.checkpoint.keys import (
  layer_layouts,
  layout_of,
  logical_shape,
  saved_keys,
  slot_keys,
  value_of,
)


class Pieces:
  """The pieces of one checkpoint step, read through memory maps."""

  def __init__(self, folder: Path, record: dict[str, Any], step: int):
    self.folder, self.step, self.table = folder, step, record["arrays"]
    # key -> [(process, start, shape, offset, crc32 or None)]
    self.by_key: dict[str, list[tuple]] = {}
    index_crc32 = record.get("index_crc32")  # absent in checkpoints written before checksums
    for process in range(int(record["processes"])):
      path = folder / f"index.{process}.json"
      try:
        raw = path.read_bytes()
        if index_crc32 is not None and zlib.crc32(raw) != index_crc32[process]:
          raise CheckpointError(f"checkpoint step {step} is corrupt: {path.name} does not "
                                "match its checksum in meta.json")
        entries = json.loads(raw.decode("utf-8"))
        for entry in entries:
          key, start, shape, offset = entry[:4]
          crc = entry[4] if len(entry) > 4 else None
          self.by_key.setdefault(key, []).append(
              (process, tuple(start), tuple(shape), int(offset), crc))
      except (OSError, ValueError, TypeError) as err:
        if isinstance(err, CheckpointError):
          raise
        raise CheckpointError(f"cannot read checkpoint step {step}: {path.name}: "
                              f"{type(err).__name__}: {err}") from None
    self._files: dict[int, int] = {}  # process -> open file descriptor
    self._checked: set[tuple[int, int]] = set()  # (process, offset) of verified pieces

  def close(self) -> None:
    for fd in self._files.values():
      os.close(fd)
    self._files.clear()

  def _piece(self, key: str, process: int, shape: tuple[int, ...], offset: int,
             crc: int | None) -> np.ndarray:
    """One piece, read with a positioned read: only its bytes, into memory freed after use
    (a memory map would keep every touched page resident until the restore ends)."""
    dtype = jnp.dtype(self.table[key]["dtype"])
    size = math.prod(shape) * dtype.itemsize
    path = self.folder / f"shards.{process}.bin"
    try:
      if process not in self._files:
        self._files[process] = os.open(path, os.O_RDONLY)
      raw = os.pread(self._files[process], size, offset)
    except OSError as err:
      raise CheckpointError(f"cannot read checkpoint step {self.step}: {path.name}: "
                            f"{err.strerror or err}") from None
    if len(raw) != size:
      raise CheckpointError(f"checkpoint step {self.step} is truncated: "
                            f"shards.{process}.bin ends inside {key!r}")
    # A piece that overlaps several device blocks (another mesh) is read for each; its
    # checksum is computed once.
    if crc is not None and (process, offset) not in self._checked:
      if zlib.crc32(raw) != crc:
        raise CheckpointError(f"checkpoint step {self.step} is corrupt: the bytes of {key!r} "
                              f"in shards.{process}.bin do not match their checksum")
      self._checked.add((process, offset))
    return np.frombuffer(raw, dtype).reshape(shape)

  def restore(self, key: str, leaf: Any) -> Any:
    target = value_of(leaf)
    layouts = layout_of(leaf)
    expected = logical_shape(leaf)
    layer_keys = saved_keys(key, leaf)
    for k in layer_keys or [key]:
      saved = tuple(self.table[k]["shape"])
      want = expected[1:] if layer_keys else expected
      if saved != want:
        raise CheckpointError(f"checkpoint param {k!r}: got shape {saved}, expected {want} "
                              "(was it saved from another config?)")

    layer_keys = slot_keys(key, leaf)  # (in stored order)

    def block(where: tuple[slice, ...], shape: tuple[int, ...], dtype: Any) -> np.ndarray:
      if not layer_keys:
        return self._block(key, where, shape, layouts, dtype)
      # A stacked param: its layers are separate params on disk.
      first, stop = where[0].indices(shape[0])[:2]
      # (a pipeline's identity layer, None, is zeros)
      return np.stack([np.zeros([len(range(*s.indices(n))) for s, n in zip(where[1:], shape[1:],
                                                                          strict=True)], dtype)
                       if layer_keys[i] is None else
                       self._block(layer_keys[i], where[1:], shape[1:], layer_layouts(layouts),
                                   dtype) for i in range(first, stop)])

    if not isinstance(target, jax.Array):
      return block((slice(None),) * len(expected), expected, np.dtype(np.asarray(target).dtype))
    blocks: dict[tuple, np.ndarray] = {}
    arrays = []
    for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
      where = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, target.shape, strict=True))
      marker = tuple((s.start, s.stop) for s in where)
      if marker not in blocks:  # replicas of one block are read once
        blocks[marker] = block(where, target.shape, target.dtype)
      arrays.append(jax.device_put(blocks[marker], device))
    blocks.clear()
    value = jax.make_array_from_single_device_arrays(target.shape, target.sharding, arrays)
    return leaf.replace(value) if isinstance(leaf, nnx.Variable) else value

  def _block(self, key, where, shape, layouts, dtype) -> np.ndarray:
    """One device block of the stored array: its logical data from the pieces, zero padding."""
    where = tuple(slice(*s.indices(n)[:2]) for s, n in zip(where, shape, strict=True))
    block = np.zeros([s.stop - s.start for s in where], dtype)
    needed = filled = 0
    for sl, start, box in logical_boxes(where, shape, layouts):
      needed += math.prod(box)
      for process, p_start, p_shape, offset, crc in self.by_key.get(key, []):
        lo = [max(a, b) for a, b in zip(start, p_start, strict=True)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(start, box, p_start, p_shape, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
          continue
        piece = self._piece(key, process, p_shape, offset, crc)
        src = tuple(slice(a - b, h - b) for a, h, b in zip(lo, hi, p_start, strict=True))
        dst = tuple(slice(s.start + a - b, s.start + h - b)
                    for s, a, h, b in zip(sl, lo, hi, start, strict=True))
        block[dst] = piece[src]
        filled += math.prod(h - a for a, h in zip(lo, hi, strict=True))
    if filled != needed:
      raise CheckpointError(f"checkpoint step {self.step} lacks part of {key!r} "
                            f"({needed - filled} of {needed} elements): an incomplete write?")
    return block
