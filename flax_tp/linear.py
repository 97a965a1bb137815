"""Column- and row-parallel ``Dense`` layers (Megatron's ColumnParallelLinear / RowParallelLinear).

Both take ``nnx.Linear``'s arguments plus ``mesh`` and ``axis_name``, draw their
params from ``rngs`` exactly as ``nnx.Linear`` does, and store them sharded over
the model axis (padded when the axis does not divide the split dimension).
``kernel_metadata`` / ``bias_metadata`` and partitioned initializers
(``nnx.with_partitioning``) are accepted as ``flax_tp.params.sharded_param``
describes: the layer places its params itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from jax.sharding import Mesh, PartitionSpec as P

from flax_tp.collectives import (
  all_gather,
  all_reduce,
  copy_to_parallel,
  gather_to_parallel,
  reduce_scatter,
  shard_index,
)
from flax_tp.layer import ParallelModule
from flax_tp.matmul import dense_matmul
from flax_tp.mesh import MODEL_AXIS
from flax_tp.padding import masked, sum_over_replicas
from flax_tp.param_info import ParamInfo
from flax_tp.params import sharded_param
from flax_tp.partition import SegmentedLayout, ShardLayout

Array = jax.Array


def has_lora(layer: Any) -> bool:
  """Whether ``layer`` carries a LoRA adapter (``flax_tp.lora.add_lora``)."""
  return getattr(layer, "lora_a", None) is not None


class _ParallelDense(ParallelModule):
  """Params and arguments shared by both dense layers; ``split_dim`` says which."""

  split_dim: int  # 1: column (output features), 0: row (input features)

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      mesh: Mesh,
      axis_name: str = MODEL_AXIS,
      use_bias: bool = True,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      precision: Any = None,
      kernel_init: Any = default_kernel_init,
      bias_init: Any = default_bias_init,
      dot_general: Any = jax.lax.dot_general,
      promote_dtype: Any = dtypes.promote_dtype,
      preferred_element_type: Any = None,
      shard_unit: int = 1,
      layout: ShardLayout | None = None,
      rngs: nnx.Rngs,
      kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    self._init_mesh(mesh, axis_name)
    split = self.split_dim
    features = (in_features, out_features)[split]
    if layout is not None and (layout.size, layout.parts) != (features, self.parallel_size):
      raise ValueError(f"layout {layout} does not split {features} features over "
                       f"{self.parallel_size} devices")
    self.layout = layout or ShardLayout(features, self.parallel_size, shard_unit)
    # Same order of key draws as nnx.Linear: kernel, then bias.
    self.kernel = sharded_param(kernel_init, rngs.params(), (in_features, out_features),
                                param_dtype, mesh=mesh, axis_name=axis_name, dim=split,
                                layout=self.layout, metadata=kernel_metadata, name="kernel")
    if use_bias:
      # The column layer splits its bias with the outputs; the row layer adds its
      # bias once after the reduce, so every device holds all of it.
      self.bias = sharded_param(bias_init, rngs.params(), (out_features,), param_dtype,
                                mesh=mesh, axis_name=axis_name,
                                dim=0 if split == 1 else None,
                                layout=self.layout if split == 1 else None,
                                metadata=bias_metadata, name="bias")
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.dot_general = dot_general
    self.promote_dtype = promote_dtype
    self.preferred_element_type = preferred_element_type

  def _matmul(self, x: Array, kernel: Array, bias: Array | None) -> tuple[Array, Array | None]:
    """The local ``x @ kernel`` as ``nnx.Linear`` computes it (dtype promotion,
    precision, ``preferred_element_type``: the partial products a row layer sums are
    in that type, so the reduction is too), and the promoted bias."""
    x, kernel, bias = self.promote_dtype((x, kernel, bias), dtype=self.dtype)
    if self.dot_general is jax.lax.dot_general:
      # Same values; on CPU the kernel gradient takes XLA's fast dot (flax_tp/matmul.py).
      y = dense_matmul(x, kernel, precision=self.precision,
                       preferred_element_type=self.preferred_element_type,
                       cpu_gradient=self.mesh.devices.flat[0].platform == "cpu")
    else:
      # As nnx.Linear: preferred_element_type is passed only when set, so a user's
      # dot_general without that argument keeps working.
      kwargs = ({} if self.preferred_element_type is None
                else {"preferred_element_type": self.preferred_element_type})
      y = self.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                           precision=self.precision, **kwargs)
    return y, bias

  def _params(self) -> tuple[Array, Array | None]:
    kernel, bias = self.kernel[...], (self.bias[...] if self.bias is not None else None)
    if self._is_local():  # this device's blocks: checked against what the matmul needs
      shape = [self.in_features, self.out_features]
      shape[self.split_dim] = self.layout.padded_size
      kernel = self._checked_local("kernel", kernel, tuple(shape))
      if bias is not None:
        bias = self._checked_local("bias", bias, (shape[1],))
    return kernel, bias

  def _param_specs(self) -> tuple[P, P | None]:
    return (self._spec(2, self.split_dim),
            None if self.bias is None else self._spec(1, 0 if self.split_dim == 1 else None))


class ColumnParallelDense(_ParallelDense):
  """``y = x @ kernel + bias`` with ``kernel [in, out]`` split over its outputs.

  Params (global, padded): ``kernel [in, parts * out_pad]`` and ``bias
  [parts * out_pad]``, sharded over the model axis on the output dimension.

  Standalone: ``x [..., in]`` -> ``[..., out]``, equal to ``nnx.Linear``.
  Inside ``shard_map``: ``x [..., in]`` replicated over the model axis; returns
  ``[..., out]`` replicated when ``gather_output`` (all-gather, padding removed),
  else this device's padded shard ``[..., out_pad]`` (padding columns are zero),
  ready for a ``RowParallelDense(input_is_parallel=True)``.
  ``shard_unit`` splits ``out`` in whole blocks (e.g. ``head_dim``); ``layout``
  may instead give the split, e.g. a ``KVHeadLayout`` for grouped-query keys and
  values, whose replicated heads get the sum of their copies' gradients, or a
  ``SegmentedLayout`` for a fused ``[q | k | v]`` output (each part split on its own;
  standalone, the output is built from the parts' split outputs, in the form XLA
  folds for the model's way of taking it apart: ``parts_output="concat"``, their
  concatenation, for ``jnp.split``; ``"stacked"``, a ``[..., parts, size]`` stack
  reshaped, for a reshape to ``[..., parts, heads, head_dim]``; the values are the
  same, and ``parallelize`` chooses from its trace).

  ``sequence_parallel`` (Megatron's sequence parallelism): inside ``shard_map``
  ``x [..., s_local, in]`` is this device's block of the sequence (axis -2),
  all-gathered to ``[..., parts * s_local, in]`` before the matmul (backward:
  reduce-scatter). Several layers reading one input should instead share one
  ``flax_tp.gather_to_parallel`` and leave this off. Standalone, the result is
  the same either way.
  """

  split_dim = 1

  def __init__(self, in_features: int, out_features: int, *, mesh: Mesh,
               gather_output: bool = True, sequence_parallel: bool = False,
               parts_output: str = "concat", **kwargs):
    super().__init__(in_features, out_features, mesh=mesh, **kwargs)
    if parts_output not in ("concat", "stacked"):
      raise ValueError(f"parts_output must be 'concat' or 'stacked', got {parts_output!r}")
    if parts_output == "stacked" and not (isinstance(self.layout, SegmentedLayout)
                                          and len(set(self.layout.segments)) == 1):
      raise ValueError("parts_output='stacked' needs a SegmentedLayout of equal parts, got "
                       f"{self.layout}")
    self.gather_output = gather_output
    self.sequence_parallel = sequence_parallel
    self.parts_output = parts_output

  def __call__(self, inputs: Array, out_sharding: Any = None) -> Array:
    """``out_sharding``: Flax's argument, for a standalone call (see ``_standalone``)."""
    if self._is_local():
      self._out_sharding(out_sharding)  # refuses a non-None one here
      if self.sequence_parallel:
        inputs = gather_to_parallel(inputs, axis=-2, axis_name=self.axis_name)
      return self._local(*self._params(), inputs, gather=self.gather_output)
    return _plus_adapter(self, inputs, self._standalone(self._call_standalone, inputs,
                                                        inputs.ndim - 1, out_sharding))

  def _call_standalone(self, inputs: Array) -> Array:
    kernel_spec, bias_spec = self._param_specs()
    specs = (kernel_spec, bias_spec, P())
    if isinstance(self.layout, SegmentedLayout) and not self.gather_output:
      # Each segment leaves the map as its own split array, and the logical output is
      # their concatenation: code that splits it back ([q | k | v] -> q, k, v) reads
      # each part where it lies (XLA folds the slices of the concatenation).
      layouts, slots = self.layout.layouts, self.layout.slot_offsets

      def segments(k, b, x):
        y = self._local(k, b, x, gather=False, base_only=True)
        return [y[..., at:at + s.padded_size] for at, s in zip(slots, layouts, strict=True)]

      ys = self._run_standalone(segments, (*self._params(), inputs), specs,
                                [self._spec(inputs.ndim, -1)] * len(layouts), batch=2,
                                share_input=True)
      parts = [s.unpad(y, -1) for s, y in zip(layouts, ys, strict=True)]
      if self.parts_output == "stacked":
        stacked = jnp.stack(parts, axis=-2)  # [..., parts, size]
        return stacked.reshape(*stacked.shape[:-2], -1)
      return jnp.concatenate(parts, -1)
    out_spec = P() if self.gather_output else self._spec(inputs.ndim, -1)
    y = self._run_standalone(
        lambda k, b, x: self._local(k, b, x, gather=self.gather_output, base_only=True),
        (*self._params(), inputs), specs, out_spec, batch=2, share_input=True)
    return y if self.gather_output else self.layout.unpad(y, -1)

  def _local_params(self, kernel: Array, bias: Array | None) -> tuple[Array, Array | None]:
    """This device's kernel ``[in, out_pad]`` and bias as the matmul uses them:
    padding forced to zero, replicated kv heads tied to their copies' gradients."""
    kernel = masked(kernel, self.layout, 1, self.axis_name)
    if bias is not None:
      bias = masked(bias, self.layout, 0, self.axis_name)
    if self.layout.replicated:  # a KVHeadLayout storing some kv heads twice
      kernel = sum_over_replicas(kernel, self.layout, 1, self.axis_name)
      if bias is not None:
        bias = sum_over_replicas(bias, self.layout, 0, self.axis_name)
    return kernel, bias

  def _local(self, kernel: Array, bias: Array | None, x: Array, *, gather: bool,
             base_only: bool = False) -> Array:
    """``base_only``: without the adapter (a standalone call adds it outside the map)."""
    kernel, bias = self._local_params(kernel, bias)
    if has_lora(self) and not base_only:
      (y,) = _column_with_adapters((self,), [(kernel, bias)], x, kernel)
      return y if not gather else self.layout.unpad(
          all_gather(y, axis=-1, axis_name=self.axis_name), -1)
    y, bias = self._matmul(copy_to_parallel(x, self.axis_name), kernel, bias)
    if bias is not None:
      y = y + bias
    if not gather:
      return y
    return self.layout.unpad(all_gather(y, axis=-1, axis_name=self.axis_name), -1)


class RowParallelDense(_ParallelDense):
  """``y = x @ kernel + bias`` with ``kernel [in, out]`` split over its inputs.

  Params (global, padded): ``kernel [parts * in_pad, out]`` sharded over the
  model axis on the input dimension; ``bias [out]`` replicated.

  Standalone: ``x [..., in]`` -> ``[..., out]``, equal to ``nnx.Linear``.
  Inside ``shard_map``: with ``input_is_parallel`` ``x`` is this device's padded
  shard ``[..., in_pad]`` (a column layer's ``gather_output=False`` output); else
  ``x [..., in]`` is replicated and the layer takes its own slice. The partial
  products are all-reduced; the result ``[..., out]`` is replicated.

  ``sequence_parallel``: inside ``shard_map`` the partial products
  ``[..., s, out]`` are reduce-scattered over the sequence (axis -2, which the
  axis size must divide: pad it) instead of all-reduced, giving this device's
  block ``[..., s / parts, out]`` (backward: all-gather). Standalone, the
  result is the same either way.
  """

  split_dim = 0

  def __init__(self, in_features: int, out_features: int, *, mesh: Mesh,
               input_is_parallel: bool = False, sequence_parallel: bool = False, **kwargs):
    super().__init__(in_features, out_features, mesh=mesh, **kwargs)
    self.input_is_parallel = input_is_parallel
    self.sequence_parallel = sequence_parallel

  def __call__(self, inputs: Array, out_sharding: Any = None) -> Array:
    """``out_sharding``: Flax's argument, for a standalone call (see ``_standalone``)."""
    if self._is_local():
      self._out_sharding(out_sharding)  # refuses a non-None one here
      return self._local(*self._params(), inputs, parallel_input=self.input_is_parallel,
                         scatter=self.sequence_parallel)
    return _plus_adapter(self, inputs, self._standalone(self._call_standalone, inputs,
                                                        inputs.ndim - 1, out_sharding))

  def _call_standalone(self, inputs: Array) -> Array:
    # The logical input is padded and sharded on the way in, which is cheaper than
    # handing every device all of it and slicing.
    kernel_spec, bias_spec = self._param_specs()
    return self._run_standalone(
        lambda k, b, x: self._local(k, b, x, parallel_input=True, base_only=True),
        (*self._params(), self.layout.pad(inputs, -1)),
        (kernel_spec, bias_spec, self._spec(inputs.ndim, -1)), P(), batch=2)

  def _local(self, kernel: Array, bias: Array | None, x: Array, *,
             parallel_input: bool, scatter: bool = False, base_only: bool = False) -> Array:
    """``base_only``: without the adapter (a standalone call adds it outside the map)."""
    layout = self.layout
    if parallel_input:
      if x.shape[-1] != layout.padded_size:
        raise ValueError(
            f"RowParallelDense(input_is_parallel=True) expects this device's input "
            f"shard of {layout.padded_size} features (of {layout.size} over "
            f"{layout.parts}), got last dimension {x.shape[-1]}"
        )
    else:
      x = split_local(x, layout, self.axis_name)
    kernel = masked(kernel, layout, 0, self.axis_name)
    y, bias = self._matmul(x, kernel, bias)
    rank = 0
    if has_lora(self) and not base_only:  # its partial h = x @ lora_a rides the reduction
      a = masked(self._checked_local("lora_a", self.lora_a[...],
                                     (layout.padded_size, self.lora_a.shape[1])),
                 layout, 0, self.axis_name)
      h, _ = self._matmul(x, a, None)
      rank = h.shape[-1]
      y = jnp.concatenate([y, h.astype(y.dtype)], axis=-1)
    # Sum the partial products first, then add the bias once: adding it before
    # the reduce would count it parallel_size times.
    if scatter:
      if y.ndim < 2 or y.shape[-2] % self.parallel_size:
        raise ValueError(
            f"RowParallelDense(sequence_parallel=True) scatters axis -2 of its "
            f"{tuple(y.shape)} output over {self.parallel_size} devices; pad the sequence "
            f"to a multiple of {self.parallel_size}")
      y = reduce_scatter(y, axis=y.ndim - 2, axis_name=self.axis_name)
    else:
      y = all_reduce(y, "sum", self.axis_name)
    if rank:
      y, h = y[..., :-rank], y[..., -rank:]
      delta, _ = self._matmul(h, self.lora_b[...], None)
      y = y + self.lora_scaling * delta.astype(y.dtype)
    return y if bias is None else y + bias


def fused_column_parallel(layers: Sequence[ColumnParallelDense], x: Array) -> tuple[Array, ...]:
  """Several column-parallel layers reading one input, as one matmul.

  Inside ``shard_map``: ``x [..., in]`` replicated over the model axis -> each
  layer's output as ``layer(x)`` with ``gather_output=False`` gives it, this
  device's padded shard ``[..., out_pad]``. The layers' local kernels are joined
  along their outputs into one ``[in, sum(out_pad)]`` kernel, so the forward is
  one matmul and the backward one input-gradient matmul and one all-reduce (of
  ``copy_to_parallel``), however many layers (Megatron's fused q/k/v and
  gate/up projections). The params stay stored per layer: checkpoints,
  ``unshard`` and HF export see no difference. Standalone, each layer runs on
  its own.
  """
  first = layers[0]
  if len({(layer.axis_name, layer.in_features, layer.dtype, layer.precision,
           layer.preferred_element_type) for layer in layers}) != 1:
    raise ValueError("fused_column_parallel needs layers of one axis, input width, dtype, "
                     "precision and preferred_element_type")
  if not first._is_local():
    return tuple(layer(x) for layer in layers)
  if any(layer.gather_output or layer.sequence_parallel for layer in layers):
    raise ValueError("fused_column_parallel returns local shards: build the layers with "
                     "gather_output=False and without sequence_parallel")
  params = [layer._local_params(*layer._params()) for layer in layers]
  kernel = jnp.concatenate([k for k, _ in params], axis=1)
  if any(has_lora(layer) for layer in layers):
    return _column_with_adapters(layers, params, x, kernel)
  x = copy_to_parallel(x, first.axis_name)
  y, _ = first._matmul(x, kernel, None)
  widths = np.cumsum([k.shape[1] for k, _ in params])[:-1].tolist()
  outputs = []
  for layer, out, (_, bias) in zip(layers, jnp.split(y, widths, axis=-1), params, strict=True):
    if bias is not None:
      _, _, bias = layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)
      out = out + bias
    outputs.append(out)
  return tuple(outputs)


def _column_with_adapters(layers: Sequence[ColumnParallelDense], params: list,
                          x: Array, kernel: Array) -> tuple[Array, ...]:
  """Column layers (one or fused) of which some have adapters, inside a map: ``x [...,
  in]`` replicated -> each layer's local ``[..., out_pad]``.

  ``h = x @ [lora_a ...]`` is computed on the replicated input and joined to it before
  the one ``copy_to_parallel``: backward then sums the input's and ``h``'s cotangents in
  one all-reduce, and ``lora_a``'s gradient (``x^T`` times the summed cotangent) needs
  nothing more. Each adapted layer adds ``scaling * h_i @ lora_b_i`` (local outputs).
  """
  first = layers[0]
  adapted = [layer for layer in layers if has_lora(layer)]
  a = jnp.concatenate([layer.lora_a[...] for layer in adapted], axis=1)
  h, _ = first._matmul(x, a, None)
  joined = copy_to_parallel(jnp.concatenate([x, h.astype(x.dtype)], axis=-1), first.axis_name)
  x, h = joined[..., :x.shape[-1]], joined[..., x.shape[-1]:]
  y, _ = first._matmul(x, kernel, None)
  widths = np.cumsum([k.shape[1] for k, _ in params])[:-1].tolist()
  ranks = np.cumsum([layer.lora_a.shape[1] for layer in adapted])[:-1].tolist()
  hs = iter(jnp.split(h, ranks, axis=-1))
  outputs = []
  for layer, out, (_, bias) in zip(layers, jnp.split(y, widths, axis=-1), params, strict=True):
    if has_lora(layer):
      b = layer._checked_local("lora_b", layer.lora_b[...],
                               (layer.lora_b.shape[0], layer.layout.padded_size))
      b = masked(b, layer.layout, 1, layer.axis_name)
      if layer.layout.replicated:
        b = sum_over_replicas(b, layer.layout, 1, layer.axis_name)
      delta, _ = layer._matmul(next(hs), b, None)
      out = out + layer.lora_scaling * delta.astype(out.dtype)
    if bias is not None:
      _, _, bias = layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)
      out = out + bias
    outputs.append(out)
  return tuple(outputs)


def _plus_adapter(layer: Any, x: Array, y: Array) -> Array:
  """A standalone call's output ``y`` plus the layer's adapter (if any), on the logical
  (unpadded) adapter weights."""
  if not has_lora(layer):
    return y
  a = ParamInfo.of(layer.lora_a).unpad(layer.lora_a[...])
  b = ParamInfo.of(layer.lora_b).unpad(layer.lora_b[...])
  x, a, b = layer.promote_dtype((x, a, b), dtype=layer.dtype)
  delta = jnp.matmul(jnp.matmul(x, a, precision=layer.precision), b, precision=layer.precision)
  return y + layer.lora_scaling * delta.astype(y.dtype)


def split_local(x: Array, layout: ShardLayout, axis_name: str) -> Array:
  """This device's padded slice ``[..., padded_size]`` of a replicated ``x [..., size]``."""
  if x.shape[-1] != layout.size:
    raise ValueError(f"expected last dimension {layout.size}, got {x.shape[-1]}")
  index = shard_index(axis_name)
  return jax.lax.dynamic_slice_in_dim(layout.pad(x, -1), index * layout.padded_size,
                                      layout.padded_size, axis=-1)
