"""How a MoE layer's routed choices reach the devices holding their experts, and come back
(inside the layer's ``shard_map``).

A ``Dispatcher`` is one of three implementations, chosen by the layer's ``dispatcher``
and capacity:

- ``"all_gather"`` (the default): every device's tokens and routing come to every device
  holding experts (one all-gather over the expert axes where the devices hold different
  tokens), each runs the choices its own experts own, and the outputs are
  reduce-scattered back. With a capacity, each expert's queue is over every token the
  gather brought, the global batch inside a step: **what drops does not depend on the
  mesh**.
- ``"all_to_all"`` with a capacity factor: each routed choice is sent only to its expert's
  device, in a static ``[D, E_local, C, d]`` buffer each way, ``C`` per expert and
  *source* device (Megatron's per-rank capacity): **what drops depends on the data
  axis** (at a capacity factor of ``E / k`` or more nothing drops, and the result is the
  all-gather's).
- ``"all_to_all"`` dropless: exactly the routed choices sent with
  ``jax.lax.ragged_all_to_all``, where the backend's XLA has it
  (``RAGGED_ALL_TO_ALL_PLATFORMS``; XLA:CPU does not, jax 0.10.2): nothing drops.

``Dispatcher.drops_depend_on_mesh`` says which. The experts' arithmetic itself is
``flax_tp.moe.experts``'; the routing, ``flax_tp.moe.router``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from flax_tp.collectives import (
  all_reduce,
  copy_to_parallel,
  gather_to_parallel,
  is_varying,
  reduce_scatter,
  shard_index,
)
from flax_tp.context import ContextSplit
from flax_tp.mesh import CONTEXT_AXIS, DATA_AXIS, MeshAxes
from flax_tp.moe.experts import LocalExperts, expert_capacity, expert_queues, rank_weight
from flax_tp.partition import ShardLayout

Array = jax.Array

# How routed tokens reach the shards holding their experts: every shard's tokens to every
# shard ("all_gather", mesh-independent drops), or each routed choice only to its
# expert's shard and back ("all_to_all", with a capacity per source shard).
DISPATCHERS = ("all_gather", "all_to_all")
# The platforms whose XLA implements jax.lax.ragged_all_to_all (the dropless all-to-all
# dispatcher's collective); XLA:CPU does not (jax 0.10.2: UNIMPLEMENTED).
RAGGED_ALL_TO_ALL_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})
# The collective itself (a module attribute so that a CPU test can put an emulation of its
# documented semantics, built from jax.lax.all_to_all, in its place).
ragged_all_to_all = jax.lax.ragged_all_to_all


def check_dispatcher(dispatcher: str, capacity_factor: float | None, platform: str) -> None:
  """``ValueError`` naming why ``dispatcher`` cannot run on ``platform``'s devices."""
  if dispatcher not in DISPATCHERS:
    raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
  if (dispatcher == "all_to_all" and capacity_factor is None
      and platform not in RAGGED_ALL_TO_ALL_PLATFORMS):
    raise ValueError(f"dispatcher 'all_to_all' without a capacity_factor (dropless) needs "
                     f"jax.lax.ragged_all_to_all, which XLA on {platform!r} does not "
                     f"implement: give a capacity_factor, or use 'all_gather' for dropless")


def exclusive_cumsum(x: Array, axis: int = -1) -> Array:
  return jnp.cumsum(x, axis=axis) - x


def _block_index(axes: tuple[str, ...]) -> Array:
  """This device's index over ``axes`` together, row-major."""
  index = 0
  for a in axes:
    index = index * jax.lax.axis_size(a) + shard_index(a)
  return index


@dataclasses.dataclass(frozen=True)
class Dispatcher:
  """One MoE layer's dispatch, inside its map: which implementation, and what it needs of
  the layer (its experts' layout over ``expert_axes``, the tensor-parallel ``axis_name``,
  the capacity and drop policy). The experts themselves are given per call, as a
  function of the compute dtype (``LocalExperts``), read where the dispatch runs them."""
  kind: str  # one of DISPATCHERS
  num_experts: int
  top_k: int
  expert_layout: ShardLayout  # the experts over expert_axes (row-major)
  expert_axes: tuple[str, ...]
  axis_name: str  # the layer's tensor-parallel axis
  capacity_factor: float | None
  drop_policy: str

  @property
  def drops_depend_on_mesh(self) -> bool:
    """Whether what a capacity drops depends on how the tokens are split over the data
    axis: only for the all-to-all with a capacity (per source device's queues)."""
    return self.kind == "all_to_all" and self.capacity_factor is not None

  def to_all(self, dropless: bool) -> bool:
    """Whether this call dispatches by all-to-all (a dropless call, decoding, gathers)."""
    return self.kind == "all_to_all" and not dropless

  def __call__(self, xc: Array, weights: Array, experts: Array, compute_dtype: Any,
               dropless: bool, routed: Array | None,
               local: Callable[[Any], LocalExperts]) -> tuple[Array, Array]:
    """This device's tokens ``xc [n, d]`` with their routing ``weights, experts [n, k]``
    through the experts: ``[n, d]``, this device's partial sum over ``axis_name`` (the
    caller reduces it), and how many choices this device's experts dropped (zero
    without a capacity). ``routed [n, k]`` (context parallel): the choices that go to
    their experts, all of them run dropless; the others add nothing
    (``context_routing`` decided). ``local(compute_dtype)``: this device's experts.

    Over each axis the experts split over (``expert_axes``): where the devices hold
    different tokens (``"data"`` and ``"context"`` in the step) every device's tokens
    and routing come to every device (one all-gather over those axes together), each
    runs the choices its experts own, and the outputs are reduce-scattered back; where
    they hold the same tokens (``"model"``, whose devices see one data shard's tokens;
    a replicated input) each runs them through its own experts and the partial outputs
    are summed (over ``"model"`` by the caller, with the FFN's partial sums)."""
    layout = self.expert_layout
    exchange = tuple(a for a in self.expert_axes
                     if a != self.axis_name and is_varying(xc, a))
    summed = tuple(a for a in self.expert_axes if a != self.axis_name and a not in exchange)
    if exchange and self.to_all(dropless):
      to_all = self._all_to_all if self.capacity_factor else self._ragged_all_to_all
      return to_all(xc, weights, experts, compute_dtype, exchange, summed, routed, local)
    if exchange:
      xc = gather_to_parallel(xc, axis=0, axis_name=exchange)
      weights = gather_to_parallel(weights, axis=0, axis_name=exchange)
      experts = jax.lax.all_gather(experts, exchange, axis=0, tiled=True)
      if routed is not None:
        routed = jax.lax.all_gather(routed, exchange, axis=0, tiled=True)
    offsets = jnp.asarray(layout.offsets, jnp.int32)
    owner = jnp.searchsorted(offsets, experts, side="right") - 1
    here = _block_index(self.expert_axes)  # this device's block of the experts
    mine = owner == here if routed is None else (owner == here) & routed
    slots = jnp.where(mine, experts - offsets[owner], layout.padded_size)
    run = local(compute_dtype)
    xc = copy_to_parallel(xc, self.axis_name)
    dropped = jnp.zeros((), jnp.float32)
    if self.capacity_factor is None or dropless or routed is not None:
      y = run.grouped(xc, slots, weights)
    else:
      capacity = expert_capacity(xc.shape[0], self.top_k, self.num_experts,
                                 self.capacity_factor)
      y, dropped = run.capped(xc, slots, weights, capacity, self.drop_policy)
      dropped = self._dropped_total(jax.lax.stop_gradient(dropped), summed)
    if exchange:  # each token's partial outputs back to its own device, summed
      y = reduce_scatter(y, axis=0, axis_name=exchange)
    if summed:
      y = all_reduce(y, "sum", summed)
    return y, dropped

  def context_routing(self, x: Array, weights: Array, experts: Array, valid: Array,
                      rows: int, context: ContextSplit,
                      dropless: bool) -> tuple[Array, Array]:
    """Context parallel: which of this device's choices (``weights, experts [n, k]`` of
    its ``n = rows * local_len`` slots, ``valid [n]`` those holding a token) go to their
    experts, ``[n, k]`` bool, and how many of them a capacity dropped.

    Dropless, every real token's choices go. With a capacity the drop rule must be the
    one device's, over the whole batch (else what drops would depend on C): the
    routing alone (``[n, k]`` experts and weights, not the tokens) is all-gathered over
    the devices holding other tokens, every device runs the policy's queues over all of
    it, each token ranked by its global (row, position), padding in no queue, and keeps
    its own slots' verdicts. The kept choices then run dropless (``grouped_swiglu``):
    the capacity decides what drops, not the buffers' shape."""
    k = self.top_k
    routed = jnp.broadcast_to(valid[:, None], experts.shape)
    if self.capacity_factor is None or dropless:
      return routed, jnp.zeros((), jnp.float32)
    axes = tuple(a for a in MeshAxes.BATCH_ROLES if is_varying(x, a))
    first_row = shard_index(DATA_AXIS) * rows if DATA_AXIS in axes else 0
    row = first_row + jnp.arange(rows)
    token = (row[:, None] * context.padded_len + context.positions()[None, :]).reshape(-1)
    position = token[:, None] * k + jnp.arange(k)[None, :]  # [n, k], distinct
    queue = jnp.where(routed, experts, self.num_experts)
    ranked = rank_weight(jax.lax.stop_gradient(weights))
    everyone = [jax.lax.all_gather(t, axes, axis=0, tiled=True)
                for t in (queue, ranked, position)]
    tokens = rows * context.seq_len * math.prod(jax.lax.axis_size(a) for a in axes
                                                if a != CONTEXT_AXIS)
    capacity = expert_capacity(tokens, k, self.num_experts, self.capacity_factor)
    order, sorted_queues, rank = expert_queues(*(t.reshape(-1) for t in everyone),
                                               self.drop_policy, self.num_experts)
    kept_sorted = (sorted_queues < self.num_experts) & (rank < capacity)
    kept = jnp.zeros(kept_sorted.shape, bool).at[order].set(kept_sorted)
    # This device's block of the gathered order (row-major over ``axes``).
    mine = jax.lax.dynamic_slice_in_dim(kept.reshape(-1, k),
                                        _block_index(axes) * queue.shape[0], queue.shape[0])
    dropped = jnp.sum(routed & ~mine).astype(jnp.float32)
    if is_varying(dropped, self.axis_name):  # sequence parallel: equal on every device
      dropped = jax.lax.pmax(dropped, self.axis_name)
    return routed & mine, dropped

  # -- the all-to-all implementations ----------------------------------------------------

  def _destinations(self, experts: Array, exchange: tuple[str, ...], routed: Array | None
                    ) -> tuple[Array, int]:
    """Where each choice of ``experts [n, k]`` goes: ``[n, k]`` ``dest * E_local + local
    expert`` over the ``exchange`` devices (row-major), or ``devices * E_local`` for a
    choice this device does not send (another device of a non-exchanged expert axis
    holds its expert and sends it; or not ``routed``); and the exchange's device count."""
    layout = self.expert_layout
    e_local = layout.padded_size
    sizes = {a: jax.lax.axis_size(a) for a in self.expert_axes}
    offsets = jnp.asarray(layout.offsets, jnp.int32)
    owner = jnp.searchsorted(offsets, experts, side="right") - 1  # [n, k], over expert_axes
    coords, rest = {}, owner
    for a in reversed(self.expert_axes):  # the owner's place on each expert axis
      coords[a], rest = rest % sizes[a], rest // sizes[a]
    mine = jnp.ones(experts.shape, bool) if routed is None else routed
    for a in self.expert_axes:  # the other axes' devices send their own experts' choices
      if a not in exchange:
        mine = mine & (coords[a] == shard_index(a))
    dest = 0
    for a in exchange:
      dest = dest * sizes[a] + coords[a]
    devices = math.prod(sizes[a] for a in exchange)
    return jnp.where(mine, dest * e_local + experts - offsets[owner], devices * e_local), devices

  def _dropped_total(self, dropped: Array, summed: tuple[str, ...]) -> Array:
    """The layer's drop count from this device's: summed over the devices holding other
    experts of the same tokens, equal on the sequence-parallel devices."""
    if self.axis_name in self.expert_axes:  # each model device its own experts' choices
      dropped = all_reduce(dropped, "sum", self.axis_name)
    elif is_varying(dropped, self.axis_name):  # sequence parallel: equal on every device
      dropped = jax.lax.pmax(dropped, self.axis_name)
    if summed:  # the same tokens on those devices: each its own experts'
      dropped = all_reduce(dropped, "sum", summed)
    return dropped

  def _ragged_all_to_all(self, xc: Array, weights: Array, experts: Array,
                         compute_dtype: Any, exchange: tuple[str, ...],
                         summed: tuple[str, ...], routed: Array | None,
                         local: Callable[[Any], LocalExperts]) -> tuple[Array, Array]:
    """The dispatch by all-to-all, dropless: exactly this device's routed choices sent to
    the devices holding their experts with ``jax.lax.ragged_all_to_all``, run there as
    grouped matmuls, and sent back the same way.

    The ``n k`` choices are sorted by (destination, local expert) so that each
    destination's are one contiguous slice; one small all-to-all tells each device how
    many rows of each of its experts every source sends, and one all-gather of the
    ``[D]`` send sizes where each source's slice starts in each receiver's buffer (the
    slices in source order). A receiver's buffer holds the most it could get,
    ``D * n * min(k, E_local)`` rows (a token picks distinct experts); only the received
    rows run through the experts (``grouped_swiglu``, the rest in no group)."""
    e_local = self.expert_layout.padded_size
    n, k = experts.shape
    d = xc.shape[-1]
    queue, devices = self._destinations(experts, exchange, routed)
    flat = queue.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # [n k]: by destination, then local expert
    counts = jnp.bincount(flat, length=devices * e_local + 1)[:-1].astype(jnp.int32)
    counts = counts.reshape(devices, e_local)  # [D, E_local]: rows to each device's experts
    send_sizes = counts.sum(1)
    input_offsets = exclusive_cumsum(send_sizes)
    recv_counts = jax.lax.all_to_all(counts, exchange, 0, 0, tiled=True)  # row i: from i
    recv_sizes = recv_counts.sum(1)
    every = jax.lax.all_gather(send_sizes, exchange, axis=0, tiled=False)  # [src, dest]
    earlier = jnp.arange(devices) < _block_index(exchange)
    # where this device's slice lands in each receiver's buffer (after the earlier
    # sources'), and where each source's rows go back in its own send order
    output_offsets = jnp.sum(jnp.where(earlier[:, None], every, 0), axis=0)
    back_offsets = jnp.sum(jnp.where(earlier[None, :], every, 0), axis=1)
    rows = devices * n * min(k, e_local)
    send = xc[order // k]
    received = ragged_all_to_all(send, jnp.zeros((rows, d), xc.dtype), input_offsets,
                                 send_sizes, output_offsets, recv_sizes, axis_name=exchange)
    # the received rows: each source's slice in source order, in it each expert's rows
    starts = (exclusive_cumsum(recv_sizes)[:, None]
              + exclusive_cumsum(recv_counts, axis=1)).reshape(-1)
    row = jnp.arange(rows)
    group = jnp.searchsorted(starts, row, side="right") - 1  # (empty groups: skipped)
    slot = jnp.where(row < recv_sizes.sum(), group % e_local, e_local)
    run = local(compute_dtype)
    ye = run.grouped(copy_to_parallel(received, self.axis_name), slot[:, None],
                     jnp.ones((rows, 1), compute_dtype))
    back = ragged_all_to_all(ye, jnp.zeros((n * k, d), ye.dtype),
                             exclusive_cumsum(recv_sizes), recv_sizes, back_offsets,
                             send_sizes, axis_name=exchange)
    # each choice's output back in (token, choice) order, weighted there
    outputs = jnp.zeros((n * k, d), back.dtype).at[order].set(back).reshape(n, k, d)
    scale = jnp.where(flat.reshape(n, k) < devices * e_local, weights, 0).astype(back.dtype)
    y = jnp.einsum("nk,nkd->nd", scale, outputs)
    if summed:
      y = all_reduce(y, "sum", summed)
    return y, self._dropped_total(jnp.zeros((), jnp.float32), summed)

  def _all_to_all(self, xc: Array, weights: Array, experts: Array, compute_dtype: Any,
                  exchange: tuple[str, ...], summed: tuple[str, ...],
                  routed: Array | None,
                  local: Callable[[Any], LocalExperts]) -> tuple[Array, Array]:
    """The dispatch by all-to-all with a capacity: this device's ``n`` tokens' choices
    sent only to the devices (over ``exchange``) holding their experts, and the outputs
    sent back.

    Each expert takes at most ``capacity = expert_capacity(n, k, E, F)`` choices from each
    source device (Megatron's per-rank capacity), chosen by the drop policy among that
    device's own choices: what drops depends on how the tokens are split (at ``F >= E /
    k`` nothing does, and the result is the all-gather's). A choice whose expert lives on
    another device of a non-exchanged expert axis (``"model"`` with whole experts) is
    that device's to send. The buffers are ``[D, E_local, capacity, d]`` (``D`` the
    exchange's devices) each way: one ``jax.lax.all_to_all`` out, the experts as batched
    matmuls over ``[E_local, D * capacity, d]``, one back.
    """
    n, k = experts.shape
    e_local, d = self.expert_layout.padded_size, xc.shape[-1]
    queue, devices = self._destinations(experts, exchange, routed)
    capacity = expert_capacity(n, k, self.num_experts, self.capacity_factor)
    flat, w = queue.reshape(-1), weights.reshape(-1)
    order, sorted_queue, rank = expert_queues(
        flat, rank_weight(jax.lax.stop_gradient(w)), jnp.arange(n * k), self.drop_policy,
        devices * e_local)
    sent = (sorted_queue < devices * e_local) & (rank < capacity)
    outside = devices * e_local * capacity
    slot = jnp.where(sent, sorted_queue * capacity + rank, outside)  # per sorted choice
    token = order // k
    send = jnp.zeros((outside, d), xc.dtype).at[slot].add(xc[token], mode="drop")
    # [D * E_local * C, d]: block i to device i; back as block j from device j
    received = jax.lax.all_to_all(send, exchange, 0, 0, tiled=True)
    xe = received.reshape(devices, e_local, capacity, d).transpose(1, 0, 2, 3).reshape(
        e_local, devices * capacity, d)
    run = local(compute_dtype)
    ye = run.batched(copy_to_parallel(xe, self.axis_name))
    ye = ye.reshape(e_local, devices, capacity, d).transpose(1, 0, 2, 3).reshape(outside, d)
    back = jax.lax.all_to_all(ye, exchange, 0, 0, tiled=True)
    ys = jnp.take(back, slot, axis=0, mode="fill", fill_value=0)
    scale = jnp.where(sent, w[order], 0).astype(ys.dtype)
    y = jnp.zeros((n, d), ys.dtype).at[token].add(ys * scale[:, None])
    dropped = jax.lax.stop_gradient(
        jnp.sum((sorted_queue < devices * e_local) & ~sent).astype(jnp.float32))
    if summed:
      y = all_reduce(y, "sum", summed)
    return y, self._dropped_total(dropped, summed)
