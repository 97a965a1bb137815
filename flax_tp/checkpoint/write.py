"""Writing one process's pieces of a checkpoint step, durably."""

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

from flax_tp.checkpoint.boxes import logical_boxes
from flax_tp.checkpoint.keys import (
  flat_leaves,
  layer_layouts,
  layout_of,
  logical_shape,
  saved_keys,
  slot_keys,
  value_of,
)

BARRIER_TIMEOUT_S = 600


def fsync(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def barrier(name: str) -> None:
  """All processes reach ``name`` (JAX's distributed key-value barrier; safe off the main
  thread, unlike a device collective)."""
  if jax.process_count() > 1:
    from orbax.checkpoint import multihost
    multihost.get_barrier_sync_fn()(key=name, timeout_ms=BARRIER_TIMEOUT_S * 1000)


class Snapshot:
  """What one process writes for one step: device buffers of its replica-0 shards."""

  def __init__(self, trees: dict[str, Any], copy: bool):
    flat = flat_leaves(trees)
    values = [value_of(leaf) for _, leaf in flat]
    if copy:  # on device: the next step may donate (delete) the originals
      values = _copy_on_device(values)
    self.table: dict[str, dict[str, Any]] = {}
    # (keys, data, index, layouts, stored shape); ``keys`` is one key, or one
    # per layer of a stacked param (its leading axis).
    self.shards: list[tuple] = []
    for (key, leaf), value in zip(flat, values, strict=True):
      layouts = layout_of(leaf)
      shape, dtype = list(logical_shape(leaf)), jnp.dtype(value.dtype).name
      layer_keys = saved_keys(key, leaf)
      for k in layer_keys or [key]:
        self.table[k] = {"shape": shape[1:] if layer_keys else shape, "dtype": dtype}
      keys = slot_keys(key, leaf) or key
      if isinstance(value, jax.Array):
        for shard in value.addressable_shards:
          if shard.replica_id == 0:
            self.shards.append((keys, shard.data, shard.index, layouts, value.shape))
      elif jax.process_index() == 0:  # a host value: the same on every process
        value = np.asarray(value)
        self.shards.append((keys, value, (slice(None),) * value.ndim, layouts, value.shape))

  def write(self, folder: Path) -> None:
    """Streams the pieces into ``shards.P.bin`` (one block in host memory at a time)."""
    process = jax.process_index()
    index = []
    with open(folder / f"shards.{process}.bin", "wb") as out:
      for keys, data, where, layouts, shape in self.shards:
        block = np.asarray(data)
        if isinstance(keys, str):
          parts = [(keys, block, where, shape, layouts)]
        else:  # a stacked param: each layer of the block is its own param's piece
          first = where[0].indices(shape[0])[0]
          parts = [(keys[first + i], block[i], where[1:], shape[1:], layer_layouts(layouts))
                   for i in range(block.shape[0])
                   if keys[first + i] is not None]  # (a pipeline's identity layer)
        for key, layer_block, layer_where, layer_shape, layer_layout in parts:
          for sl, start, box in logical_boxes(layer_where, layer_shape, layer_layout,
                                              first_copies=True):
            if math.prod(box) == 0:
              continue
            raw = np.ascontiguousarray(layer_block[sl]).tobytes()
            index.append([key, list(start), list(box), out.tell(), zlib.crc32(raw)])
            out.write(raw)
        del block, parts
      out.flush()
      os.fsync(out.fileno())
    write_json(folder / f"index.{process}.json", index)


@jax.jit
def _device_copies(arrays: list[jax.Array]) -> list[jax.Array]:
  return [jnp.copy(x) for x in arrays]


def _copy_on_device(values: list[Any]) -> list[Any]:
  arrays = [i for i, v in enumerate(values) if isinstance(v, jax.Array)]
  copies = _device_copies([values[i] for i in arrays])
  values = list(values)
  for i, c in zip(arrays, copies, strict=True):
    values[i] = c
  return values


def write_json(path: Path, obj: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f)
    f.flush()
    os.fsync(f.fileno())


def crc32_of_file(path: Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      crc = zlib.crc32(chunk, crc)
  return crc
