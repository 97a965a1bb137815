"""How a checkpoint names what it holds: the format, and one key per array.

A leaf of a saved tree is named ``TREE.PATH`` (``params.blocks.0.attn.q.kernel``); a
stacked param (``flax_tp.stack_layers``) is saved as one array per layer, under the
per-layer keys, so stacked and unstacked models share checkpoints. Each array is stored
logical (padding stripped), so its shape is the logical one.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from flax_tp.param_info import ParamInfo
from flax_tp.partition import ShardLayout
from flax_tp.stack import layer_path, stacked_layers

FORMAT = "flax_tp/sharded-1"


def is_leaf(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _part(entry: Any) -> Any:
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return getattr(entry, attr)
  return entry


def key_of(path: tuple) -> str:
  return ".".join(str(_part(entry)) for entry in path)


def flat_leaves(trees: dict[str, Any]) -> list[tuple[str, Any]]:
  """``[(key, leaf)]`` of every leaf of every named tree; Variables are leaves."""
  out = []
  for name, tree in trees.items():
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    out += [(f"{name}.{key_of(path)}" if path else name, leaf) for path, leaf in flat]
  return out


def saved_keys(key: str, leaf: Any) -> list[str] | None:
  """The per-layer keys a stacked param (``flax_tp.stack_layers``) is saved
  under, in layer order, so stacked, unstacked and pipelined models share checkpoints;
  None for any other leaf."""
  if stacked_layers(leaf) is None:
    return None
  parts = tuple(key.split("."))
  return [".".join(str(p) for p in layer_path(parts, leaf, i))
          for i in range(stacked_layers(leaf))]


def slot_keys(key: str, leaf: Any) -> list[str | None] | None:
  """``saved_keys`` in the order of the stacked param's leading axis (pipeline stages
  store their layers in their own order, ``flax_tp.pipeline``), None for a slot holding
  an identity layer, which is not saved."""
  keys = saved_keys(key, leaf)
  slots = ParamInfo.of(leaf).layer_slots
  if keys is None or slots is None:
    return keys
  return [None if layer is None else keys[layer] for layer in slots]


def layout_of(leaf: Any) -> dict[int, ShardLayout]:
  """The layout of each padded dimension of ``leaf``'s stored array, by dimension."""
  return {split.dim: split.layout for split in ParamInfo.of(leaf).padded}


def layer_layouts(layouts: dict[int, ShardLayout]) -> dict[int, ShardLayout]:
  """A stacked param's layouts as one layer's slice has them (its dims shift by one)."""
  return {dim - 1: layout for dim, layout in layouts.items()}


def value_of(leaf: Any) -> Any:
  return leaf[...] if isinstance(leaf, nnx.Variable) else leaf


def logical_shape(leaf: Any) -> tuple[int, ...]:
  return ParamInfo.of(leaf).logical_shape(np.shape(value_of(leaf)))
