"""Sharded checkpoints of the logical (unpadded) state: each process writes and
reads only the shards it holds, and a checkpoint restores on any mesh and any
process count.

On disk, one folder per step::

    DIR/10/meta.json          the caller's metadata, the array table, the process count
    DIR/10/index.P.json       process P's pieces: key, logical start and shape, byte
                              offset, CRC-32 of the bytes
    DIR/10/shards.P.bin       process P's pieces, raw bytes one after another

A *piece* is the logical (padding stripped) part of one device shard: a box of
the logical array given by its start and shape. Every shard is written once,
by the device that holds replica 0 of it, so a replicated array is written once
and a sharded one once per distinct shard, without any all-gather. Restoring
builds each of this process's device blocks from the pieces that overlap its
logical region (positioned reads of only those bytes),
pads it with zeros and places it: the host holds one device block at a time.

Atomic: everything is written into ``DIR/.tmp-10/``, then (after every process
has written, through JAX's distributed barrier) process 0 writes ``meta.json``
and renames the folder to ``DIR/10``. A save interrupted at any point leaves the
earlier checkpoints as they were and no ``DIR/10``.

Checked: every piece carries the CRC-32 of its bytes and ``meta.json`` those of
the index files, so a flipped byte is refused on restore, never loaded.

Never deletes what it did not write: a step folder is removed (replaced,
rotated out by ``max_to_keep``, cleared by ``delete_all``) only as far as it
holds flax_tp's own files; a save or ``delete_all`` that would remove anything
else (a user's file in ``DIR/2/``, a folder ``DIR/12/`` that is not a
checkpoint) is refused with an error naming it, before anything is deleted.

Asynchronous saves (``Checkpointer(..., asynchronous=True)``) first copy the
arrays on their devices (the step that follows may donate the originals), then
write from a background thread while training goes on; the next ``save``,
``wait`` or ``close`` waits for it and raises its error, if any.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
import warnings
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_tp.param_info import ParamInfo
from flax_tp.partition import ShardLayout
from flax_tp.state import layer_path, stacked_layers, stored_like

FORMAT = "flax_tp/sharded-1"
BARRIER_TIMEOUT_S = 600


class CheckpointError(ValueError):
  """A checkpoint that cannot be read or does not fit the model."""


class CheckpointSaveError(RuntimeError):
  """A save that failed (disk full, unwritable folder); the earlier checkpoints are intact."""


def _is_leaf(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _part(entry: Any) -> Any:
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return getattr(entry, attr)
  return entry


def _key(path: tuple) -> str:
  return ".".join(str(_part(entry)) for entry in path)


def _flat(trees: dict[str, Any]) -> list[tuple[str, Any]]:
  """``[(key, leaf)]`` of every leaf of every named tree; Variables are leaves."""
  out = []
  for name, tree in trees.items():
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    out += [(f"{name}.{_key(path)}" if path else name, leaf) for path, leaf in flat]
  return out


def _saved_keys(key: str, leaf: Any) -> list[str] | None:
  """The per-layer keys a stacked param (``flax_tp.state.stack_layers``) is saved
  under, so stacked and unstacked models share checkpoints; None for any other leaf."""
  if stacked_layers(leaf) is None:
    return None
  parts = tuple(key.split("."))
  return [".".join(str(p) for p in layer_path(parts, leaf, i))
          for i in range(stacked_layers(leaf))]


def _layout_of(leaf: Any) -> tuple[ShardLayout | None, int | None]:
  info = ParamInfo.of(leaf)
  return info.layout, info.dim


def _value(leaf: Any) -> Any:
  return leaf[...] if isinstance(leaf, nnx.Variable) else leaf


def _logical_shape(leaf: Any) -> tuple[int, ...]:
  layout, dim = _layout_of(leaf)
  shape = list(np.shape(_value(leaf)))
  if layout is not None:
    shape[dim] = layout.size
  return tuple(shape)


def _runs(stored: slice, layout: ShardLayout | None,
          first_copies: bool = False) -> list[tuple[int, int, int]]:
  """``[(stored_start, stored_stop, logical_start)]``: the logical data in a stored range.

  Without a layout the stored range is logical. With one, each padded shard
  ``i`` of the range contributes its logical runs (``layout.runs(i)``: its first
  ``sizes[i]`` elements, or one slot per segment of a ``SegmentedLayout``); padding
  none. ``first_copies`` keeps only elements no earlier shard holds (a
  ``KVHeadLayout`` stores some kv heads on several shards; a checkpoint writes each once).
  """
  if layout is None:
    return [(stored.start, stored.stop, stored.start)]
  q, runs = layout.padded_size, []
  for i in range(stored.start // q, -(-stored.stop // q)):
    shard_runs = layout.first_copy_runs(i) if first_copies else layout.runs(i)
    for local, size, logical in shard_runs:
      lo = max(stored.start, i * q + local)
      hi = min(stored.stop, i * q + local + size)
      if hi > lo:
        runs.append((lo, hi, logical + lo - (i * q + local)))
  return runs


def _boxes(index: tuple[slice, ...], shape: tuple[int, ...], layout: ShardLayout | None,
           dim: int | None, first_copies: bool = False
           ) -> list[tuple[tuple[slice, ...], tuple[int, ...], tuple[int, ...]]]:
  """The logical boxes inside one device block of a stored array.

  ``index`` is the block's place in the stored array. Returns
  ``[(slices into the block, logical start, box shape)]``; empty when the block
  holds only padding.
  """
  index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
  per_dim = [_runs(s, layout if d == dim else None, first_copies)
             for d, s in enumerate(index)]
  boxes = [((), (), ())]
  for d, runs in enumerate(per_dim):
    base = index[d].start
    boxes = [(sl + (slice(a - base, b - base),), st + (c,), sh + (b - a,))
             for sl, st, sh in boxes for a, b, c in runs]
  return boxes


def _fsync(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _barrier(name: str) -> None:
  """All processes reach ``name`` (JAX's distributed key-value barrier; safe off the main
  thread, unlike a device collective)."""
  if jax.process_count() > 1:
    from orbax.checkpoint import multihost
    multihost.get_barrier_sync_fn()(key=name, timeout_ms=BARRIER_TIMEOUT_S * 1000)


class _Snapshot:
  """What one process writes for one step: device buffers of its replica-0 shards."""

  def __init__(self, trees: dict[str, Any], copy: bool):
    flat = _flat(trees)
    values = [_value(leaf) for _, leaf in flat]
    if copy:  # on device: the next step may donate (delete) the originals
      values = _copy_on_device(values)
    self.table: dict[str, dict[str, Any]] = {}
    # (keys, data, index, layout, dim, stored shape); ``keys`` is one key, or one
    # per layer of a stacked param (its leading axis).
    self.shards: list[tuple] = []
    for (key, leaf), value in zip(flat, values, strict=True):
      layout, dim = _layout_of(leaf)
      shape, dtype = list(_logical_shape(leaf)), jnp.dtype(value.dtype).name
      layer_keys = _saved_keys(key, leaf)
      for k in layer_keys or [key]:
        self.table[k] = {"shape": shape[1:] if layer_keys else shape, "dtype": dtype}
      keys = layer_keys or key
      if isinstance(value, jax.Array):
        for shard in value.addressable_shards:
          if shard.replica_id == 0:
            self.shards.append((keys, shard.data, shard.index, layout, dim, value.shape))
      elif jax.process_index() == 0:  # a host value: the same on every process
        value = np.asarray(value)
        self.shards.append((keys, value, (slice(None),) * value.ndim, layout, dim, value.shape))

  def write(self, folder: Path) -> None:
    """Streams the pieces into ``shards.P.bin`` (one block in host memory at a time)."""
    process = jax.process_index()
    index = []
    with open(folder / f"shards.{process}.bin", "wb") as out:
      for keys, data, where, layout, dim, shape in self.shards:
        block = np.asarray(data)
        if isinstance(keys, str):
          parts = [(keys, block, where, shape, dim)]
        else:  # a stacked param: each layer of the block is its own param's piece
          first = where[0].indices(shape[0])[0]
          parts = [(keys[first + i], block[i], where[1:], shape[1:],
                    None if dim is None else dim - 1) for i in range(block.shape[0])]
        for key, layer_block, layer_where, layer_shape, layer_dim in parts:
          for sl, start, box in _boxes(layer_where, layer_shape, layout, layer_dim,
                                       first_copies=True):
            if math.prod(box) == 0:
              continue
            raw = np.ascontiguousarray(layer_block[sl]).tobytes()
            index.append([key, list(start), list(box), out.tell(), zlib.crc32(raw)])
            out.write(raw)
        del block, parts
      out.flush()
      os.fsync(out.fileno())
    _write_json(folder / f"index.{process}.json", index)


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


def _write_json(path: Path, obj: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f)
    f.flush()
    os.fsync(f.fileno())


# What flax_tp writes into a step folder; anything else there is the user's.
_OWN_FILE = re.compile(r"(meta\.json|index\.[0-9]+\.json|shards\.[0-9]+\.bin)")
# A flax_tp 0.1.0 (orbax) step folder: its items and orbax's metadata files.
_LEGACY_ENTRY = re.compile(r"(state|meta|commit_success\.txt|_[A-Za-z_.]+)")
_OWN_FOLDER = re.compile(r"([0-9]+|\.tmp-[0-9]+|\.old-[0-9]+)")
# A step's folder name: ASCII digits without leading zeros, as save writes it.
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")


def check_step(step: Any) -> int:
  """``step`` as the int that names its folder; ``ValueError`` naming anything that is
  not a non-negative integer (numpy integers are; ``True``, ``5.0``, ``"08"`` are not)."""
  if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r} "
                     f"({type(step).__name__})")
  return int(step)


def _not_ours(folder: Path) -> Path | None:
  """The first thing in step folder ``folder`` that flax_tp did not write (``folder``
  itself when it is a numbered folder that is not a checkpoint); None when all is ours."""
  if folder.is_symlink():
    return folder  # flax_tp writes no links, and never deletes through one
  if not folder.is_dir():
    return folder if folder.exists() else None
  legacy = _is_legacy(folder)
  if folder.name.isascii() and folder.name.isdigit() and not legacy and not (
      folder / "meta.json").is_file():
    return folder  # a user's folder that happens to be named like a step
  for entry in sorted(folder.iterdir()):
    if legacy and _LEGACY_ENTRY.fullmatch(entry.name):
      continue
    if not (_OWN_FILE.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink()):
      return entry
  return None


def _crc32_of_file(path: Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      crc = zlib.crc32(chunk, crc)
  return crc


class Checkpointer:
  """Saves and restores ``{name: state tree}`` plus JSON metadata, per step.

  directory: shared by every process of a run (a shared file system across hosts).
  max_to_keep: after each save, older steps beyond this many are deleted (None: keep all).
  asynchronous: ``save`` returns once the arrays are copied on their devices; the
    write goes on in a background thread (``wait`` joins it).
  """

  def __init__(self, directory: str | Path, *, max_to_keep: int | None = 3,
               asynchronous: bool = False):
    self.directory = Path(directory).absolute()
    self.max_to_keep = max_to_keep
    self.asynchronous = asynchronous
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None

  # -- reading the directory ---------------------------------------------------

  def steps(self) -> list[int]:
    """The committed steps in the directory, oldest first."""
    if not self.directory.is_dir():
      return []
    return sorted(int(p.name) for p in self.directory.iterdir()
                  if _STEP_NAME.fullmatch(p.name) and not p.is_symlink()
                  and ((p / "meta.json").is_file() or _is_legacy(p)))

  def not_ours(self) -> list[Path]:
    """What sits where this directory's checkpoints go but was not written by flax_tp:
    a user's file inside a step folder, or a numbered folder that is not a checkpoint.
    flax_tp never deletes these; ``delete_all`` and a save over them refuse."""
    if not self.directory.is_dir():
      return []
    found = (_not_ours(p) for p in sorted(self.directory.iterdir())
             if _OWN_FOLDER.fullmatch(p.name))
    return [p for p in found if p is not None]

  def delete_all(self) -> None:
    """Deletes every checkpoint in the directory (and unfinished writes); other files stay.

    ``CheckpointError`` naming it, before anything is deleted, if a step folder
    holds something flax_tp did not write (see ``not_ours``)."""
    foreign = self.not_ours()
    if foreign:
      raise CheckpointError(_refusal(foreign[0], "delete the checkpoints"))
    if not self.directory.is_dir():
      return
    for path in self.directory.iterdir():
      if path.is_dir() and not path.is_symlink() and _OWN_FOLDER.fullmatch(path.name):
        shutil.rmtree(path)

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def _step(self, step: int | None) -> int:
    step = self.latest_step() if step is None else check_step(step)
    if step is None or step not in self.steps():
      raise CheckpointError(f"no checkpoint{'' if step is None else f' of step {step}'} "
                            f"found in {str(self.directory)!r}")
    return step

  def _read_json(self, step: int, name: str) -> Any:
    path = self.directory / str(step) / name
    try:
      return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
      raise CheckpointError(f"cannot read checkpoint step {step} in {str(self.directory)!r}: "
                            f"{name}: {type(err).__name__}: {err}") from None

  def _record(self, step: int) -> dict[str, Any]:
    """``meta.json`` of ``step``: the caller's metadata, the array table, the process count."""
    record = self._read_json(step, "meta.json")
    if not isinstance(record, dict) or record.get("format") != FORMAT:
      raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} is not a "
                            f"{FORMAT} checkpoint")
    return record

  def read_meta(self, step: int | None = None) -> dict[str, Any]:
    """The metadata saved with ``step`` (default: the latest), without the arrays."""
    step = self._step(step)
    if _is_legacy(self.directory / str(step)):
      return _legacy_read(self.directory, step, with_state=False)[1]
    return dict(self._record(step)["meta"])

  # -- saving ------------------------------------------------------------------

  def save(self, step: int, trees: dict[str, Any], meta: dict[str, Any]) -> None:
    """Writes ``trees`` and ``meta`` as checkpoint ``step`` (called by every process).

    ``step``: an integer >= 0 (``ValueError`` naming anything else)."""
    step = check_step(step)
    self.wait()
    json.dumps(meta)  # fail here, not in the background, on metadata JSON cannot hold
    for name in (str(step), f".tmp-{step}", f".old-{step}"):
      foreign = _not_ours(self.directory / name)
      if foreign is not None:  # replacing the folder would delete it
        raise CheckpointSaveError(_refusal(foreign, f"save step {step}"))
    snapshot = _Snapshot(trees, copy=self.asynchronous)
    if not self.asynchronous:
      self._commit_or_explain(step, snapshot, meta)
      return

    def work():
      try:
        self._commit_or_explain(step, snapshot, meta)
      except BaseException as err:  # surfaced by the next save/wait/close
        self._error = err

    self._thread = threading.Thread(target=work, name=f"flax_tp-save-{step}", daemon=True)
    self._thread.start()

  def wait(self) -> None:
    """Waits for an asynchronous save; raises what it failed with."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._error is not None:
      err, self._error = self._error, None
      raise err

  def close(self) -> None:
    self.wait()

  def _commit_or_explain(self, step: int, snapshot: _Snapshot, meta: dict[str, Any]) -> None:
    try:
      self._commit(step, snapshot, meta)
    except OSError as err:
      raise CheckpointSaveError(f"cannot write checkpoint step {step} in "
                                f"{str(self.directory)!r}: {err.strerror or err}") from err

  def _commit(self, step: int, snapshot: _Snapshot, meta: dict[str, Any]) -> None:
    tmp = self.directory / f".tmp-{step}"
    final = self.directory / str(step)
    tmp.mkdir(parents=True, exist_ok=True)
    snapshot.write(tmp)
    _barrier(f"flax_tp_checkpoint_{step}_written")
    if jax.process_index() == 0:
      processes = jax.process_count()
      for stale in tmp.iterdir():  # left by an earlier try with more processes
        number = stale.name.split(".")[1] if stale.name.count(".") == 2 else None
        if number is not None and number.isdigit() and int(number) >= processes:
          stale.unlink()
      index_crc32 = [_crc32_of_file(tmp / f"index.{p}.json") for p in range(processes)]
      _write_json(tmp / "meta.json", {"format": FORMAT, "step": step, "processes": processes,
                                      "arrays": snapshot.table, "index_crc32": index_crc32,
                                      "meta": meta})
      _fsync(tmp)
      if final.exists():  # the same step saved again: the new one replaces it
        old = self.directory / f".old-{step}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
      else:
        tmp.rename(final)
      _fsync(self.directory)
      if self.max_to_keep:
        self._rotate(step)
    _barrier(f"flax_tp_checkpoint_{step}_committed")

  def _rotate(self, saved: int) -> None:
    """Deletes the steps before the newest ``max_to_keep``. Step ``saved`` is written by
    now, so a step that cannot be deleted is a warning naming it, not a failed save."""
    for old_step in self.steps()[:-self.max_to_keep]:
      try:
        _rotate_out(self.directory / str(old_step))
      except OSError as err:
        warnings.warn(f"checkpoint step {saved} saved in {str(self.directory)!r}, but older "
                      f"step {old_step} could not be deleted: {err.strerror or err}; it is "
                      "kept", stacklevel=2)

  # -- restoring ---------------------------------------------------------------

  def restore(self, like: dict[str, Any], step: int | None = None) -> tuple[dict[str, Any], dict]:
    """Restores the trees named in ``like`` onto their shardings; returns (trees, meta).

    ``like`` may name a subset of the saved trees (``{"params": ...}`` alone for
    inference); each tree it names must match the saved one exactly.

    ``like`` gives each leaf's sharding, padding layout and dtype (its values
    are not used). Each process reads only what its devices hold.
    """
    step = self._step(step)
    if _is_legacy(self.directory / str(step)):
      state, meta = _legacy_read(self.directory, step, with_state=True)
      return {name: _from_logical(state, name, tree, step) for name, tree in like.items()}, meta
    record = self._record(step)
    pieces = _Pieces(self.directory / str(step), record, step)
    flat = _flat(like)
    keys = [k for key, leaf in flat for k in _saved_keys(key, leaf) or [key]]
    missing = sorted(set(keys) - set(record["arrays"]))
    # Trees not asked for (the optimizer state, when only params are wanted) are skipped.
    unexpected = sorted(k for k in set(record["arrays"]) - set(keys)
                        if k.split(".", 1)[0] in like)
    if missing or unexpected:
      raise CheckpointError(
          f"checkpoint step {step} does not match the model: missing {missing[:5]}"
          f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
          f"{' ...' if len(unexpected) > 5 else ''}")
    try:
      leaves = [pieces.restore(key, leaf) for key, leaf in flat]
    finally:
      pieces.close()
    out, at = {}, 0
    for name, tree in like.items():
      _, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_leaf)
      n = treedef.num_leaves
      out[name] = jax.tree_util.tree_unflatten(treedef, leaves[at:at + n])
      at += n
    return out, dict(record["meta"])


def describe_not_ours(path: Path) -> str:
  """``'DIR/12' is not a flax_tp checkpoint ...`` / ``'DIR/2/x' was not written by flax_tp``."""
  if path.is_symlink():
    return f"{str(path)!r} is a symbolic link, which flax_tp did not write"
  what = ("is not a flax_tp checkpoint (no meta.json)" if path.is_dir() and path.name.isdigit()
          else "was not written by flax_tp")
  return f"{str(path)!r} {what}"


def _refusal(foreign: Path, action: str) -> str:
  return (f"refusing to {action}: {describe_not_ours(foreign)}; flax_tp never deletes what "
          "it did not write: move it elsewhere, or choose another checkpoint directory")


def _rotate_out(folder: Path) -> None:
  """Deletes an old step folder, keeping whatever in it flax_tp did not write."""
  if _not_ours(folder) is None:
    shutil.rmtree(folder)
    return
  (folder / "meta.json").unlink(missing_ok=True)  # first: it stops being a checkpoint
  kept = []
  for entry in sorted(folder.iterdir()):
    if _OWN_FILE.fullmatch(entry.name) and entry.is_file():
      entry.unlink()
    else:
      kept.append(entry.name)
  warnings.warn(f"checkpoint {str(folder)!r} rotated out; kept {kept} in it, which flax_tp "
                "did not write", stacklevel=2)


class _Pieces:
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
    target = _value(leaf)
    layout, dim = _layout_of(leaf)
    expected = _logical_shape(leaf)
    layer_keys = _saved_keys(key, leaf)
    for k in layer_keys or [key]:
      saved = tuple(self.table[k]["shape"])
      want = expected[1:] if layer_keys else expected
      if saved != want:
        raise CheckpointError(f"checkpoint param {k!r}: got shape {saved}, expected {want} "
                              "(was it saved from another config?)")

    def block(where: tuple[slice, ...], shape: tuple[int, ...], dtype: Any) -> np.ndarray:
      if not layer_keys:
        return self._block(key, where, shape, layout, dim, dtype)
      # A stacked param: its layers are separate params on disk.
      layer_dim = None if dim is None else dim - 1
      first, stop = where[0].indices(shape[0])[:2]
      return np.stack([self._block(layer_keys[i], where[1:], shape[1:], layout, layer_dim,
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

  def _block(self, key, where, shape, layout, dim, dtype) -> np.ndarray:
    """One device block of the stored array: its logical data from the pieces, zero padding."""
    where = tuple(slice(*s.indices(n)[:2]) for s, n in zip(where, shape, strict=True))
    block = np.zeros([s.stop - s.start for s in where], dtype)
    needed = filled = 0
    for sl, start, box in _boxes(where, shape, layout, dim):
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


# -- checkpoints of flax_tp 0.1.0 (orbax, whole logical arrays): still restored ----

def _is_legacy(folder: Path) -> bool:
  return (folder / "state").is_dir() and (folder / "_CHECKPOINT_METADATA").is_file()


def _legacy_read(directory: Path, step: int, with_state: bool) -> tuple[dict, dict]:
  """(``{tree name: {key: logical array}}``, metadata) of a 0.1.0 checkpoint."""
  import orbax.checkpoint as ocp
  manager = ocp.CheckpointManager(directory, item_names=("state", "meta"))
  items = {"meta": ocp.args.JsonRestore()}
  if with_state:
    items["state"] = ocp.args.StandardRestore()
  try:
    restored = manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as err:  # orbax raises many types for unreadable data
    first = (str(err).splitlines() or [""])[0]
    raise CheckpointError(f"cannot read checkpoint step {step} in {str(directory)!r}: "
                          f"{type(err).__name__}: {first}") from None
  finally:
    manager.close()
  return (restored["state"] if with_state else {}), dict(restored["meta"])


def _from_logical(state: dict, name: str, like: Any, step: int) -> Any:
  """``like`` with each leaf replaced by its whole logical value, padded and sharded."""
  if name not in state:
    raise CheckpointError(f"checkpoint step {step} lacks {name!r}")
  logical = state[name]
  flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=_is_leaf)
  keys = [_key(path) for path, _ in flat]
  wanted = [k for key, (_, leaf) in zip(keys, flat, strict=True)
            for k in _saved_keys(key, leaf) or [key]]
  if set(wanted) != set(logical):
    raise CheckpointError(f"checkpoint step {step} does not match the model: missing "
                          f"{sorted(set(wanted) - set(logical))[:5]}, unexpected "
                          f"{sorted(set(logical) - set(wanted))[:5]}")
  leaves = []
  for key, (_, leaf) in zip(keys, flat, strict=True):
    layer_keys = _saved_keys(key, leaf)
    try:
      value = stored_like(leaf, np.stack([logical[k] for k in layer_keys])
                          if layer_keys else logical[key], repr(key))
    except ValueError as err:
      raise CheckpointError(f"checkpoint {err} (was it saved from another config?)") from None
    leaves.append(leaf.replace(value) if isinstance(leaf, nnx.Variable) else value)
  return jax.tree_util.tree_unflatten(treedef, leaves)
