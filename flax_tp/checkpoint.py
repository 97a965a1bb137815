"""Checkpoints of the logical (unpadded) state, so they restore on any mesh.

Orbax writes each step into a temporary folder and renames it when complete,
so a checkpoint on disk is whole or absent: an interrupted save leaves the last
good one untouched. What is stored holds no trace of the mesh: every sharded
array is gathered and stripped of its padding, and keyed by its path in the
state tree. Restoring pads and shards each array like the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from flax_tp.state import logical_value, stored_like


class CheckpointError(ValueError):
  """A checkpoint that cannot be read or does not fit the model."""


def _is_leaf(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _key(path: tuple) -> str:
  parts = []
  for entry in path:
    for attr in ("key", "idx", "name"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
    else:
      parts.append(str(entry))
  return ".".join(parts)


def to_logical(tree: Any) -> dict[str, np.ndarray]:
  """``{path: array}`` of every leaf, sharded ones gathered and unpadded."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
  return {_key(path): logical_value(leaf) for path, leaf in flat}


def from_logical(logical: dict[str, Any], like: Any) -> Any:
  """``like`` with every leaf replaced by ``logical[path]``, padded and sharded as it was."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=_is_leaf)
  keys = [_key(path) for path, _ in flat]
  missing = sorted(set(keys) - set(logical))
  unexpected = sorted(set(logical) - set(keys))
  if missing or unexpected:
    raise CheckpointError(
        f"checkpoint does not match the model: missing {missing[:5]}"
        f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
        f"{' ...' if len(unexpected) > 5 else ''}")
  leaves = []
  for key, (_, leaf) in zip(keys, flat, strict=True):
    try:
      value = stored_like(leaf, logical[key], repr(key))
    except ValueError as err:
      raise CheckpointError(f"checkpoint {err} (was it saved from another config?)") from None
    leaves.append(leaf.replace(value) if isinstance(leaf, nnx.Variable) else value)
  return jax.tree_util.tree_unflatten(treedef, leaves)


class Checkpointer:
  """Saves and restores ``{name: state tree}`` plus JSON metadata, per step."""

  def __init__(self, directory: str | Path, *, max_to_keep: int = 3):
    self.directory = Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, trees: dict[str, Any], meta: dict[str, Any]) -> None:
    state = {name: to_logical(tree) for name, tree in trees.items()}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def read_meta(self, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata saved with ``step`` (default: the latest), without the arrays."""
    step = self._step(step)
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as err:
      raise self._unreadable(step, err) from err
    return dict(meta["meta"])

  def _step(self, step: int | None) -> int:
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint found in {str(self.directory)!r}")
    return step

  def _unreadable(self, step: int, err: Exception) -> CheckpointError:
    first_line = str(err).splitlines()[0] if str(err) else ""
    return CheckpointError(f"cannot read checkpoint step {step} in {str(self.directory)!r}: "
                           f"{type(err).__name__}: {first_line}")

  def restore(self, like: dict[str, Any], step: int | None = None) -> tuple[dict[str, Any], dict]:
    """Restores the trees named in ``like`` onto their shardings; returns (trees, meta)."""
    step = self._step(step)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    except Exception as err:  # orbax raises many types for unreadable data
      raise self._unreadable(step, err) from err
    state = restored["state"]
    missing = sorted(set(like) - set(state))
    if missing:
      raise CheckpointError(f"checkpoint step {step} lacks {missing}")
    return {name: from_logical(state[name], tree) for name, tree in like.items()}, \
        dict(restored["meta"])

  def close(self) -> None:
    self._manager.close()
