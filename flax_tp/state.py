"""Sharded parameters: creating them, and converting to and from dense Flax state.

A parallel parameter is an ``nnx.Param`` holding a global ``jax.Array`` in its
stored (padded) form, sharded over the mesh's model axis, with metadata:

its placement, its ``ShardLayout`` and whether it is stacked, as ``flax_tp.param_info``
records them (the one module that reads and writes those keys). ``unshard``,
``load_unsharded`` and checkpoints name and store a stacked param as one param per
layer, so stacked and unstacked models share names and checkpoints.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import variablelib
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flax_tp.collectives import all_reduce, shard_index
from flax_tp.param_info import FLAX_TP_KEYS, MESH_KEY, NAMES_KEY, ParamInfo, keys_of, record
from flax_tp.partition import KVHeadLayout, ShardLayout

Initializer = Callable[..., jax.Array]


def partition_names(ndim: int, dim: int | None, axis_name: str,
                    axis_size: int) -> tuple[str | None, ...]:
  """Axis names of a rank-``ndim`` tensor split on ``dim`` (None: replicated).

  On an axis of size 1 a split is the whole tensor, so it is named replicated:
  the value then stays the same type on every device inside ``shard_map`` and
  no collective over the one-device axis is ever emitted.
  """
  names: list[str | None] = [None] * ndim
  if dim is not None and axis_size > 1:
    names[dim % ndim] = axis_name
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
) -> nnx.Param:
  """Initialises a parameter exactly as Flax would, then stores it sharded.

  ``init(key, shape, dtype)`` runs once, on the full logical shape, so the values
  are bit-for-bit those of the matching Flax layer whatever the mesh. The full
  tensor is the only one materialised: each device then receives its padded
  shard (``dim``) or a replica (``dim=None``).

  ``metadata`` (a layer's ``kernel_metadata`` etc.) and the metadata of a
  partitioned initializer (``nnx.with_partitioning(init, spec)``, ``nnx.with_metadata``)
  are attached to the param, as ``nnx.Param(value, **metadata)`` does, with two
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
    param_meta.update(keys_of(dict(layout=layout, dim=dim % len(shape))))
    full = layout.pad(full, dim)
  return nnx.Param(place(full, NamedSharding(mesh, P(*names))), **param_meta)


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


def _is_param(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _sum_of_squares(value: jax.Array, weights: np.ndarray | jax.Array | None,
                    dim: int | None) -> jax.Array:
  squares = jnp.square(value)
  if weights is not None:
    shape = [1] * value.ndim
    shape[dim] = -1
    squares = squares * jnp.reshape(weights, shape).astype(squares.dtype)
  return jnp.sum(squares)


def logical_norm(tree: Any) -> jax.Array:
  """The L2 norm of the logical values of ``tree``: what ``optax.tree.norm`` gives on
  ``unshard(tree)``, without gathering anything.

  ``tree``: params or their gradients as flax_tp stores them (an ``nnx.State`` of
  params with their metadata, global arrays on the mesh; plain arrays count as they
  are). Padding is zero and adds nothing; a kv head replicated over several devices
  (``KVHeadLayout``) is stored once per copy, and each copy counts ``1 / copies``, so
  the head counts once. The norm of the stored arrays would count it once per copy,
  and gradient clipping would then scale a GQA model's step differently on each
  mesh. The sharded params' squares are summed on their devices and then over the
  model axis with one scalar all-reduce (the partitioner would send one per param).
  """
  # (mesh, the axes it is split over) -> [(value, spec, weights, dim, axis of dim)]
  groups: dict[tuple, list] = {}
  parts = []
  for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    value = leaf[...] if isinstance(leaf, nnx.Variable) else leaf
    info = ParamInfo.of(leaf)
    layout, dim = info.layout, info.dim
    names = info.names or ()
    axes = tuple(a for n in names if n is not None for a in ((n,) if isinstance(n, str) else n))
    if info.mesh is None or not axes:
      parts.append(_sum_of_squares(value, None, None))
      continue
    weights = None if layout is None else layout.replica_weights()
    groups.setdefault((info.mesh, axes), []).append(
        (value, P(*names), weights, dim, None if layout is None else names[dim]))
  for (mesh, axes), members in groups.items():
    def local_sum(*values, members=members, axes=axes):
      total = sum(_sum_of_squares(v, None if w is None else jnp.asarray(w)[shard_index(a)], d)
                  for v, (_, _, w, d, a) in zip(values, members, strict=True))
      return jax.lax.psum(total, axes)
    values = [m[0] for m in members]
    if set(axes) <= set(jax.sharding.get_abstract_mesh().manual_axes):  # inside a map
      parts.append(local_sum(*values))
      continue
    # jit: one program outside a trace (eager shard_map runs op by op); inlined inside.
    parts.append(jax.jit(jax.shard_map(local_sum, mesh=mesh,
                                       in_specs=tuple(m[1] for m in members),
                                       out_specs=P(), check_vma=True))(*values))
  return jnp.sqrt(sum(parts)) if parts else jnp.zeros(())


def gather_to_host(value: jax.Array) -> np.ndarray:
  """The whole value of a global array on this host."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.asarray(value)


def _layout_of(leaf: Any) -> tuple[ShardLayout | None, int | None]:
  """The ``ShardLayout`` and split dim of a sharded param; (None, None) otherwise."""
  info = ParamInfo.of(leaf)
  return info.layout, info.dim


def logical_value(leaf: nnx.Variable | jax.Array) -> np.ndarray:
  """The whole, unpadded value of a param (or plain array) on this host."""
  layout, dim = _layout_of(leaf)
  value = gather_to_host(leaf[...] if isinstance(leaf, nnx.Variable) else leaf)
  return layout.unpad(value, dim) if layout is not None else value


def stored_like(leaf: nnx.Variable | jax.Array, logical: Any, name: Any = "") -> jax.Array:
  """``logical`` padded and sharded like the stored ``leaf`` (a param or plain array).

  The inverse of ``logical_value``; ``ValueError`` naming ``name`` on a shape
  that does not fit.
  """
  layout, dim = _layout_of(leaf)
  target = leaf[...] if isinstance(leaf, nnx.Variable) else leaf
  value = np.asarray(logical).astype(target.dtype)
  expected = list(target.shape)
  if layout is not None:
    expected[dim] = layout.size
  if list(value.shape) != expected:
    raise ValueError(
        f"param {name}: got shape {tuple(value.shape)}, expected {tuple(expected)}")
  if layout is not None:
    value = layout.pad(value, dim)
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


# -- layers stacked on a leading axis (scanned models) ---------------------------

def stacked_layers(var: Any) -> int | None:
  """How many layers a stacked param holds; None for an ordinary param."""
  return ParamInfo.of(var).layers


def layer_path(path: tuple, var: nnx.Variable, layer: int) -> tuple:
  """The per-layer path of layer ``layer`` of the stacked param ``var`` at ``path``.

  ``path`` may carry any prefix (``("params", ...)``, an optimizer state's
  ``(0, "mu", ...)``): the layer number goes before the param's path inside the
  stacked module, which is counted from the end.
  """
  at = len(path) + ParamInfo.of(var).layer_at
  return tuple(path[:at]) + (layer,) + tuple(path[at:])


def per_layer_paths(path: tuple, var: Any) -> list[tuple]:
  """``[path]`` for an ordinary param; each layer's path for a stacked one."""
  layers = stacked_layers(var)
  return [path] if layers is None else [layer_path(path, var, i) for i in range(layers)]


@functools.cache
def _stacker(sharding: NamedSharding) -> Callable[..., jax.Array]:
  return jax.jit(lambda *values: jnp.stack(values), out_shardings=sharding)


def stack_layers(modules: Sequence[nnx.Module]) -> nnx.Module:
  """One module whose params hold ``modules``' params stacked on a new leading axis.

  ``modules`` have one structure and live on one mesh (every param carries its
  ``mesh`` and ``out_sharding``, as parallel layers' and ``replicate_on_mesh``'s
  do). The first module is reused: each of its params becomes ``[layers, ...]``,
  its spec gains a leading ``None`` and its split dim moves by one. A
  ``jax.lax.scan`` over the stacked state then runs the layers in order, and the
  optimizer sees one array per kind of param, not one per layer.
  Returns the first module.
  """
  if not modules:
    raise ValueError("stack_layers needs at least one module")
  flats = [dict(nnx.to_flat_state(nnx.state(m, nnx.Param))) for m in modules]
  for path, var in flats[0].items():
    info = ParamInfo.of(var)
    if info.mesh is None or info.names is None:
      raise ValueError(f"param {path} is not on a mesh (see replicate_on_mesh)")
    if info.is_stacked:
      raise ValueError(f"param {path} is already stacked")
    names = (None,) + info.names
    var.set_value(_stacker(NamedSharding(info.mesh, P(*names)))(
        *[flat[path][...] for flat in flats]))
    record(var, names=names, layers=len(modules), layer_at=-len(path),
           **({} if info.dim is None else {"dim": info.dim + 1}))
  return modules[0]


@functools.partial(jax.jit, donate_argnums=0)
def _update_layer(stacked: jax.Array, value: jax.Array, layer: jax.Array) -> jax.Array:
  return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), layer, 0)


def set_layer(var: nnx.Variable, layer: int, logical: Any, name: Any = "") -> None:
  """Sets layer ``layer`` of the stacked param ``var`` to ``logical`` (its whole,
  unpadded per-layer value), in place; the host holds one layer's value.

  ``ValueError`` naming ``name`` on a shape that does not fit.
  """
  info = ParamInfo.of(var)
  stacked = var[...]
  expected = list(stacked.shape[1:])
  layout, dim = info.layout, info.dim
  if layout is not None:
    expected[dim - 1] = layout.size
  value = np.asarray(logical).astype(stacked.dtype)
  if list(value.shape) != expected:
    raise ValueError(
        f"param {name}: got shape {tuple(value.shape)}, expected {tuple(expected)}")
  if layout is not None:
    value = layout.pad(value, dim - 1)
  sharding = NamedSharding(info.mesh, P(*info.names[1:]))
  var.set_value(_update_layer(stacked, place(value, sharding), jnp.int32(layer)))


def masked(param: jax.Array, layout: ShardLayout, dim: int, axis_name: str) -> jax.Array:
  """This device's shard of a parameter with its padding forced to zero.

  Called on local shards inside ``shard_map``. Selecting zeros through a mask
  (rather than trusting the stored zeros) makes the gradient of every padded element
  exactly zero, so no optimizer (weight decay, Adam's moments) can move it.
  A no-op for even layouts.
  """
  if layout.is_even:
    return param
  mask = layout.local_mask(shard_index(axis_name))
  shape = [1] * param.ndim
  shape[dim] = layout.padded_size
  return jnp.where(mask.reshape(shape), param, jnp.zeros((), param.dtype))


def sum_over_replicas(param: jax.Array, layout: KVHeadLayout, dim: int,
                      axis_name: str) -> jax.Array:
  """Identity forward; backward, each stored copy gets the sum of all copies' gradients.

  ``param`` is this device's shard (inside ``shard_map``) of a parameter laid
  out by a replicating ``KVHeadLayout``. Each device's gradient covers only the
  query heads it holds; summing over the copies gives every copy the gradient of
  the logical parameter, so the copies stay bitwise equal under any optimizer.
  Costs one all-reduce of the logical parameter's size in the backward pass.
  """
  # [parts, padded_size]; numpy, not a traced constant: the backward may run in
  # another trace (under jax.checkpoint, the recomputation's).
  table = layout.stored_positions()

  @jax.custom_vjp
  def tie(x):
    return x

  def backward(_, grad):
    positions = jnp.asarray(table)[shard_index(axis_name)]  # padding -> slot ``size``
    moved = jnp.moveaxis(grad, dim, 0)
    logical = jnp.zeros((layout.size + 1,) + moved.shape[1:], grad.dtype)
    logical = all_reduce(logical.at[positions].add(moved), "sum", axis_name)
    summed = jnp.where((positions < layout.size).reshape((-1,) + (1,) * (moved.ndim - 1)),
                       logical[positions], jnp.zeros((), grad.dtype))
    return (jnp.moveaxis(summed, 0, dim),)

  tie.defvjp(lambda x: (x, None), backward)
  return tie(param)
