"""Checkpoints of flax_tp 0.1.0 (orbax, whole logical arrays): still restored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from flax_tp.checkpoint.errors import CheckpointError
from flax_tp.checkpoint.keys import is_leaf, key_of, saved_keys
from flax_tp.logical import stored_like


def is_legacy(folder: Path) -> bool:
  return (folder / "state").is_dir() and (folder / "_CHECKPOINT_METADATA").is_file()


def legacy_read(directory: Path, step: int, with_state: bool) -> tuple[dict, dict]:
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


def from_logical(state: dict, name: str, like: Any, step: int) -> Any:
  """``like`` with each leaf replaced by its whole logical value, padded and sharded."""
  if name not in state:
    raise CheckpointError(f"checkpoint step {step} lacks {name!r}")
  logical = state[name]
  flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_leaf)
  keys = [key_of(path) for path, _ in flat]
  wanted = [k for key, (_, leaf) in zip(keys, flat, strict=True)
            for k in saved_keys(key, leaf) or [key]]
  if set(wanted) != set(logical):
    raise CheckpointError(f"checkpoint step {step} does not match the model: missing "
                          f"{sorted(set(wanted) - set(logical))[:5]}, unexpected "
                          f"{sorted(set(logical) - set(wanted))[:5]}")
  leaves = []
  for key, (_, leaf) in zip(keys, flat, strict=True):
    layer_keys = saved_keys(key, leaf)
    try:
      value = stored_like(leaf, np.stack([logical[k] for k in layer_keys])
                          if layer_keys else logical[key], repr(key))
    except ValueError as err:
      raise CheckpointError(f"checkpoint {err} (was it saved from another config?)") from None
    leaves.append(leaf.replace(value) if isinstance(leaf, nnx.Variable) else value)
  return jax.tree_util.tree_unflatten(treedef, leaves)
