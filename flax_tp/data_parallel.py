"""The data axis: data parallelism and fully sharded data parallelism (ZeRO-3) over
``"data"``, beside tensor parallelism over ``"model"``.

Data parallelism: inside the step's ``shard_map`` each replicated param is marked
per-replica once (``gather_for_step``), so backward sums its gradient locally (a tied
embedding is used twice) and all-reduces it over ``"data"`` once (on XLA:CPU the
trained params' all-reduces packed into a few arrays: ``copy_all_to_parallel``).

With tensor parallelism alone every data replica holds whole copies of its model
shard's params, gradients and optimizer state. ``shard_over_data`` splits each param
once more, over the ``"data"`` axis, on its *FSDP dimension*: the largest dimension,
other than the one split over ``"model"``, that the data axis divides. A param that
tensor parallelism leaves whole (a norm's scale) is split over both axes when their
``D * M`` devices divide it; one split over ``"model"`` on its only dimension (a column
layer's bias) has each model shard split over ``"data"``. The optimizer's moments
follow the params' sharding, so params, gradients and Adam state all take
``1 / (D * M)`` of the whole per device.

On a mesh with a ``"context"`` axis (``C`` devices holding other tokens of the same
rows, which need the same params) FSDP splits over ``("data", "context")`` together,
``D * C`` ways (``fsdp_axes``): ``1 / (D * C * M)`` per device, one all-gather over
both axes per param and one reduce-scatter of its gradient, summed over every device
that saw other tokens. A param those ``D * C`` devices divide nowhere is split over
``"data"`` alone where that divides it (and its gradient summed over context first).

In a step (``train.step.Trainer``), ``gather_for_step`` runs inside the step's
``shard_map``; the params that ``shard_over_data(..., per_block=...)`` recorded as a
block's (``FSDP_PER_BLOCK``) are left split there, and the block runner
(``flax_tp.remat.run_blocks``) calls ``gather_block`` on each block's own params (a
scanned layer's inside the scan): each sharded param is all-gathered over ``"data"``
back to this device's model shard, under ``jax.checkpoint``, so the gathered copy is
not kept for the backward pass but gathered again where backward needs it; the gradient
then leaves the transpose of that all-gather as a reduce-scatter over ``"data"``
(each device keeps the sum of its slice), replacing data parallelism's all-reduce. A
param split over both axes is first gathered over ``"model"`` (its backward keeps this
device's slice: the gradient is the same on every model device), then over ``"data"``.
The layers see exactly the params they would without FSDP, so the results are
the same. A param the data axis can split nowhere (a bias of 90 over 4 devices: model
shards of 23, over a 2-way data axis) stays replicated over ``"data"``
(``shard_over_data`` returns them). XLA:CPU merges a recomputed gather back into the
forward pass of an unrolled program (as it does all recomputation there), so there the
gathered params stay for backward; inside a scan they are gathered again.

Checkpoints hold logical values, so they move between runs with and without FSDP.
An FSDP model called outside the step (``model(ids)``, ``nnx.jit``) gathers as the step
does (the transformer's own map calls ``gather_for_step``); generation takes the params
once, replicated over ``"data"`` (``whole_over_data``), for all its tokens;
``unshard_over_data`` puts a model back that way in place (the standalone layers, export).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from flax_tp.collectives import (
  all_gather,
  axis_is_bound,
  copy_all_to_parallel,
  copy_to_parallel,
  is_varying,
  shard_index,
)
from flax_tp.mesh import CONTEXT_AXIS, DATA_AXIS, MODEL_AXIS, MeshAxes
from flax_tp.param_info import FSDP_DIM, FSDP_PER_BLOCK, FSDP_SPLIT, ParamInfo, Split, record

__all__ = ["FSDP_DIM", "FSDP_PER_BLOCK", "fsdp_axes", "fsdp_dim", "gather_block", "gather_for_step",
           "global_rows", "shard_over_data", "unshard_over_data", "whole_over_data"]

# FSDP_DIM, FSDP_PER_BLOCK: the metadata keys (flax_tp.param_info reads and writes them)
# of the param dimension split over "data" (and maybe "model"), and of a block's param
# (gathered by gather_block, not gather_for_step: one block's params whole at a time).


def batch_axes() -> tuple[str, ...]:
  """Inside a ``shard_map``: the bound axes whose devices hold different tokens of the
  step (``"data"``, and ``"context"`` on a mesh with one), over which a replicated
  param's gradient is summed, in one all-reduce."""
  return tuple(a for a in MeshAxes.BATCH_ROLES if axis_is_bound(a))


def global_rows(local_batch: int) -> jax.Array:
  """``[local_batch]``: the global batch-row ids of this device's rows (its data shard's
  rows in the global batch), so that per-row randomness (dropout) does not depend on
  the mesh. Outside a map over ``"data"``: ``0 .. local_batch - 1``."""
  first = 0
  if axis_is_bound(DATA_AXIS):
    first = shard_index(DATA_AXIS) * local_batch
  return first + jnp.arange(local_batch)


def _params(module_or_state: Any) -> list[nnx.Variable]:
  state = (nnx.state(module_or_state, nnx.Param) if isinstance(module_or_state, nnx.Module)
           else module_or_state)
  return [var for _, var in nnx.to_flat_state(state)]


def fsdp_dim(var: nnx.Variable, devices: int) -> int | None:
  """The dimension of ``var`` to split over ``devices``: the largest one that is not
  split otherwise (nor a stacked param's layer axis) and that ``devices`` divides;
  None when there is none."""
  info = ParamInfo.of(var)
  names = info.names or ()
  shape = var[...].shape
  stacked = 1 if info.is_stacked else 0
  free = [d for d in range(stacked, len(shape))
          if (names[d] if d < len(names) else None) is None and shape[d] % devices == 0]
  return max(free, key=lambda d: (shape[d], -d)) if free else None


def _within_model_shards(info: ParamInfo, data_size: int) -> int | None:
  """The model-split dim of a param when ``data_size`` divides each model shard of it
  (and no kv head is stored twice, whose norm weights are per model shard); else None."""
  layout, dim = info.layout, info.dim
  if layout is None or layout.replicated:
    return None
  if info.names[dim] != MODEL_AXIS or layout.padded_size % data_size:
    return None
  return dim


def fsdp_axes(mesh) -> tuple[str, ...]:
  """The axes FSDP splits params over on ``mesh``: ``"data"``, and ``"context"`` with it
  when the mesh has one (every device holding other tokens holds another slice)."""
  return tuple(a for a in MeshAxes.BATCH_ROLES if a in mesh.axis_names)


def _placement(info: ParamInfo, var: nnx.Variable, axes: tuple[str, ...], mesh):
  """Where ``var`` splits over ``axes``: ``(dim, that dim's mesh axes)``, or None. Whole
  under tensor parallelism (a norm's scale): over ``axes`` and ``"model"`` together if
  their devices divide a dim; else over ``axes`` on a free dim; else (a column layer's
  bias) each model shard over ``axes``."""
  size = int(np.prod([mesh.shape[a] for a in axes]))
  both = size * mesh.shape.get(MODEL_AXIS, 1)
  if not any(info.names) and both > size:
    dim = fsdp_dim(var, both)
    if dim is not None:
      return dim, (*axes, MODEL_AXIS)
  dim = fsdp_dim(var, size)
  if dim is not None:
    return dim, axes if len(axes) > 1 else axes[0]
  dim = _within_model_shards(info, size)
  return None if dim is None else (dim, (MODEL_AXIS, *axes))


def shard_over_data(module: nnx.Module, *, per_block: tuple[nnx.Module, ...] = ()
                    ) -> list[str]:
  """Splits every param of ``module`` that lives on a mesh with a ``"data"`` axis over
  that axis too (and over ``"context"`` with it on a mesh with one: ``fsdp_axes``), in
  place (see the module docstring). The params of the submodules ``per_block`` (a
  model's blocks: an ``nnx.List`` of them, or their stacked module) are recorded as
  gathered by their block (``FSDP_PER_BLOCK``): whoever runs the blocks must call
  ``gather_block`` on each (``flax_tp.remat.run_blocks`` does). A param that the data x
  context devices divide nowhere is split over ``"data"`` alone where that divides it.
  Returns the paths of the params left replicated over ``"data"`` (no dimension it
  divides), for the caller to report."""
  kept = []
  in_blocks = {id(var) for sub in per_block for _, var in nnx.to_flat_state(
      nnx.state(sub, nnx.Param))}
  for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    info = ParamInfo.of(var)
    mesh, names = info.mesh, info.names
    if mesh is None or names is None or DATA_AXIS not in mesh.axis_names:
      raise ValueError(f"param {'.'.join(map(str, path))} is not on a mesh with a "
                       f"{DATA_AXIS!r} axis (see flax_tp.replicate_on_mesh)")
    if info.over_data or info.over_experts:  # experts: already split over "data"
      continue
    axes = fsdp_axes(mesh)
    if math.prod(mesh.shape[a] for a in axes) == 1:  # one device: nothing to split
      continue
    new = list(names) + [None] * (var[...].ndim - len(names))
    where = _placement(info, var, axes, mesh)
    if where is None and len(axes) > 1 and mesh.shape[DATA_AXIS] > 1:
      where = _placement(info, var, (DATA_AXIS,), mesh)
    if where is None:
      kept.append(".".join(map(str, path)))
      continue
    dim, new[dim] = where
    var.set_value(jax.device_put(var[...], NamedSharding(mesh, P(*new))))
    record(var, names=tuple(new), splits=info.with_split(Split(FSDP_SPLIT, dim)),
           fsdp_per_block=id(var) in in_blocks)
  return kept


def _split_axes(entry) -> tuple[tuple[str, ...], bool]:
  """Of an FSDP dim's mesh axes (``names[fsdp_dim]``): the data (and context) axes it
  is gathered over, and whether it is whole under tensor parallelism (``"model"``
  after them, so gathered over ``"model"`` too)."""
  entry = (entry,) if isinstance(entry, str) else tuple(entry)
  axes = tuple(a for a in entry if a in MeshAxes.BATCH_ROLES)
  return axes, entry[0] != MODEL_AXIS and MODEL_AXIS in entry


def _names_whole_over_data(info: ParamInfo) -> tuple:
  """A split param's ``out_sharding`` with its ``"data"`` split taken out."""
  names = list(info.names)
  dim = info.fsdp_dim
  entry = names[dim]
  # ("model", "data", ...): a model shard split over data; anything else was whole
  names[dim] = MODEL_AXIS if not isinstance(entry, str) and entry[0] == MODEL_AXIS else None
  return tuple(names)


def whole_over_data(state: nnx.State, *, place: bool = True) -> nnx.State:
  """A copy of ``state`` (a module's state, or its params) whose params split over
  ``"data"`` are replicated over it again (their layout without FSDP: what the
  standalone layers and generation read); the others are the same objects. ``place``:
  all-gather the values (``False``: only the metadata, e.g. for partition specs).
  ``state`` itself is unchanged."""
  def one(var: nnx.Variable) -> nnx.Variable:
    info = ParamInfo.of(var)
    if not info.over_data:
      return var
    names = _names_whole_over_data(info)
    value = var[...]
    if place:
      value = jax.device_put(value, NamedSharding(info.mesh, P(*names)))
    new = var.replace(value)
    record(new, names=names, splits=info.without_split(FSDP_SPLIT), fsdp_per_block=None)
    return new

  return jax.tree.map(one, state, is_leaf=_is_var)


def unshard_over_data(module: nnx.Module) -> nnx.Module:
  """Puts ``module``'s params back to replicated over ``"data"`` (the layout the
  standalone layers read), in place; returns ``module``."""
  for var in _params(module):
    info = ParamInfo.of(var)
    if not info.over_data:
      continue
    names = _names_whole_over_data(info)
    var.set_value(jax.device_put(var[...], NamedSharding(info.mesh, P(*names))))
    record(var, names=names, splits=info.without_split(FSDP_SPLIT), fsdp_per_block=None)
  return module


def _gathered(var: nnx.Variable) -> nnx.Variable:
  """``var`` all-gathered over ``"data"`` (and first ``"model"``) on its FSDP dim, under
  ``jax.checkpoint``; a layer's slice of a stacked param too (its dims shift by one)."""
  info = ParamInfo.of(var)
  names, dim = info.names, info.fsdp_dim
  # ("data", ["context",] "model"): whole under tensor parallelism, so gathered over
  # "model" too; "data" / ("data", "context"), or ("model", "data", ...) (a model
  # shard split over them): over the data (and context) axes only.
  axes, over_model = _split_axes(names[dim])
  dim -= len(names) - var[...].ndim  # a scanned layer's slice of a stacked param

  def gather(x):
    if over_model:  # invariant over "model": backward keeps this device's slice
      x = all_gather(x, axis=dim, axis_name=MODEL_AXIS)
    # One gather over data (and context): its transpose reduce-scatters the gradient,
    # summed over every device that holds other tokens.
    x = jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=dim, tiled=True)
    if CONTEXT_AXIS not in axes and axis_is_bound(CONTEXT_AXIS):
      # Split over data alone, replicated over "context": per-replica once, so its
      # gradient is summed over context before the reduce-scatter over data.
      x = copy_to_parallel(x, CONTEXT_AXIS)
    return x

  return var.replace(jax.checkpoint(gather)(var[...]))


def _is_var(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def gather_for_step(params: nnx.State, *, per_replica: bool = True,
                    differentiated: Any = None) -> nnx.State:
  """Inside a ``shard_map`` over ``("data", "model")``: each param as the layers use it.

  A param split over ``"data"`` is all-gathered over it (tiled, on its FSDP dim) under
  ``jax.checkpoint``: backward gathers it again where needed, and its gradient is
  reduce-scattered over ``"data"``. Those recorded as a block's (``FSDP_PER_BLOCK``)
  are left split: the block runner gathers them block by block (``gather_block``), so
  one block's params are whole at a time. Every other param is marked per-replica
  (``copy_to_parallel``): its gradient is all-reduced over ``"data"`` once (over
  ``"data"`` and ``"context"`` together on a mesh with a context axis: ``batch_axes``).
  ``per_replica=False`` (a batch replicated over ``"data"``, every shard computing the
  same): those are left invariant, so what is computed from them is too.
  ``differentiated``: an nnx filter of the params whose gradients the caller takes (the
  step's trained params, given on XLA:CPU): their gradient all-reduces over the batch
  axes travel packed, a few arrays instead of one per param (``copy_all_to_parallel``:
  the same sums). A param outside it is marked on its own, so one nobody differentiates (a
  LoRA run's frozen base) has no gradient computed or sent.
  """
  def one(var: nnx.Variable) -> nnx.Variable:
    info = ParamInfo.of(var)
    if not info.over_data:
      return var.replace(copy_to_parallel(var[...], batch_axes())) if per_replica else var
    if info.fsdp_per_block:
      return var
    return _gathered(var)

  if per_replica and differentiated is not None:
    params = _per_replica_packed(params, differentiated)  # (one() leaves them: varying)
  return jax.tree.map(one, params, is_leaf=_is_var)


def _per_replica_packed(params: nnx.State, differentiated: Any) -> nnx.State:
  """``params`` with the ``differentiated`` ones replicated over the batch axes marked
  per-replica together (``copy_all_to_parallel``): their gradients are summed over those
  axes in packed arrays, one per bucket, not one array per param. For XLA:CPU, where a
  collective costs a meeting of the device threads per array it carries (the step asks
  for it there only; elsewhere the per-param all-reduces are left to XLA's combiner and
  its overlap with the backward pass). The sums are the same either way."""
  axes = batch_axes()
  wanted = nnx.filterlib.to_predicate(differentiated)
  flat = list(nnx.to_flat_state(params))
  mine = [i for i, (path, var) in enumerate(flat) if wanted(path, var)
          and not ParamInfo.of(var).over_data
          and not any(is_varying(var[...], a) for a in axes)]
  marked = copy_all_to_parallel([flat[i][1][...] for i in mine], axes)
  for i, value in zip(mine, marked, strict=True):
    flat[i] = (flat[i][0], flat[i][1].replace(value))
  return nnx.from_flat_state(flat)


def gather_block(state: nnx.State) -> nnx.State:
  """A block's params (or a scanned layer's slice) with those split over ``"data"``
  gathered, inside a ``shard_map`` over ``"data"`` (the step's, or the standalone
  model's); a state without such params is returned as it is, anywhere.

  Outside such a map a param split over ``"data"`` cannot be gathered there: that is
  an error naming what to call, never a silent pass-through of a partial param.
  """
  split = [v for v in jax.tree.leaves(state, is_leaf=_is_var) if ParamInfo.of(v).over_data]
  if not split:
    return state
  if DATA_AXIS not in jax.sharding.get_abstract_mesh().manual_axes:
    raise ValueError(
        f"gather_block: {len(split)} param(s) are split over {DATA_AXIS!r} (FSDP) and "
        f"this is not inside a shard_map over {DATA_AXIS!r}: call the model itself (it "
        f"maps itself), or take the params whole first "
        f"(flax_tp.data_parallel.whole_over_data / unshard_over_data)")
  return jax.tree.map(lambda v: _gathered(v) if ParamInfo.of(v).over_data else v,
                      state, is_leaf=_is_var)
