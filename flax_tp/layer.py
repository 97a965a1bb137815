"""What every parallel layer shares: params on a mesh, and the two calling contexts.

A layer runs in one of two contexts, read from JAX at call time:

1. standalone (its model axis is not bound): a drop-in for the Flax layer.
   Inputs and outputs are logical global arrays; the layer wraps its local
   computation in its own ``jax.shard_map`` over its mesh.
2. inside a ``shard_map`` over the mesh (the axis is bound): Megatron semantics
   on local shards; the params seen are this device's shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from flax_tp.collectives import axis_is_bound
from flax_tp.mesh import DATA_AXIS
from flax_tp.state import partition_names, place_on_mesh


def _tracing(args: Sequence[Any]) -> bool:
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

  def _run_standalone(self, local_fn: Callable[..., Any], args: Sequence[Any],
                      in_specs: Sequence[Any], out_specs: Any, *,
                      batch: int | None = None, min_ndim: int = 2) -> Any:
    """Runs ``local_fn`` on local shards under this layer's own ``shard_map``.

    ``batch``: the index in ``args`` of the activation (ids) whose leading axis
    is the batch. When the mesh has a ``"data"`` axis that divides it (and the
    activation has at least ``min_ndim`` dims), that axis and the output's
    leading axis are split over ``"data"``, so each data replica computes only
    its rows (the params' gradients are summed over ``"data"`` by the map).
    """
    x = args[batch] if batch is not None else None
    size = self.mesh.shape.get(DATA_AXIS, 1)
    if x is not None and size > 1 and x.ndim >= min_ndim and x.shape[0] % size == 0:
      lead = lambda spec: P(DATA_AXIS, *tuple(spec)[1:])
      in_specs = [lead(s) if i == batch else s for i, s in enumerate(in_specs)]
      out_specs = lead(out_specs)
    mapped = jax.shard_map(local_fn, mesh=self.mesh, in_specs=tuple(in_specs),
                           out_specs=out_specs, check_vma=True)
    # Outside any trace, compile the map as one program: eager shard_map would
    # dispatch (and compile) every operation of the layer on its own.
    return mapped(*args) if _tracing(args) else jax.jit(mapped)(*args)

  def _spec(self, ndim: int, dim: int | None) -> P:
    """Spec of a rank-``ndim`` array split over the model axis on ``dim``."""
    return P(*partition_names(ndim, dim, self.axis_name, self.parallel_size))
