"""Parallel params: created exactly as Flax creates them, then placed on the mesh.

A parallel parameter is an ``nnx.Param`` holding a global ``jax.Array`` in its stored
(padded) form, sharded over the mesh, with its placement, its ``ShardLayout`` and whether
it is stacked recorded by ``flax_tp.param_info`` (the one module that reads and writes
those keys).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import variablelib
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flax_tp.mesh import split_over
from flax_tp.param_info import (
  FLAX_TP_KEYS,
  MESH_KEY,
  MODEL_SPLIT,
  NAMES_KEY,
  ParamInfo,
  Split,
  keys_of,
)
from flax_tp.partition import ShardLayout

Initializer = Callable[..., jax.Array]


def partition_names(ndim: int, dim: int | None, axis_name: str,
                    axis_size: int) -> tuple[str | None, ...]:
  """Axis names of a rank-``ndim`` tensor split on ``dim`` (None: replicated).

  On an axis of size 1 a split is the whole tensor, so it is named replicated:
  the value then stays the same type on every device inside ``shard_map`` and
  no collective over the one-device axis is ever emitted.
  """
  names: list[str | None] = [None] * ndim
  if dim is not None:
    names[dim % ndim] = split_over(axis_name, axis_size)
  return tuple(names)


# The metadata keys flax_tp writes on its params (flax_tp.param_info, the only module
# that reads and writes them) are FLAX_TP_KEYS; a user's metadata may not set them.
# Keys that say where a param lives. The layer decides that: a user's entry is kept
# where it says what the layer does, and otherwise left out with a warning.
_PLACEMENT_KEYS = ("out_sharding", "sharding", "sharding_names", "mesh", "sharding_rules",
                   "optimizer_sharding")


def sharded_param(
    init: Initializer,
    key: jax.Array,
    shape: tuple[int, ...],
    dtype: Any,
    *,
    mesh: Mesh,
    axis_name: str,
    dim: int | None,
    unit: int = 1,
    layout: ShardLayout | None = None,
    metadata: Mapping[str, Any] | None = None,
    name: str = "param",
    variable_type: type[nnx.Param] = nnx.Param,
) -> nnx.Param:
  """Initialises a parameter exactly as Flax would, then stores it sharded.

  ``init(key, shape, dtype)`` runs once, on the full logical shape, so the values
  are bit-for-bit those of the matching Flax layer whatever the mesh. The full
  tensor is the only one materialised: each device then receives its padded
  shard (``dim``) or a replica (``dim=None``).

  ``metadata`` (a layer's ``kernel_metadata`` etc.) and the metadata of a
  partitioned initializer (``nnx.with_partitioning(init, spec)``, ``nnx.with_metadata``)
  are attached to the param (a ``variable_type``, e.g. ``nnx.LoRAParam``), as
  ``nnx.Param(value, **metadata)`` does, with two
  exceptions: the placement (``out_sharding``, ``mesh``) is the layer's own, so a
  placement entry that says otherwise (``sharding``, ``sharding_rules``,
  ``optimizer_sharding``, another spec or mesh) is left out with a warning naming
  it; and flax_tp's own keys (``FLAX_TP_KEYS``) are refused.
  """
  full = init(key, shape, dtype)
  given = {}
  if isinstance(full, variablelib.VariableMetadata):
    if (full.on_set_value or full.on_get_value or full.on_create_value or full.on_add_axis
        or full.on_remove_axis):
      raise ValueError(f"{name}: initializer hooks (on_set_value, on_add_axis, ...) are not "
                       "supported on flax_tp params")
    given, full = dict(full.metadata), full.raw_value
  given.update(metadata or {})
  if not isinstance(full, jax.core.Tracer):
    # Pad on the host: eager jax slicing and padding compile a program per shard.
    full = np.asarray(full)
  names = partition_names(len(shape), dim, axis_name, mesh.shape[axis_name])
  param_meta: dict[str, Any] = {k: v for k, v in given.items() if k not in _PLACEMENT_KEYS}
  if clash := sorted(set(param_meta) & set(FLAX_TP_KEYS)):
    raise ValueError(f"{name}: metadata {clash} is flax_tp's own (the param's layout); "
                     "choose other names")
  _check_placement(name, given, names, mesh)
  param_meta.update({NAMES_KEY: names, MESH_KEY: mesh})
  if dim is not None:
    layout = layout or ShardLayout(shape[dim], mesh.shape[axis_name], unit)
    param_meta.update(keys_of(dict(splits=(Split(MODEL_SPLIT, dim % len(shape), layout),))))
    full = layout.pad(full, dim)
  return variable_type(place(full, NamedSharding(mesh, P(*names))), **param_meta)


# What nnx itself keeps in a Variable's metadata (not the user's).
_NNX_KEYS = ("hijax", "ref", "eager_sharding", "on_get_value", "on_set_value",
             "on_create_value", "on_add_axis", "on_remove_axis")


def user_metadata(var: nnx.Variable) -> dict[str, Any]:
  """A param's metadata less nnx's own, its placement and flax_tp's keys: what a
  parallel layer that replaces the param's layer carries over (``parallelize``)."""
  skip = set(_NNX_KEYS) | set(_PLACEMENT_KEYS) | set(FLAX_TP_KEYS)
  return {k: v for k, v in var.get_metadata().items() if k not in skip}


def _check_placement(name: str, given: Mapping[str, Any], names: tuple, mesh: Mesh) -> None:
  """Warns about each placement entry of ``given`` that differs from the layer's own
  (spec ``names`` on ``mesh``); an axis of one device counts as no axis on both sides."""
  def same_spec(spec: Any) -> bool:
    try:
      theirs = tuple(P(*spec))
    except TypeError:
      return False
    if len(theirs) != len(names):
      return False
    def norm(n):
      axes = (n,) if isinstance(n, str) else tuple(n or ())
      return tuple(a for a in axes if mesh.shape.get(a, 0) != 1) or None
    return all(norm(a) == norm(b) for a, b in zip(theirs, names, strict=True))

  ignored = []
  for key in _PLACEMENT_KEYS:
    value = given.get(key)
    if value is None:
      continue
    agrees = (value == mesh if key == "mesh"
              else same_spec(value) if key in ("out_sharding", "sharding", "sharding_names",
                                               "optimizer_sharding")
              else False)
    if not agrees:
      ignored.append(f"{key}={value!r}")
  if ignored:
    warnings.warn(
        f"{name}: flax_tp places this param itself ({P(*names)} on its layer's mesh, padded "
        f"where the axis does not divide it); {', '.join(ignored)} is not used", stacklevel=4)


def place(value: jax.Array, sharding: NamedSharding) -> jax.Array:
  """Puts a stored-form global value on ``sharding``'s devices (traceable)."""
  if isinstance(value, jax.core.Tracer):
    return jax.lax.with_sharding_constraint(value, sharding)
  # Each device copies only its own block, so this works for shardings that span
  # several processes too (every process holds the same ``value``). Blocks are cut
  # from a host copy: slicing a jax array compiles a program per distinct block.
  if isinstance(value, jax.Array) and value.is_fully_addressable:
    value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def replicate_on_mesh(module: nnx.Module, mesh: Mesh) -> nnx.Module:
  """Puts every param of ``module`` that is not sharded on ``mesh``, replicated.

  Plain Flax layers inside a parallel model (LayerNorm, a position embedding)
  create their params on one device; a step that mixes them with the mesh's
  arrays needs them on the mesh. Their metadata records the mesh and an empty
  spec, so ``nnx.get_partition_spec`` says ``P()``. Returns ``module``.
  """
  for _, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    info = ParamInfo.of(var)
    if info.layout is not None or info.mesh == mesh:
      continue
    value = var[...]
    var.set_metadata(**{NAMES_KEY: (None,) * value.ndim, MESH_KEY: mesh})
    var[...] = place(value, NamedSharding(mesh, P()))
  return module


def place_on_mesh(module: nnx.Module) -> nnx.Module:
  """Puts every variable of ``module`` back on the mesh its metadata names.

  Pickling keeps a variable's metadata (mesh, partition spec, layout) but turns
  its array into a host copy; this restores the stored, sharded placement.
  Called when a flax_tp layer or model is unpickled. Returns ``module``.
  """
  for _, var in nnx.to_flat_state(nnx.state(module)):
    info = ParamInfo.of(var)
    value = var[...]
    if not isinstance(info.mesh, Mesh) or info.names is None or not hasattr(value, "shape"):
      continue
    sharding = info.sharding
    if not (isinstance(value, jax.Array) and value.sharding == sharding):
      var[...] = place(np.asarray(value), sharding)
  return module
