"""Differentiable collectives over a mapped mesh axis (``"model"`` by default).

These are thin, checked wrappers over ``jax.lax`` for code running inside
``jax.shard_map`` / ``nnx.shard_map`` (with ``check_vma=True``, JAX's default).
They follow Megatron's pairing of forward and backward communication:

- ``all_reduce`` (sum): result is the same on every device; backward needs no
  communication (the transpose of ``psum`` under ``check_vma``).
- ``all_gather``: result is the same on every device; backward takes the local
  slice of the cotangent (no communication).
- ``reduce_scatter``: backward is an all-gather.
- ``copy_to_parallel``: identity forward; backward all-reduces the cotangent.
  This is Megatron's ``f`` operator, entered once before column-parallel layers.
- ``gather_to_parallel``: all-gather forward, reduce-scatter backward; with
  ``reduce_scatter`` it is sequence parallelism's pair for ``f`` and ``g``.

On an axis of size 1 nothing needs communicating, and XLA does not always drop
a collective over one device, so a replicated value passes through unchanged
(no collective is emitted at all).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from flax_tp.mesh import MODEL_AXIS

_OPS = ("sum", "mean", "max", "min")


def axis_is_bound(axis_name: str) -> bool:
  """True inside a ``shard_map`` whose manual axes include ``axis_name``."""
  return axis_name in jax.sharding.get_abstract_mesh().manual_axes


def _require_bound(axis_name: str, what: str) -> None:
  if not axis_is_bound(axis_name):
    raise ValueError(
        f"{what}: mesh axis {axis_name!r} is not bound here. Call it inside "
        f"jax.shard_map(..., mesh=mesh) (or nnx.shard_map) over a mesh with a "
        f"{axis_name!r} axis, or pass the axis_name of one that is bound."
    )


def is_varying(x: jax.Array, axis_name: str) -> bool:
  """True when ``x`` may differ between devices along ``axis_name``."""
  return axis_name in jax.typeof(x).manual_axis_type.varying


def shard_index(axis_name: str = MODEL_AXIS) -> jax.Array | int:
  """This device's position along ``axis_name``; the constant 0 on a one-device axis.

  ``jax.lax.axis_index`` makes anything computed from it differ per device,
  which would turn reductions over a one-device axis into real collectives.
  """
  _require_bound(axis_name, "shard_index")
  return 0 if jax.lax.axis_size(axis_name) == 1 else jax.lax.axis_index(axis_name)


def _is_trivial(x: jax.Array, axis_name: str) -> bool:
  """True when reducing ``x`` over the axis is the identity: one device, same value."""
  return jax.lax.axis_size(axis_name) == 1 and not is_varying(x, axis_name)


def _live_axes(x: jax.Array, axis_names: tuple[str, ...], what: str) -> tuple[str, ...]:
  """Of several axes, those a collective over them must name: each is bound, and a
  one-device axis over which ``x`` is the same everywhere is left out."""
  for name in axis_names:
    _require_bound(name, what)
  return tuple(n for n in axis_names if not _is_trivial(x, n))


def copy_to_parallel(x: jax.Array, axis_name: str | tuple[str, ...] = MODEL_AXIS) -> jax.Array:
  """Marks a replicated ``x`` as input to per-device work (Megatron's ``f``).

  Identity in the forward pass; in the backward pass the per-device cotangents
  are summed with one all-reduce. Call it once on an activation that feeds
  several column-parallel layers (q, k, v) so that backward does one all-reduce,
  not one per layer. A no-op on values that already vary along the axis.
  Several axes (``("data", "context")``): one all-reduce over all of them in backward.
  """
  if isinstance(axis_name, tuple):
    live = tuple(n for n in _live_axes(x, axis_name, "copy_to_parallel")
                 if not is_varying(x, n))
    return jax.lax.pcast(x, live, to="varying") if live else x
  _require_bound(axis_name, "copy_to_parallel")
  return x if jax.lax.axis_size(axis_name) == 1 else _vary(x, axis_name)


# Megatron's default gradient bucket (its DDP all-reduces its contiguous gradient
# buffer in buckets of 40M elements): the most one packed array of copy_all_to_parallel
# holds, so packing never costs more than that in temporaries.
BUCKET_ELEMENTS = 40_000_000


def copy_all_to_parallel(xs: list[jax.Array], axis_names: tuple[str, ...]) -> list[jax.Array]:
  """``copy_to_parallel(x, axis_names)`` of every ``x`` in ``xs`` (each the same on every
  device of ``axis_names``), with their backward all-reduces packed: the cotangents are
  concatenated into one flat array per dtype and per set of axes they vary over (up to
  ``BUCKET_ELEMENTS`` each), summed over ``axis_names``, and cut back.

  The sums are the same as one all-reduce per array; what changes is how many arrays
  the collective carries. XLA:CPU meets the devices' threads once per array of a
  collective, so data parallelism's gradient all-reduce over N params costs N meetings
  (Megatron's DDP packs its gradients for its own reasons: one contiguous buffer).
  Pass only arrays the caller differentiates: JAX takes a custom VJP's outputs together,
  so a frozen one among them would have its cotangent computed and sent (an output no
  one uses is left out).
  """
  for name in axis_names:
    _require_bound(name, "copy_all_to_parallel")
  live = tuple(n for n in axis_names if jax.lax.axis_size(n) > 1)
  if not live or not xs:
    return list(xs)

  @jax.custom_vjp
  def mark(*values):
    return tuple(jax.lax.pcast(v, live, to="varying") for v in values)

  def fwd(*primals):
    return mark(*(p.value for p in primals)), None

  def bwd(_, cotangents):
    summed = [None] * len(cotangents)
    groups: dict[tuple, list[int]] = {}
    for i, ct in enumerate(cotangents):
      if isinstance(ct, jax.custom_derivatives.SymbolicZero):
        continue  # not differentiated: nothing to sum
      key = (ct.dtype, tuple(sorted(jax.typeof(ct).manual_axis_type.varying - set(live))))
      groups.setdefault(key, []).append(i)
    for members in groups.values():
      for bucket in _buckets(members, [cotangents[i].size for i in members]):
        flat = jax.lax.psum(jnp.concatenate([cotangents[i].reshape(-1) for i in bucket]),
                            live)
        start = 0
        for i in bucket:
          size = cotangents[i].size
          summed[i] = flat[start:start + size].reshape(cotangents[i].shape)
          start += size
    return tuple(summed)

  mark.defvjp(fwd, bwd, symbolic_zeros=True)
  return list(mark(*xs))


def _buckets(members: list[int], sizes: list[int]) -> list[list[int]]:
  """``members`` in order, cut into runs of at most ``BUCKET_ELEMENTS`` elements (an
  array larger than that alone)."""
  out: list[list[int]] = [[]]
  total = 0
  for member, size in zip(members, sizes, strict=True):
    if out[-1] and total + size > BUCKET_ELEMENTS:
      out.append([])
      total = 0
    out[-1].append(member)
    total += size
  return out


def _vary(x: jax.Array, axis_name: str) -> jax.Array:
  return x if is_varying(x, axis_name) else jax.lax.pcast(x, axis_name, to="varying")


def all_reduce(x: jax.Array, op: str = "sum",
               axis_name: str | tuple[str, ...] = MODEL_AXIS) -> jax.Array:
  """Reduces ``x`` elementwise over ``axis_name``; every device gets the result.

  ``op`` is ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``. ``max``/``min`` are
  differentiable: the cotangent goes to the devices that hold the extremum,
  split equally on ties (like ``jnp.max``). Several axes (``("data", "context")``,
  sum only): one all-reduce over all of them.
  """
  if op not in _OPS:
    raise ValueError(f"unknown all_reduce op {op!r}; expected one of {_OPS}")
  if isinstance(axis_name, tuple):
    if op != "sum":
      raise ValueError(f"all_reduce over several axes {axis_name} sums; got op={op!r}")
    live = _live_axes(x, axis_name, "all_reduce")
    if not live:
      return x
    x = copy_to_parallel(x, live)
    return jax.lax.psum(x, live)
  _require_bound(axis_name, f"all_reduce(op={op!r})")
  if _is_trivial(x, axis_name):
    return x
  x = _vary(x, axis_name)
  if op == "sum":
    return jax.lax.psum(x, axis_name)
  if op == "mean":
    return jax.lax.pmean(x, axis_name)
  return _extremum(x, axis_name, op == "max")


def _extremum(x: jax.Array, axis_name: str, is_max: bool) -> jax.Array:
  reduce = jax.lax.pmax if is_max else jax.lax.pmin

  @jax.custom_vjp
  def extremum(x):
    return reduce(x, axis_name)

  def fwd(x):
    y = reduce(x, axis_name)
    return y, (x, y)

  def bwd(res, ct):
    x, y = res
    hit = (x == y).astype(ct.dtype)
    # jax.lax.psum of the hit mask counts how many devices share the extremum.
    return (ct * hit / jax.lax.psum(hit, axis_name),)

  extremum.defvjp(fwd, bwd)
  return extremum(x)


def all_gather(x: jax.Array, axis: int = 0, axis_name: str = MODEL_AXIS) -> jax.Array:
  """Concatenates every device's ``x`` along ``axis`` (tiled); same on all devices.

  ``x``: ``[..., n_local, ...]`` varying over ``axis_name``;
  returns ``[..., axis_size * n_local, ...]`` replicated over ``axis_name``.
  Backward keeps each device's slice of the cotangent, with no communication.
  """
  _require_bound(axis_name, "all_gather")
  if _is_trivial(x, axis_name):
    return x
  x = _vary(x, axis_name)
  return jax.lax.all_gather(x, axis_name, axis=axis % x.ndim, tiled=True, to="invarying")


def gather_to_parallel(x: jax.Array, axis: int = 1,
                       axis_name: str | tuple[str, ...] = MODEL_AXIS) -> jax.Array:
  """All-gathers ``x`` along ``axis`` as input to per-device work (sequence parallelism).

  ``x``: ``[..., n_local, ...]`` varying over ``axis_name``; returns
  ``[..., axis_size * n_local, ...]``, which then feeds column-parallel layers
  whose outputs differ per device. Backward reduce-scatters the cotangent
  (Megatron's ``gather_from_sequence_parallel_region``): the pair of this and
  ``reduce_scatter`` replaces ``copy_to_parallel`` and a row layer's all-reduce
  when activations between blocks are split over the sequence.
  """
  if isinstance(axis_name, tuple):
    live = _live_axes(x, axis_name, "gather_to_parallel")
    if not live:
      return x
    x = copy_to_parallel(x, live)
    return jax.lax.all_gather(x, live, axis=axis % x.ndim, tiled=True, to="varying")
  _require_bound(axis_name, "gather_to_parallel")
  if _is_trivial(x, axis_name):
    return x
  x = _vary(x, axis_name)
  return jax.lax.all_gather(x, axis_name, axis=axis % x.ndim, tiled=True, to="varying")


def reduce_scatter(x: jax.Array, axis: int = 0,
                   axis_name: str | tuple[str, ...] = MODEL_AXIS) -> jax.Array:
  """Sums ``x`` over ``axis_name`` and keeps this device's block of ``axis``.

  ``x``: ``[..., n, ...]`` with ``n`` divisible by the axis size; returns
  ``[..., n / axis_size, ...]`` varying over ``axis_name``. Several axes: one
  reduce-scatter over all of them, the blocks in row-major order of the axes as given
  (``gather_to_parallel``'s inverse).
  """
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  live = _live_axes(x, names, "reduce_scatter")
  size = math.prod(jax.lax.axis_size(n) for n in names)
  if x.shape[axis] % size:
    raise ValueError(
        f"reduce_scatter: dimension {axis} of size {x.shape[axis]} is not divisible "
        f"by the size {size} of axis {axis_name!r}; pad it first (see ShardLayout)"
    )
  if not live:
    return x
  x = copy_to_parallel(x, live)
  return jax.lax.psum_scatter(x, live if isinstance(axis_name, tuple) else live[0],
                              scatter_dimension=axis % x.ndim, tiled=True)
