"""Logical values <-> stored params: whole and unpadded on the host, or padded and
sharded on the mesh."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_tp.param_info import ParamInfo
from flax_tp.params import place
from flax_tp.stack import layer_path, per_layer_paths, set_layer, stacked_layers


def gather_to_host(value: jax.Array) -> np.ndarray:
  """The whole value of a global array on this host."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.asarray(value)


def logical_value(leaf: nnx.Variable | jax.Array) -> np.ndarray:
  """The whole, unpadded value of a param (or plain array) on this host."""
  value = gather_to_host(leaf[...] if isinstance(leaf, nnx.Variable) else leaf)
  return ParamInfo.of(leaf).unpad(value)


def stored_like(leaf: nnx.Variable | jax.Array, logical: Any, name: Any = "") -> jax.Array:
  """``logical`` padded and sharded like the stored ``leaf`` (a param or plain array).

  The inverse of ``logical_value``; ``ValueError`` naming ``name`` on a shape
  that does not fit.
  """
  info = ParamInfo.of(leaf)
  target = leaf[...] if isinstance(leaf, nnx.Variable) else leaf
  value = np.asarray(logical).astype(target.dtype)
  expected = list(info.logical_shape(target.shape))
  if list(value.shape) != expected:
    raise ValueError(
        f"param {name}: got shape {tuple(value.shape)}, expected {tuple(expected)}")
  value = info.pad(value)
  return place(value, target.sharding) if isinstance(target, jax.Array) else value


def _plain_variable(var: nnx.Variable, value: np.ndarray) -> nnx.Variable:
  # On the default device, off the mesh: a plain Flax module can use it directly.
  value = jnp.asarray(value)
  return nnx.Param(value) if isinstance(var, nnx.Param) else type(var)(value)


def unshard(module_or_state: nnx.Module | nnx.State) -> nnx.State:
  """The logical (unpadded) params, named and nested as the matching Flax module's.

  Returns an ``nnx.State`` of plain ``nnx.Param``s holding the whole values (no
  padding, no sharding metadata), so that
  ``nnx.update(flax_module, unshard(parallel_module))`` works. Accepts a module
  (its ``nnx.Param`` state is taken) or a state. A stacked param
  (``stack_layers``) becomes one param per layer, at its per-layer path.
  """
  state = (nnx.state(module_or_state, nnx.Param)
           if isinstance(module_or_state, nnx.Module) else module_or_state)
  flat = []
  for path, var in nnx.to_flat_state(state):
    value = logical_value(var)
    layers = stacked_layers(var)
    if layers is None:
      flat.append((path, _plain_variable(var, value)))
    else:
      flat += [(layer_path(path, var, i), _plain_variable(var, value[i]))
               for i in range(layers)]
  return nnx.from_flat_state(flat)


def load_unsharded(module: nnx.Module, source: nnx.Module | nnx.State) -> None:
  """Loads dense (Flax) params into a parallel module, in place.

  ``source`` is a Flax module or a state with the names ``unshard`` gives (for
  example a plain ``nnx.Linear`` for a ``ColumnParallelDense``). Each value is
  padded and sharded like the parameter it replaces.
  """
  dense = nnx.state(source, nnx.Param) if isinstance(source, nnx.Module) else source
  dense_paths = dict(nnx.to_flat_state(dense))
  targets = nnx.to_flat_state(nnx.state(module, nnx.Param))
  wanted = {p: path for path, var in targets for p in per_layer_paths(path, var)}
  if set(wanted) != set(dense_paths):
    missing = sorted(set(wanted) - set(dense_paths))
    extra = sorted(set(dense_paths) - set(wanted))
    raise ValueError(f"param names differ: missing {missing}, unexpected {extra}")
  for path, var in targets:
    if stacked_layers(var) is None:
      var[...] = stored_like(var, dense_paths[path][...], path)
    else:
      for layer, p in enumerate(per_layer_paths(path, var)):
        set_layer(var, layer, dense_paths[p][...], p)
