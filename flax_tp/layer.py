"""What every parallel layer shares: params on a mesh, and the two calling contexts.

A layer runs in one of two contexts, read from JAX at call time:

1. standalone (its model axis is not bound): a drop-in for the Flax layer.
   Inputs and outputs are logical global arrays; the layer wraps its local
   computation in its own ``jax.shard_map`` over its mesh.
2. inside a ``shard_map`` over the mesh (the axis is bound): Megatron semantics
   on local shards; the params seen are this device's shards.

A standalone call takes Flax's ``out_sharding`` argument, and works on meshes
with Explicit axes as well as Auto ones (``ParallelModule._standalone``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from flax_tp.collectives import axis_is_bound
from flax_tp.mesh import DATA_AXIS, split_over
from flax_tp.param_info import ParamInfo
from flax_tp.params import partition_names, place_on_mesh


def is_traced(args: Sequence[Any]) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))


class ParallelModule(nnx.Module):
  """Base of the parallel layers: holds ``mesh`` and ``axis_name``."""

  mesh: Mesh
  axis_name: str

  def _init_mesh(self, mesh: Mesh, axis_name: str) -> None:
    if not isinstance(mesh, jax.sharding.Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh (see flax_tp.make_mesh), got {mesh!r}")
    if axis_name not in mesh.axis_names:
      raise ValueError(
          f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    if len(set(mesh.axis_types)) > 1:
      raise ValueError(
          f"mesh axis types {tuple(t.name for t in mesh.axis_types)} mix kinds: flax_tp layers "
          "take a mesh whose axes are all Auto (flax_tp.make_mesh) or all Explicit")
    self.mesh = mesh
    self.axis_name = axis_name

  def __setstate__(self, state):
    # Unpickled arrays are host copies: put the params back in their shards.
    super().__setstate__(state)
    place_on_mesh(self)

  @property
  def parallel_size(self) -> int:
    """Number of devices along the model axis."""
    return self.mesh.shape[self.axis_name]

  def _is_local(self) -> bool:
    return axis_is_bound(self.axis_name)

  def _checked_local(self, name: str, value: jax.Array, expected: tuple[int, ...]) -> jax.Array:
    """Param ``name``'s block ``value`` on this device inside a map, which must be
    ``expected``: a param FSDP split over ``"data"`` and not gathered (a model that
    runs its blocks without ``gather_block``) is an error saying what to call, never a
    wrong matmul."""
    if tuple(value.shape) == tuple(expected):
      return value
    var = getattr(self, name)
    hint = ""
    if ParamInfo.of(var).over_data:
      hint = (f"; it is split over {DATA_AXIS!r} (FSDP) and was not gathered: run the "
              f"blocks through flax_tp.remat.run_blocks, or gather each block's params "
              f"with flax_tp.data_parallel.gather_block (the step's params with "
              f"gather_for_step) before calling it")
    raise ValueError(f"{type(self).__name__}.{name} is {tuple(value.shape)} on this device, "
                     f"expected {tuple(expected)}{hint}")

  def _standalone(self, compute: Callable[[Any], Any], x: Any, batch_dims: int,
                  out_sharding: Any) -> jax.Array:
    """A standalone call, ``compute(x)`` (the logical output), placed as Flax places it.

    ``out_sharding`` is Flax's argument: ``None``, or a ``PartitionSpec`` (of this
    layer's mesh) or ``NamedSharding`` the output is placed on. On a mesh with
    Explicit axes the output's type is the one the Flax layer gives: ``x``'s sharding
    on its first ``batch_dims`` dims and the last (feature) dim replicated, unless
    ``out_sharding`` says otherwise. ``compute`` then runs under
    ``jax.sharding.auto_axes``: its pads, maps and unpads are the Auto-mesh ones,
    and the maps run over an Auto copy of the mesh (``map_mesh``).
    """
    sharding = self._out_sharding(out_sharding)
    if self.mesh.axis_types[0] != AxisType.Explicit:
      y = compute(x)
      return y if sharding is None else jax.lax.with_sharding_constraint(y, sharding)
    if sharding is None:
      spec = tuple(getattr(jax.typeof(x).sharding, "spec", ()))
      spec = (spec + (None,) * x.ndim)[:batch_dims]
      sharding = NamedSharding(self.mesh, P(*spec, None))
    return jax.sharding.auto_axes(compute, out_sharding=sharding)(x)

  def _out_sharding(self, out_sharding: Any) -> NamedSharding | None:
    if out_sharding is None:
      return None
    if self._is_local():
      raise ValueError(
          f"out_sharding={out_sharding!r}: inside shard_map a layer returns this device's "
          "values; out_sharding places the output of a standalone call")
    if isinstance(out_sharding, NamedSharding):
      return out_sharding
    if isinstance(out_sharding, (P, tuple, list)):
      return NamedSharding(self.mesh, P(*out_sharding))
    raise TypeError(f"out_sharding must be None, a PartitionSpec or a NamedSharding, got "
                    f"{out_sharding!r}")

  def _run_standalone(self, local_fn: Callable[..., Any], args: Sequence[Any],
                      in_specs: Sequence[Any], out_specs: Any, *,
                      batch: int | None = None, min_ndim: int = 2,
                      share_input: bool = False) -> Any:
    """Runs ``local_fn`` on local shards under this layer's own ``shard_map``.

    ``batch``: the index in ``args`` of the activation (ids) whose leading axis
    is the batch; the other array arguments are params. When the mesh has a
    ``"data"`` axis that divides the batch (and the activation has at least
    ``min_ndim`` dims), that axis and the output's leading axis are split over
    ``"data"``, so each data replica computes only its rows.

    Traced (under ``jit`` or a gradient), gradient sums go through shared
    per-device copies (``per_device_copies``) instead of each map's own:
    the params are read as copies per data replica, so a param used by several
    layers (a tied embedding) has its gradient summed over ``"data"`` once; and
    with ``share_input`` the activation (replicated over the model axis) is read
    as copies per model device, so the column layers reading one input sum
    their input gradients before one all-reduce.
    """
    args, in_specs = list(args), list(in_specs)
    mesh = map_mesh(self.mesh)
    split = batch is not None and self._splits_batch(args[batch], min_ndim)
    data = (DATA_AXIS,) if split else ()
    if split:  # one spec, or a list of them (one per output)
      out_specs = ([P(DATA_AXIS, *tuple(s)[1:]) for s in out_specs]
                   if isinstance(out_specs, list) else P(DATA_AXIS, *tuple(out_specs)[1:]))
    if not is_traced(args):
      # No gradient to share. Compile the map as one program: eager shard_map
      # would dispatch (and compile) every operation of the layer on its own.
      if split:
        in_specs[batch] = P(DATA_AXIS, *tuple(in_specs[batch])[1:])
      return jax.jit(jax.shard_map(local_fn, mesh=mesh, in_specs=tuple(in_specs),
                                   out_specs=out_specs, check_vma=True))(*args)
    copied = []  # arguments passed as [copies, ...]: the map takes copy [0]
    for i, (arg, spec) in enumerate(zip(args, in_specs, strict=True)):
      if i == batch:
        if share_input and tuple(spec) == () and self.parallel_size > 1:
          args[i] = per_device_copies(arg, mesh, self.axis_name, P(*data))
          in_specs[i] = P(self.axis_name, *data)
          copied.append(i)
        elif split:
          in_specs[i] = P(DATA_AXIS, *tuple(spec)[1:])
      elif split and arg is not None:
        args[i] = per_device_copies(arg, mesh, DATA_AXIS, spec)
        in_specs[i] = P(DATA_AXIS, *spec)
        copied.append(i)

    def local(*local_args):
      return local_fn(*(a[0] if i in copied else a for i, a in enumerate(local_args)))

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs),
                         out_specs=out_specs, check_vma=True)(*args)

  def _splits_batch(self, x: Any, min_ndim: int = 2) -> bool:
    """Whether the standalone map splits ``x``'s leading (batch) axis over ``"data"``."""
    size = self.mesh.shape.get(DATA_AXIS, 1)
    return (split_over(DATA_AXIS, size) is not None and x.ndim >= min_ndim
            and x.shape[0] % size == 0)

  def _spec(self, ndim: int, dim: int | None) -> P:
    """Spec of a rank-``ndim`` array split over the model axis on ``dim``."""
    return P(*partition_names(ndim, dim, self.axis_name, self.parallel_size))


@functools.cache
def map_mesh(mesh: Mesh) -> Mesh:
  """The mesh a standalone layer's ``shard_map`` runs over: ``mesh`` itself when its
  axes are Auto; for Explicit axes an Auto copy of it (same devices and names), as
  the standalone call runs under ``jax.sharding.auto_axes``."""
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


class _Copies:
  """The per-device copies of one array, kept while that array is alive."""

  def __init__(self, x: jax.Array, key: tuple, copies: jax.Array):
    def forget(ref: weakref.ref) -> None:  # x is gone: so is any use of its copies
      if (entry := _COPIES.get(key)) is not None and entry.x is ref:
        del _COPIES[key]

    self.x = weakref.ref(x, forget)
    self.trace = jax.extend.core.get_opaque_trace_state()
    self.copies = copies


# (id of the array, mesh, axis, its spec) -> its copies; an entry lives as long
# as the array it copies (a traced value: until its trace is done).
_COPIES: dict[tuple, _Copies] = {}


def per_device_copies(x: jax.Array, mesh: Mesh, axis_name: str, spec: P) -> jax.Array:
  """``x`` (global, laid out by ``spec`` and replicated over ``axis_name``) as
  ``[parts, *x.shape]``, sharded over ``axis_name`` on the new leading axis: one
  copy per device of that axis.

  Identity in the forward pass, with no communication. In the backward pass the
  copies' cotangents are summed with one all-reduce over ``axis_name``: Megatron's
  ``f`` (or data parallelism's gradient sum) hoisted out of the layers' maps. The
  layers that read the same ``x`` in one trace get the same copies (they are
  kept while ``x`` lives, and reused within the trace that made them), so
  autodiff adds their per-device cotangents first and one all-reduce sends the
  sum: q, k and v (or gate and up) share one for their input gradient, and a
  tied embedding's two uses one for its gradient over ``"data"``.
  """
  key = (id(x), mesh, axis_name, spec)
  entry = _COPIES.get(key)
  if (entry is not None and entry.x() is x
      and entry.trace == jax.extend.core.get_opaque_trace_state()):
    return entry.copies
  fan_out = jax.shard_map(lambda v: jax.lax.pcast(v[None], axis_name, to="varying"),
                          mesh=mesh, in_specs=spec, out_specs=P(axis_name, *spec),
                          check_vma=True)
  copies = fan_out(x)
  _COPIES[key] = _Copies(x, key, copies)
  return copies
