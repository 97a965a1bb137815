"""The norm of the logical values of stored params, without gathering them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from flax_tp.collectives import shard_index
from flax_tp.param_info import ParamInfo


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
