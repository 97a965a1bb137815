"""What a layer does to its stored params inside a map before using them: padding held
at zero (so no optimizer moves it), replicated kv heads tied to their copies."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_tp.collectives import all_reduce, shard_index
from flax_tp.partition import KVHeadLayout, ShardLayout


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
