"""The norm of the logical values of stored params, without gathering them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from flax_tp.collectives import shard_index
from flax_tp.mesh import MeshAxes
from flax_tp.param_info import ParamInfo


def _sum_of_squares(value: jax.Array, weights: np.ndarray | jax.Array | None,
                    dim: int | None) -> jax.Array:
  squares = jnp.square(value)
  if weights is not None:
    shape = [1] * value.ndim
    shape[dim] = -1
    squares = squares * jnp.reshape(weights, shape).astype(squares.dtype)
  return jnp.sum(squares)


def logical_norm(tree: Any, *, contiguous: bool = False) -> jax.Array:
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

  ``contiguous`` (inside a ``shard_map``): the arrays of each group (the same axes)
  are consecutive slices of one buffer, in tree order, as the step's gradients are when
  their data-parallel sums travel packed (``copy_all_to_parallel``). Each group's squares
  are then summed as one flat array, which XLA reads from that buffer in place: two or
  three reductions for the whole model instead of one (or more) per param. Arrays that
  are not such slices give the same norm, at the cost of copying them into one array.
  A group split over a batch axis (FSDP's, reduce-scattered rather than packed) is
  summed param by param.
  """
  # (mesh, the axes it is split over) -> [(value, spec, weights, dim, axis of dim)]
  groups: dict[tuple, list] = {}
  parts = []
  replicated = []  # (contiguous, in a map) the params no axis splits, summed together
  manual_axes = set(jax.sharding.get_abstract_mesh().manual_axes)  # inside a map: its axes
  if contiguous and not manual_axes:
    raise ValueError("logical_norm(contiguous=True) sums slices of a buffer inside a "
                     "shard_map; outside one the params are separate global arrays")
  for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    value = leaf[...] if isinstance(leaf, nnx.Variable) else leaf
    info = ParamInfo.of(leaf)
    layout, dim = info.layout, info.dim
    names = info.names or ()
    axes = tuple(a for n in names if n is not None for a in ((n,) if isinstance(n, str) else n))
    if info.mesh is None or not axes:
      if contiguous:
        replicated.append(value)
      else:
        parts.append(_sum_of_squares(value, None, None))
      continue
    weights = None if layout is None else layout.replica_weights()
    groups.setdefault((info.mesh, axes), []).append(
        (value, P(*names), weights, dim, None if layout is None else names[dim]))
  for (mesh, axes), members in groups.items():
    def local_sum(*values, members=members, axes=axes):
      weighted = [_sum_of_squares(v, jnp.asarray(w)[shard_index(a)], d)
                  for v, (_, _, w, d, a) in zip(values, members, strict=True) if w is not None]
      plain = [v for v, m in zip(values, members, strict=True) if m[2] is None]
      if contiguous and plain and not set(axes) & set(MeshAxes.BATCH_ROLES):
        plain = [_flat_sum_of_squares(plain)]
      else:
        plain = [_sum_of_squares(v, None, None) for v in plain]
      return jax.lax.psum(sum(weighted + plain), axes)
    values = [m[0] for m in members]
    if set(axes) <= manual_axes:  # inside a map
      parts.append(local_sum(*values))
      continue
    # jit: one program outside a trace (eager shard_map runs op by op); inlined inside.
    parts.append(jax.jit(jax.shard_map(local_sum, mesh=mesh,
                                       in_specs=tuple(m[1] for m in members),
                                       out_specs=P(), check_vma=True))(*values))
  if replicated:
    parts.append(_flat_sum_of_squares(replicated))
  return jnp.sqrt(sum(parts)) if parts else jnp.zeros(())


def _flat_sum_of_squares(values: list[jax.Array]) -> jax.Array:
  """The sum of squares of ``values``, those of one dtype as one flat array (a packed
  buffer holds one dtype): where they are consecutive slices of one buffer, XLA folds
  the concatenation back into that buffer."""
  by_dtype: dict[Any, list[jax.Array]] = {}
  for v in values:
    by_dtype.setdefault(jnp.result_type(v), []).append(jnp.ravel(v))
  return sum(_sum_of_squares(jnp.concatenate(flat), None, None) for flat in by_dtype.values())
