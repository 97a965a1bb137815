"""An RMSNorm whose features are split over ``"model"``: OLMo 2/3's q/k norms.

OLMo 2 and 3 norm q and k over the whole projection (``q_norm [num_heads * head_dim]``,
``k_norm [num_kv_heads * head_dim]``), not per head. Under tensor parallelism the heads
are split over ``"model"``, so no device holds a row's features: HF's own tensor-parallel
plan gathers q and k whole for it (``colwise_gather_output``). Here each device sums the
squares of the features it holds and one all-reduce of ``[..., 1]`` per norm gives every
device the row's mean; the scale is split as the features are, and each device scales its
own. Backward, the mean's cotangent is summed over ``"model"`` by the same pairing
(``check_vma``), a second ``[..., 1]`` all-reduce.

Padding features (a head count the axis does not divide) are zero in the input, add
nothing to the sum and stay zero; a kv head stored on several devices (``KVHeadLayout``
replicating heads whose group straddles devices) is counted once, by its replica weight,
and its scale's copies get the sum of their gradients, as the k projection's do.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_tp.collectives import all_reduce, shard_index
from flax_tp.layer import ParallelModule
from flax_tp.mesh import MODEL_AXIS
from flax_tp.padding import masked, sum_over_replicas
from flax_tp.params import sharded_param
from flax_tp.partition import ShardLayout

Array = jax.Array


class SplitRMSNorm(ParallelModule):
  """``nnx.RMSNorm(num_features)`` over a last dimension split over ``axis_name``.

  ``y = x / sqrt(mean(x ** 2) + epsilon) * scale``, the mean over all ``num_features``
  (in float32, as ``nnx.RMSNorm`` reduces), whatever the split.

  Params (global, padded): ``scale [parts * features_pad]`` split as ``layout`` says
  (default ``ShardLayout(num_features, M, shard_unit)``; a ``KVHeadLayout`` for keys).

  Inside a map: ``x [..., features_pad]``, this device's features (padding zero) ->
  the same, normed over the whole row (one all-reduce of ``[..., 1]`` over
  ``axis_name``). Standalone: ``x [..., num_features]`` -> ``[..., num_features]``.
  """

  def __init__(self, num_features: int, *, mesh: jax.sharding.Mesh,
               axis_name: str = MODEL_AXIS, epsilon: float = 1e-6, dtype: Any = None,
               param_dtype: Any = jnp.float32, scale_init: Any = nnx.initializers.ones,
               shard_unit: int = 1, layout: ShardLayout | None = None, rngs: nnx.Rngs):
    self._init_mesh(mesh, axis_name)
    if layout is not None and (layout.size, layout.parts) != (num_features,
                                                               self.parallel_size):
      raise ValueError(f"layout {layout} does not split {num_features} features over "
                       f"{self.parallel_size} devices")
    self.layout = layout or ShardLayout(num_features, self.parallel_size, shard_unit)
    self.scale = sharded_param(scale_init, rngs.params(), (num_features,), param_dtype,
                               mesh=mesh, axis_name=axis_name, dim=0, layout=self.layout,
                               name="scale")
    self.num_features, self.epsilon = num_features, epsilon
    self.dtype, self.param_dtype = dtype, param_dtype

  def _weights(self) -> Array | None:
    """``[features_pad]`` float32: how much each local feature counts in the mean (1,
    0 for padding, ``1 / copies`` for a replicated kv head's); None when every local
    feature is real and held once (the padding, zero, adds nothing anyway)."""
    if not self.layout.replicated:
      return None
    local = np.asarray(self.layout.replica_weights(), np.float32).reshape(self.layout.parts, -1)
    return jnp.asarray(local)[shard_index(self.axis_name)]

  def _local(self, scale: Array, x: Array) -> Array:
    """This device's ``scale [features_pad]`` and features ``x [..., features_pad]``."""
    scale = masked(scale, self.layout, 0, self.axis_name)
    if self.layout.replicated:
      scale = sum_over_replicas(scale, self.layout, 0, self.axis_name)
    dtype = self.dtype or jnp.result_type(x.dtype, self.param_dtype)
    squares = jnp.square(x.astype(jnp.float32))
    weights = self._weights()
    if weights is not None:
      squares = squares * weights
    total = all_reduce(jnp.sum(squares, axis=-1, keepdims=True), "sum", self.axis_name)
    y = x.astype(jnp.float32) * jax.lax.rsqrt(total / self.num_features + self.epsilon)
    return (y * scale.astype(jnp.float32)).astype(dtype)

  def __call__(self, x: Array) -> Array:
    if self._is_local():
      if x.shape[-1] != self.layout.padded_size:
        raise ValueError(f"SplitRMSNorm inside a map expects this device's "
                         f"{self.layout.padded_size} features, got {tuple(x.shape)}")
      return self._local(
          self._checked_local("scale", self.scale[...], (self.layout.padded_size,)), x)
    if x.shape[-1] != self.num_features:
      raise ValueError(f"SplitRMSNorm expects inputs [..., {self.num_features}], got "
                       f"{tuple(x.shape)}")
    split = self._spec(x.ndim, x.ndim - 1)
    y = self._run_standalone(self._local, (self.scale[...], self.layout.pad(x, -1)),
                             (self._spec(1, 0), split), split)
    return self.layout.unpad(y, -1)
