"""``Checkpointer``: saves and restores named state trees per step, atomically."""

from __future__ import annotations

import json
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_tp.checkpoint.errors import CheckpointError, CheckpointSaveError
from flax_tp.checkpoint.keys import FORMAT, flat_leaves, is_leaf, saved_keys, value_of
from flax_tp.checkpoint.legacy import from_logical, is_legacy, legacy_read
from flax_tp.checkpoint.ownership import (
    OWN_FOLDER,
    STEP_NAME,
    check_step,
    not_ours,
    refusal,
    rotate_out,
)
from flax_tp.checkpoint.read import Pieces
from flax_tp.checkpoint.write import Snapshot, barrier, crc32_of_file, fsync, write_json


@jax.jit
def _all_finite(values: list[jax.Array]) -> jax.Array:
  """``[len(values)]`` bool: whether each array is free of NaN and infinity (one program,
  a reduction per array; replicated, so every process reads the same answer)."""
  return jnp.stack([jnp.isfinite(v).all() for v in values])


def non_finite(flat: list[tuple[str, Any]]) -> list[str]:
  """The keys of ``flat``'s floating-point leaves that hold a NaN or an infinity."""
  keyed = [(key, value_of(leaf)) for key, leaf in flat]
  keyed = [(k, v) for k, v in keyed if jnp.issubdtype(jnp.result_type(v), jnp.inexact)]
  device = [(k, v) for k, v in keyed if isinstance(v, jax.Array)]
  bad = [k for k, v in keyed if not isinstance(v, jax.Array) and not np.isfinite(v).all()]
  if device:
    finite = np.asarray(_all_finite([v for _, v in device]))
    bad += [k for (k, _), ok in zip(device, finite, strict=True) if not ok]
  return bad


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
                  if STEP_NAME.fullmatch(p.name) and not p.is_symlink()
                  and ((p / "meta.json").is_file() or is_legacy(p)))

  def not_ours(self) -> list[Path]:
    """What sits where this directory's checkpoints go but was not written by flax_tp:
    a user's file inside a step folder, or a numbered folder that is not a checkpoint.
    flax_tp never deletes these; ``delete_all`` and a save over them refuse."""
    if not self.directory.is_dir():
      return []
    found = (not_ours(p) for p in sorted(self.directory.iterdir())
             if OWN_FOLDER.fullmatch(p.name))
    return [p for p in found if p is not None]

  def delete_all(self) -> None:
    """Deletes every checkpoint in the directory (and unfinished writes); other files stay.

    ``CheckpointError`` naming it, before anything is deleted, if a step folder
    holds something flax_tp did not write (see ``not_ours``)."""
    foreign = self.not_ours()
    if foreign:
      raise CheckpointError(refusal(foreign[0], "delete the checkpoints"))
    if not self.directory.is_dir():
      return
    for path in self.directory.iterdir():
      if path.is_dir() and not path.is_symlink() and OWN_FOLDER.fullmatch(path.name):
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
    if is_legacy(self.directory / str(step)):
      return legacy_read(self.directory, step, with_state=False)[1]
    return dict(self._record(step)["meta"])

  # -- saving ------------------------------------------------------------------

  def save(self, step: int, trees: dict[str, Any], meta: dict[str, Any]) -> None:
    """Writes ``trees`` and ``meta`` as checkpoint ``step`` (called by every process).

    ``step``: an integer >= 0 (``ValueError`` naming anything else)."""
    step = check_step(step)
    self.wait()
    json.dumps(meta)  # fail here, not in the background, on metadata JSON cannot hold
    bad = non_finite(flat_leaves(trees))
    if bad:  # a diverged run's state is no checkpoint to resume or export
      raise CheckpointSaveError(
          f"refusing to save step {step} in {str(self.directory)!r}: {len(bad)} array(s) "
          f"hold NaN or infinity ({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")
    for name in (str(step), f".tmp-{step}", f".old-{step}"):
      foreign = not_ours(self.directory / name)
      if foreign is not None:  # replacing the folder would delete it
        raise CheckpointSaveError(refusal(foreign, f"save step {step}"))
    snapshot = Snapshot(trees, copy=self.asynchronous)
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

  def _commit_or_explain(self, step: int, snapshot: Snapshot, meta: dict[str, Any]) -> None:
    try:
      self._commit(step, snapshot, meta)
    except OSError as err:
      raise CheckpointSaveError(f"cannot write checkpoint step {step} in "
                                f"{str(self.directory)!r}: {err.strerror or err}") from err

  def _commit(self, step: int, snapshot: Snapshot, meta: dict[str, Any]) -> None:
    tmp = self.directory / f".tmp-{step}"
    final = self.directory / str(step)
    tmp.mkdir(parents=True, exist_ok=True)
    snapshot.write(tmp)
    barrier(f"flax_tp_checkpoint_{step}_written")
    if jax.process_index() == 0:
      processes = jax.process_count()
      for stale in tmp.iterdir():  # left by an earlier try with more processes
        number = stale.name.split(".")[1] if stale.name.count(".") == 2 else None
        if number is not None and number.isdigit() and int(number) >= processes:
          stale.unlink()
      index_crc32 = [crc32_of_file(tmp / f"index.{p}.json") for p in range(processes)]
      write_json(tmp / "meta.json", {"format": FORMAT, "step": step, "processes": processes,
                                      "arrays": snapshot.table, "index_crc32": index_crc32,
                                      "meta": meta})
      fsync(tmp)
      if final.exists():  # the same step saved again: the new one replaces it
        old = self.directory / f".old-{step}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
      else:
        tmp.rename(final)
      fsync(self.directory)
      if self.max_to_keep:
        self._rotate(step)
    barrier(f"flax_tp_checkpoint_{step}_committed")

  def _rotate(self, saved: int) -> None:
    """Deletes the steps before the newest ``max_to_keep``. Step ``saved`` is written by
    now, so a step that cannot be deleted is a warning naming it, not a failed save."""
    for old_step in self.steps()[:-self.max_to_keep]:
      try:
        rotate_out(self.directory / str(old_step))
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
    if is_legacy(self.directory / str(step)):
      state, meta = legacy_read(self.directory, step, with_state=True)
      return {name: from_logical(state, name, tree, step) for name, tree in like.items()}, meta
    record = self._record(step)
    pieces = Pieces(self.directory / str(step), record, step)
    flat = flat_leaves(like)
    keys = [k for key, leaf in flat for k in saved_keys(key, leaf) or [key]]
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
      _, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
      n = treedef.num_leaves
      out[name] = jax.tree_util.tree_unflatten(treedef, leaves[at:at + n])
      at += n
    return out, dict(record["meta"])
