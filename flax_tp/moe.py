"""Mixture of experts with expert parallelism: router, dispatch and combine, grouped experts.

A MoE block takes the place of a transformer block's MLP. Each token goes to ``top_k``
of ``num_experts`` SwiGLU experts, and its output is the routing-weighted sum of their
outputs. Optionally a shared expert with a sigmoid gate is added, as in Qwen2-MoE.

Where things live on a ``("data", "model")`` mesh (Megatron's expert x tensor parallelism):
- the router ``[d, E]`` is replicated;
- the experts' ``gate, up [E, d, I]`` and ``down [E, I, d]`` are split over ``"data"``
  on the experts. The split is ``ShardLayout(E, D)``, ``array_split`` semantics, and a
  shard that holds fewer experts is padded with zero experts that no token is sent to.
  They are split over ``"model"`` on the FFN width, column-wise (gate/up) and row-wise
  (down), padded as the dense layers are. The shared expert is a dense column/row MLP.
- a token's experts may live on any data shard. The dispatcher all-gathers the data
  shards' tokens and their routing over ``"data"``. Each shard then runs the tokens
  routed to its own experts through one grouped matmul per weight
  (``jax.lax.ragged_dot`` over the tokens sorted by expert, with no capacity and
  nothing dropped). The partial outputs are reduce-scattered over ``"data"``, back to
  the shard each token came from, and summed over ``"model"``. Backward mirrors
  this: output cotangents are all-gathered, input cotangents reduce-scattered.

Other layouts (``MoE(..., expert_axes=...)``, the mesh record's ``MeshAxes.expert_axes``;
``Execution.expert_axes`` in the model): the experts split over ``"data"`` and
``"context"`` together (``ShardLayout(E, D * C)``, row-major over the two), each context
shard's tokens then all-gathered over both axes at once and the outputs reduce-scattered
back; or over ``"model"`` too, each expert whole on one device (its FFN not split,
Megatron's expert-tensor-parallel size 1): the model devices hold the same tokens, each
runs its own experts on them, and the outputs are summed over ``"model"`` as the split
FFN's partial sums are. What a step computes does not depend on the layout; a
checkpoint moves between them.

Under sequence parallelism (``MoE(x, seq)`` in a map, ``x`` this device's block of the
sequence, as between Megatron-SP blocks) each device routes its own block, leaving the
padding rows out of the statistics, then gathers the tokens and their routing over
``"model"`` to the whole sequence, as the dense MLP gathers its input. The outputs are
reduce-scattered back to the block instead of all-reduced. The replicated router and
shared-expert gate so see each token once, and their gradients need no extra sum.

Under context parallelism (``MoE(x, seq, context=split)``, ``x`` this device's slots of
the sequence) the experts are split over ``"data"`` and replicated over ``"context"``
(unless ``expert_axes`` names it): each context shard dispatches its own tokens over
``"data"`` as above, its padding slots routed nowhere and left out of the statistics
(sum them over data and context). A
capacity's drops are decided over the whole batch from the routing alone, gathered over
both axes, so they are one device's (``_context_routing``).

With a ``capacity_factor`` each expert takes at most ``expert_capacity`` of the choices
one dispatch sees, chosen by a drop policy (``capacity_swiglu``), and runs them as
batched matmuls of static shape ``[E_local, capacity, d]``; the drops are counted.

The all-gather above is the default dispatcher (``dispatcher="all_gather"``): what drops
does not depend on the mesh. Per shard and direction it moves ``(D - 1) * t * d``
activations against the all-to-all minimum of ``(D - 1) / D * t * k * d`` (``t`` tokens
per shard, uniform routing): ``D / k`` times that minimum. ``dispatcher="all_to_all"``
(with a capacity factor) sends each routed choice only to its expert's shard
(``MoE._all_to_all``): a static ``[D, E_local, C, d]`` buffer per direction, ``C`` per
expert and source shard, so what drops depends on ``D``. Dropless
(``MoE._ragged_all_to_all``) it sends exactly the routed choices with
``jax.lax.ragged_all_to_all``, where the backend has it (``RAGGED_ALL_TO_ALL_PLATFORMS``:
XLA:CPU does not, jax 0.10.2, and such a MoE is refused there naming why).

The router runs in float32: the logits ``x @ router`` and their softmax, then top-k
(renormalised when ``normalize_top_k``, as in Mixtral and Qwen3-MoE; without it, as in
Qwen2-MoE with ``norm_topk_prob: false``). The weights are then cast to the activations'
dtype, as transformers does. Each call also returns ``RouterStats``, the sums that the
load-balancing loss (transformers' ``load_balancing_loss_func``) and the router z-loss
are built from, so they can be summed over layers and data shards before the loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.linear import default_kernel_init
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from flax_tp.collectives import (
  all_reduce,
  axis_is_bound,
  copy_to_parallel,
  gather_to_parallel,
  is_varying,
  reduce_scatter,
  shard_index,
)
from flax_tp.context import ContextSplit
from flax_tp.layer import ParallelModule, map_mesh
from flax_tp.linear import ColumnParallelDense, RowParallelDense, fused_column_parallel
from flax_tp.mesh import CONTEXT_AXIS, DATA_AXIS, MODEL_AXIS, MeshAxes, split_over
from flax_tp.padding import masked
from flax_tp.param_info import EXPERT_SPLIT, MESH_KEY, MODEL_SPLIT, NAMES_KEY, Split, keys_of
from flax_tp.params import place, sharded_param
from flax_tp.partition import ShardLayout
from flax_tp.sequence import SequenceSplit

Array = jax.Array

# Per expert, fan-in over its own input: the experts' leading axis is a batch axis.
default_expert_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
default_router_init = nnx.initializers.lecun_normal()


class RouterStats(NamedTuple):
  """Sums over the tokens a router saw (one layer's, or several layers' added up).

  ``counts [E]``: how many of the tokens' top-k choices picked each expert (the
  per-expert load, before any capacity drops); ``probs [E]``: the sum of the router's
  softmax probabilities per expert; ``z``: the sum of ``logsumexp(logits) ** 2``;
  ``tokens``: how many tokens; ``dropped``: how many choices a capacity dropped. Inside a
  map a shard counts the drops of its own experts, over every shard's tokens: like the
  rest, the shards' values sum to the whole. Sums, not means, so layers and data shards
  add up before the losses divide.
  """

  counts: Array
  probs: Array
  z: Array
  tokens: Array
  dropped: Array

  def __add__(self, other: RouterStats) -> RouterStats:  # type: ignore[override]
    return RouterStats(*(a + b for a, b in zip(self, other, strict=True)))

  def all_reduce(self, axis_name: str = DATA_AXIS) -> RouterStats:
    """The sums over every device of ``axis_name`` (inside a ``shard_map``)."""
    return RouterStats(*(all_reduce(x, "sum", axis_name) for x in self))


SCORES = ("softmax", "sigmoid")


class SelectionBias(nnx.Param):
  """A router's selection bias ``[E]`` (DeepSeek-V3's ``e_score_correction_bias``):
  float32, replicated, added to the scores only to pick the experts, never to the weights.
  A param (it is checkpointed, exported and moved with the rest) that the optimizer leaves
  out: ``nnx.Optimizer(model, tx, wrt=flax_tp.TRAINED)``; it gets no gradient."""


# The params an optimizer trains: every param but a router's selection bias.
TRAINED = nnx.All(nnx.Param, nnx.Not(SelectionBias))


@dataclasses.dataclass(frozen=True)
class Router:
  """How a router turns its logits into each token's experts and weights: a declaration,
  the one place the MoE families differ in routing.

  ``score``: ``"softmax"`` over the experts (Mixtral, Qwen) or an independent
  ``"sigmoid"`` per expert (DeepSeek-V3, GLM-4.5). ``groups`` / ``top_groups``
  (HF's ``n_group`` / ``topk_group``): the experts in ``groups`` equal groups, each
  group ranked by the sum of its two best scores (selection bias included), and a token's
  experts picked only from its ``top_groups`` best groups. The top-k are picked by score
  plus the selection bias (if any), and weighted by the score alone; ``normalize``
  renormalises them to sum to one (HF's ``norm_topk_prob``; a sigmoid's with
  transformers' ``1e-20`` in the denominator), and all are then multiplied by ``scale``
  (``routed_scaling_factor``).
  """

  top_k: int
  score: str = "softmax"
  normalize: bool = True
  groups: int = 1
  top_groups: int = 1
  scale: float = 1.0

  def __post_init__(self):
    if self.score not in SCORES:
      raise ValueError(f"router score must be one of {SCORES}, got {self.score!r}")
    for name in ("top_k", "groups", "top_groups"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"router {name} must be a positive integer, got {value!r}")
    if self.top_groups > self.groups:
      raise ValueError(f"router top_groups {self.top_groups} is more than its groups "
                       f"{self.groups}")
    if not (isinstance(self.scale, (int, float)) and 0 < self.scale < math.inf):
      raise ValueError(f"router scale must be a finite number > 0, got {self.scale!r}")

  def check(self, num_experts: int) -> None:
    """``ValueError`` naming what cannot route ``num_experts`` experts."""
    if num_experts % self.groups:
      raise ValueError(f"router groups {self.groups} do not divide num_experts {num_experts}")
    per_group = num_experts // self.groups
    if self.groups > 1 and per_group < 2:
      raise ValueError(f"router groups are ranked by their two best experts: "
                       f"{num_experts} experts in {self.groups} groups leave {per_group}")
    if self.top_k > self.top_groups * per_group:
      raise ValueError(f"top_k {self.top_k} is more than the {self.top_groups} x {per_group} "
                       f"experts of the groups a token may pick")

  def __call__(self, logits: Array, bias: Array | None = None
               ) -> tuple[Array, Array, Array]:
    """``logits [t, E]`` (float32) and ``bias [E]`` (or None) -> ``(weights [t, k],
    experts [t, k] int32, probs [t, E])``: ``probs`` is the softmax, or a sigmoid's scores
    normalised per token (DeepSeek-V3's balance loss's), which the load-balancing loss
    reads."""
    logits = logits.astype(jnp.float32)
    if self.score == "softmax":
      scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
      scores = jax.nn.sigmoid(logits)
      probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    # Picking is not differentiable: the bias moves which experts, never a weight.
    choice = scores if bias is None else scores + jax.lax.stop_gradient(
        bias.astype(jnp.float32))
    if self.groups > 1:
      t, e = choice.shape
      grouped = choice.reshape(t, self.groups, e // self.groups)
      group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [t, groups]
      _, best = jax.lax.top_k(group_scores, self.top_groups)
      allowed = jnp.any(jax.nn.one_hot(best, self.groups, dtype=bool), axis=-2)
      allowed = jnp.repeat(allowed, e // self.groups, axis=-1)
      choice = jnp.where(allowed, choice, -jnp.inf)
    values, experts = jax.lax.top_k(choice, self.top_k)
    weights = (values if choice is scores
               else jnp.take_along_axis(scores, experts, axis=-1))
    if self.normalize:
      total = jnp.sum(weights, axis=-1, keepdims=True)
      weights = weights / (total if self.score == "softmax" else total + 1e-20)
    if self.scale != 1.0:
      weights = weights * self.scale
    return weights, experts.astype(jnp.int32), probs


def route(logits: Array, top_k: int, normalize: bool) -> tuple[Array, Array, Array]:
  """``logits [t, E]`` (float32) -> ``(weights [t, k], experts [t, k], probs [t, E])``:
  the softmax, its top-k, renormalised to sum to one when ``normalize``
  (``Router(top_k, normalize=normalize)``)."""
  return Router(top_k, normalize=normalize)(logits)


def router_stats(logits: Array, probs: Array, experts: Array,
                 valid: Array | None = None) -> RouterStats:
  """The sums of one router call over its ``t`` tokens (``logits, probs [t, E]``,
  ``experts [t, k]``); ``valid [t]`` (bool), if given, leaves the false ones out
  (sequence padding)."""
  num_experts = probs.shape[-1]
  keep = (jnp.ones(probs.shape[:1], jnp.float32) if valid is None
          else valid.astype(jnp.float32))
  picked = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * keep[:, None, None]
  counts = jnp.sum(picked, axis=(0, 1))
  z = jnp.sum(keep * jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))
  return RouterStats(jax.lax.stop_gradient(counts), jnp.sum(probs * keep[:, None], axis=0), z,
                     jnp.sum(keep), jnp.zeros((), jnp.float32))


def load_balancing_loss(stats: RouterStats) -> Array:
  """transformers' ``load_balancing_loss_func`` (Switch Transformer's auxiliary loss) of
  the tokens ``stats`` sums over: ``E * sum_e f_e * P_e``. Here ``f_e`` is the fraction
  of top-k choices that picked expert ``e`` (summed over the k choices, as transformers
  sums its ``[k, E]`` means) and ``P_e`` is the mean router probability of ``e``.
  Several layers' stats added together give the loss of their concatenated router
  logits, as transformers computes it. Multiply by ``router_aux_loss_coef`` for the
  term a fine-tune adds to its loss.
  """
  num_experts = stats.probs.shape[-1]
  return num_experts * jnp.sum((stats.counts / stats.tokens) * (stats.probs / stats.tokens))


def router_z_loss(stats: RouterStats) -> Array:
  """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits) ** 2``."""
  return stats.z / stats.tokens


@dataclasses.dataclass(frozen=True)
class SwiGLU:
  """How an expert gates its FFN: the activation seam, the one place the MoE families
  differ in their experts' arithmetic.

  ``limit`` None: ``silu(gate) * up`` (Mixtral, Qwen, DeepSeek, GLM). With a ``limit``,
  GPT-OSS's clamped form (transformers' ``GptOssExperts._apply_gate``): ``gate`` capped
  above at ``limit``, ``up`` clipped to ``[-limit, limit]``, then ``(up + 1) * gate *
  sigmoid(alpha * gate)``. Both send a zero gate to zero, so FFN padding stays zero.
  """

  limit: float | None = None
  alpha: float = 1.702

  def __post_init__(self):
    for name in ("limit", "alpha"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise ValueError(f"SwiGLU {name} must be a finite number > 0, got {value!r}")

  def __call__(self, gate: Array, up: Array) -> Array:
    if self.limit is None:
      return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, self.limit)
    up = jnp.clip(up, -self.limit, self.limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


class ExpertBiases(NamedTuple):
  """This device's experts' biases (GPT-OSS): ``gate, up [E_local, I_local]`` (split as
  the FFN width is) and ``down [E_local, d]``, zero on the devices that must not add it
  (the FFN's partial sums over "model" add it once)."""

  gate: Array
  up: Array
  down: Array

  def rows(self, slots: Array) -> ExpertBiases:
    """The biases of each of ``slots [m]``'s experts (``E_local`` for none: zero)."""
    take = lambda b: jnp.take(b, slots, axis=0, mode="fill", fill_value=0)
    return ExpertBiases(*(take(b) for b in self))


def grouped_swiglu(x: Array, slots: Array, weights: Array, gate: Array, up: Array,
                   down: Array, precision: Any = None, *, biases: ExpertBiases | None = None,
                   activation: SwiGLU = SwiGLU()) -> Array:
  """The routed tokens through this device's experts, as three grouped matmuls.

  ``x [n, d]``; ``slots [n, k]``: the local expert each of a token's choices goes to,
  or ``E_local`` for a choice handled elsewhere; ``weights [n, k]``; ``gate, up
  [E_local, d, I]``, ``down [E_local, I, d]``; ``biases`` (or None) added to each
  matmul's output. Returns ``[n, d]``: for each token, the weighted sum of its local
  experts' outputs ``down(activation(gate x, up x))``.

  The ``n * k`` choices are sorted by expert (permute), run as ``ragged_dot`` over
  contiguous groups (choices handled elsewhere sort last, beyond the groups, and
  come out zero), and added back to their tokens (unpermute).
  """
  num_local = gate.shape[0]
  k = slots.shape[-1]
  flat = slots.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # [n * k]
  token = order // k
  sizes = jnp.bincount(flat, length=num_local + 1)[:num_local].astype(jnp.int32)
  xs = x[token]
  g = jax.lax.ragged_dot(xs, gate, sizes, precision=precision)
  u = jax.lax.ragged_dot(xs, up, sizes, precision=precision)
  if biases is not None:
    biases = biases.rows(flat[order])
    g, u = g + biases.gate, u + biases.up
  ys = jax.lax.ragged_dot(activation(g, u), down, sizes, precision=precision)
  if biases is not None:
    ys = ys + biases.down
  kept = jnp.where(flat < num_local, weights.reshape(-1), 0).astype(ys.dtype)[order]
  return jnp.zeros_like(x, dtype=ys.dtype).at[token].add(ys * kept[:, None])


# The platforms whose XLA implements jax.lax.ragged_all_to_all (the dropless all-to-all
# dispatcher's collective); XLA:CPU does not (jax 0.10.2: UNIMPLEMENTED).
RAGGED_ALL_TO_ALL_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})
# The collective itself (a module attribute so that a CPU test can put an emulation of its
# documented semantics, built from jax.lax.all_to_all, in its place).
ragged_all_to_all = jax.lax.ragged_all_to_all


def exclusive_cumsum(x: Array, axis: int = -1) -> Array:
  return jnp.cumsum(x, axis=axis) - x


DROP_POLICIES = ("probs", "position")
# How routed tokens reach the shards holding their experts: every shard's tokens to every
# shard ("all_gather", mesh-independent drops), or each routed choice only to its
# expert's shard and back ("all_to_all", with a capacity per source shard).
DISPATCHERS = ("all_gather", "all_to_all")

# The "probs" policy ranks an expert's choices by routing weight on this grid, then by
# position. Weights equal in exact arithmetic (the same token after the same prefix in
# two rows, as in indented code) come out one or two ulps apart, and which one is larger
# depends on how a mesh tiles the matmuls: ranked by the raw float the drops would follow
# the mesh's rounding. On the grid they are one value and the earlier token wins, on every
# mesh. Weights a grid step or more apart rank as before; two weights that straddle a grid
# line by an ulp still rank as the rounding says (about 1 in 1e4 ties), like top-k itself.
PROBS_RANK_GRID = 2.0 ** -10


def rank_weight(weights: Array) -> Array:
  """The routing weights as the ``"probs"`` drop policy ranks them: float32, rounded to
  the nearest multiple of ``PROBS_RANK_GRID``."""
  return jnp.round(weights.astype(jnp.float32) / PROBS_RANK_GRID)


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
  """Choices each expert takes under a capacity ``factor`` (Megatron's and GShard's):
  ``ceil(factor * tokens * top_k / num_experts)``, at least one, and at most ``tokens``:
  a token picks an expert at most once, so no expert can be sent more than every token
  (a larger factor is dropless, and costs no more memory than that)."""
  if tokens < 1:
    return 1
  per_token = factor * top_k / num_experts  # float: a huge factor overflows no int
  if per_token >= 1:
    return tokens
  return max(1, min(tokens, math.ceil(per_token * tokens)))


def capacity_is_capped(tokens: int, top_k: int, num_experts: int, factor: float) -> bool:
  """Whether ``factor`` asks for more than every token (``expert_capacity`` caps it)."""
  return factor * top_k / num_experts * tokens > tokens


def expert_queues(flat: Array, ranked: Array, position: Array, policy: str,
                  num_queues: int) -> tuple[Array, Array, Array]:
  """The drop policy's queues: ``m`` choices (``flat [m]``, each one's queue in ``0 ..
  num_queues``, ``num_queues`` for none; ``ranked [m]``, its ``rank_weight``;
  ``position [m]``, distinct, its token's place in the batch times ``k`` plus its place
  among the token's choices) sorted by queue, then for ``"probs"`` by weight (largest
  first), then by position. Returns ``(order [m], the sorted queues [m], each sorted
  choice's place in its queue [m])``: a queue keeps its first ``capacity``."""
  if policy == "probs":
    order = jnp.lexsort((position, -ranked, flat))
  else:
    order = jnp.lexsort((position, flat))
  sorted_queues = flat[order]
  sizes = jnp.bincount(flat, length=num_queues + 1)
  starts = jnp.cumsum(sizes) - sizes
  rank = jnp.arange(flat.shape[0]) - starts[sorted_queues]
  return order, sorted_queues, rank


def batched_swiglu(xe: Array, gate: Array, up: Array, down: Array,
                   precision: Any = None, *, biases: ExpertBiases | None = None,
                   activation: SwiGLU = SwiGLU()) -> Array:
  """Each local expert on its own rows: ``xe [E_local, c, d]`` -> ``[E_local, c, d]``,
  ``down(activation(gate x, up x))`` (plus the ``biases``) as three batched matmuls of
  static shape. An empty row comes out as the biases alone: no one reads it."""
  g = jnp.einsum("ecd,edi->eci", xe, gate, precision=precision)
  u = jnp.einsum("ecd,edi->eci", xe, up, precision=precision)
  if biases is not None:
    g, u = g + biases.gate[:, None], u + biases.up[:, None]
  y = jnp.einsum("eci,eid->ecd", activation(g, u), down, precision=precision)
  return y if biases is None else y + biases.down[:, None]


def capacity_swiglu(x: Array, slots: Array, weights: Array, gate: Array, up: Array,
                    down: Array, capacity: int, policy: str,
                    precision: Any = None, *, biases: ExpertBiases | None = None,
                    activation: SwiGLU = SwiGLU()) -> tuple[Array, Array]:
  """``grouped_swiglu`` with each local expert taking at most ``capacity`` choices.

  Each expert keeps, of the choices sent to it, those with the largest routing weight
  (``policy="probs"``, Megatron's default; weights on the grid of ``rank_weight``, so that
  a mesh's rounding cannot reorder equal ones) or those of the earliest tokens
  (``"position"``, GShard's), ties going to the earlier token; the rest are dropped:
  they add nothing to their token's output, which the residual carries (no
  renormalisation of the kept weights). The kept choices are laid out ``[E_local,
  capacity, d]`` and run through three batched matmuls of static shape.

  Returns ``(y [n, d], how many choices sent to these experts were dropped)``.
  """
  num_local, d = gate.shape[0], x.shape[-1]
  n, k = slots.shape
  flat, w = slots.reshape(-1), weights.reshape(-1)
  order, sorted_slots, rank = expert_queues(flat, rank_weight(w), jnp.arange(n * k), policy,
                                            num_local)
  routed_here = sorted_slots < num_local
  kept = routed_here & (rank < capacity)
  outside = num_local * capacity
  dest = jnp.where(kept, sorted_slots * capacity + rank, outside)
  token = order // k
  buffer = jnp.zeros((outside, d), x.dtype).at[dest].add(x[token], mode="drop")
  ye = batched_swiglu(buffer.reshape(num_local, capacity, d), gate, up, down,
                      precision, biases=biases, activation=activation).reshape(outside, d)
  ys = jnp.take(ye, dest, axis=0, mode="fill", fill_value=0)
  scale = jnp.where(kept, w[order], 0).astype(ys.dtype)
  y = jnp.zeros((n, d), ys.dtype).at[token].add(ys * scale[:, None])
  dropped = jnp.sum(routed_here & ~kept).astype(jnp.float32)
  return y, dropped


class MoE(ParallelModule):
  """A mixture-of-experts MLP: ``y = sum_k w_k expert_k(x)`` (+ a gated shared expert).

  Params (global, padded): ``router [d, E]`` replicated; ``gate, up [E_pad, d, I_pad]``
  and ``down [E_pad, I_pad, d]`` split over ``expert_axes`` on the experts (``"data"``
  by default; with ``"context"`` and/or ``"model"`` if named and on the mesh) and over
  ``"model"`` on the FFN width unless the experts are (see the module docstring); with
  ``shared_d_ff``, a
  dense ``shared_gate``/``shared_up`` (column) and ``shared_down`` (row) MLP of that
  width, and ``shared_expert_gate [d, 1]`` replicated (``shared_gated=False``: none, the
  shared expert added as is); with ``selection_bias``, ``selection_bias [E]`` float32
  replicated (a ``SelectionBias``: it picks, never weighs, and no optimizer trains it).

  ``router`` (a ``Router``; default the softmax top-k, renormalised if
  ``normalize_top_k``) declares how the experts are picked and weighted.
  ``dispatcher``: ``"all_gather"`` (below) or ``"all_to_all"``: each routed choice sent
  only to its expert's shard, with a capacity factor in static buffers (``_all_to_all``),
  dropless with ``jax.lax.ragged_all_to_all`` where XLA has it (``_ragged_all_to_all``).

  ``capacity_factor`` (None: dropless): each expert takes at most
  ``expert_capacity(t, top_k, E, capacity_factor)`` of the choices of the ``t`` tokens
  one dispatch sees (inside a step, the global batch: every data shard's tokens reach
  every shard, so what is dropped does not depend on the mesh), chosen by
  ``drop_policy`` (``capacity_swiglu``), and runs them as static-shape batched matmuls.
  A call with ``dropless=True`` (decoding) ignores it.

  Standalone: ``x [..., d]`` -> ``(y [..., d], RouterStats)`` over all the tokens, in
  one ``shard_map`` over the mesh, with the tokens split over ``"data"`` when it divides
  them. Inside a ``shard_map`` over ``("data", "model")``, ``x [..., d]`` is this data
  shard's tokens, replicated over ``"model"``. It returns ``y`` likewise, and the
  ``RouterStats`` of this shard's tokens (sum them over layers, then over ``"data"``
  with ``RouterStats.all_reduce``).
  """

  def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *,
               mesh: jax.sharding.Mesh, normalize_top_k: bool = True,
               shared_d_ff: int | None = None, capacity_factor: float | None = None,
               drop_policy: str = "probs", router: Router | None = None,
               selection_bias: bool = False, shared_gated: bool = True,
               router_bias: bool = False, expert_bias: bool = False,
               activation: SwiGLU | None = None,
               dispatcher: str = "all_gather", axis_name: str = MODEL_AXIS,
               expert_axes: str | tuple[str, ...] = MeshAxes.DEFAULT_EXPERT_ROLES,
               dtype: Any = None, param_dtype: Any = jnp.float32, precision: Any = None,
               expert_init: Any = default_expert_init,
               router_init: Any = default_router_init,
               kernel_init: Any = default_kernel_init, rngs: nnx.Rngs):
    self._init_mesh(mesh, axis_name)
    if DATA_AXIS not in mesh.axis_names:
      raise ValueError(f"MoE splits its experts over {DATA_AXIS!r}: the mesh "
                       f"{dict(mesh.shape)} has no such axis (use flax_tp.make_mesh)")
    for name, value in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts),
                        ("top_k", top_k)):
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if top_k > num_experts:
      raise ValueError(f"top_k {top_k} is more than num_experts {num_experts}")
    if capacity_factor is not None and not (
        isinstance(capacity_factor, (int, float, np.integer, np.floating))
        and not isinstance(capacity_factor, (bool, np.bool_))
        and 0 < capacity_factor < math.inf):
      raise ValueError(f"capacity_factor must be a number > 0 or None (dropless), got "
                       f"{capacity_factor!r}")
    if drop_policy not in DROP_POLICIES:
      raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
    if dispatcher not in DISPATCHERS:
      raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    platform = mesh.devices.flat[0].platform
    if (dispatcher == "all_to_all" and capacity_factor is None
        and platform not in RAGGED_ALL_TO_ALL_PLATFORMS):
      raise ValueError(f"dispatcher 'all_to_all' without a capacity_factor (dropless) needs "
                       f"jax.lax.ragged_all_to_all, which XLA on {platform!r} does not "
                       f"implement: give a capacity_factor, or use 'all_gather' for dropless")
    self.dispatcher = dispatcher
    if router is None:
      router = Router(top_k, normalize=normalize_top_k)
    if not isinstance(router, Router) or router.top_k != top_k:
      raise ValueError(f"router must be a flax_tp.moe.Router with top_k {top_k}, got "
                       f"{router!r}")
    router.check(num_experts)
    self.router_spec = router
    self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
    self.normalize_top_k = router.normalize
    self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
    # The mesh axes the experts split over (the record's rule: "data", and "context" or
    # "model" if asked, those with more than one device); with "model" among them each
    # expert is whole on its device and its FFN is not split.
    self.expert_axes = MeshAxes.of(mesh).expert_axes(expert_axes)
    if MODEL_AXIS in self.expert_axes and axis_name != MODEL_AXIS:
      raise ValueError(f"expert_axes {expert_axes!r} names {MODEL_AXIS!r}, but this MoE's "
                       f"tensor-parallel axis is {axis_name!r}")
    self.expert_layout = ShardLayout(
        num_experts, math.prod(mesh.shape[a] for a in self.expert_axes))
    self.ffn_layout = ShardLayout(
        d_ff, 1 if MODEL_AXIS in self.expert_axes else self.parallel_size)
    self.router = sharded_param(router_init, rngs.params(), (d_model, num_experts),
                                param_dtype, mesh=mesh, axis_name=axis_name, dim=None,
                                name="router")
    # A bias on the router's logits (GPT-OSS): it weighs as well as picks, and is
    # trained. Zeros (HF loads it) draw no key, so the other params are drawn as without.
    self.router_bias = sharded_param(
        nnx.initializers.zeros_init(), jax.random.key(0), (num_experts,), param_dtype,
        mesh=mesh, axis_name=axis_name, dim=None, name="router_bias") if router_bias else None
    if activation is not None and not isinstance(activation, SwiGLU):
      raise ValueError(f"activation must be a flax_tp.moe.SwiGLU, got {activation!r}")
    self.activation = activation or SwiGLU()
    # Float32 whatever param_dtype is (transformers keeps it so): a selection bias is
    # compared with scores ~1e-3 apart. Zeros (HF's init) draw no key: the other params
    # are drawn as without it.
    self.selection_bias = sharded_param(
        nnx.initializers.zeros_init(), jax.random.key(0), (num_experts,), jnp.float32,
        mesh=mesh, axis_name=axis_name, dim=None, name="selection_bias",
        variable_type=SelectionBias) if selection_bias else None
    self.gate = self._expert_param(expert_init, rngs, (num_experts, d_model, d_ff), 2)
    self.up = self._expert_param(expert_init, rngs, (num_experts, d_model, d_ff), 2)
    self.down = self._expert_param(expert_init, rngs, (num_experts, d_ff, d_model), 1)
    # Biases on each expert's three matmuls (GPT-OSS), zeros as transformers inits them
    # (drawing no key); the down bias is each expert's whole [d], not split over "model".
    self.expert_bias = expert_bias
    if expert_bias:
      zeros, key = nnx.initializers.zeros_init(), jax.random.key(0)
      self.gate_bias = self._expert_param(zeros, key, (num_experts, d_ff), 1)
      self.up_bias = self._expert_param(zeros, key, (num_experts, d_ff), 1)
      self.down_bias = self._expert_param(zeros, key, (num_experts, d_model), None)
    self.shared_d_ff, self.shared_gated = shared_d_ff, shared_gated
    if shared_d_ff:
      dense = dict(mesh=mesh, axis_name=axis_name, use_bias=False, dtype=dtype,
                   param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
                   rngs=rngs)
      self.shared_gate = ColumnParallelDense(d_model, shared_d_ff, gather_output=False,
                                             **dense)
      self.shared_up = ColumnParallelDense(d_model, shared_d_ff, gather_output=False,
                                           **dense)
      self.shared_down = RowParallelDense(shared_d_ff, d_model, input_is_parallel=True,
                                          **dense)
      self.shared_expert_gate = sharded_param(
          kernel_init, rngs.params(), (d_model, 1), param_dtype, mesh=mesh,
          axis_name=axis_name, dim=None, name="shared_expert_gate") if shared_gated else None

  def _expert_param(self, init: Any, rngs: nnx.Rngs | jax.Array, shape: tuple[int, ...],
                    ffn_dim: int | None) -> nnx.Param:
    """An experts' weight (or bias) drawn whole (as one ``init`` call on the logical
    shape; ``rngs`` or a key), padded on the experts (over ``expert_axes``) and on the
    FFN width ``ffn_dim`` (over "model", unless the experts are split over it; None: no
    FFN dim), and placed."""
    key = rngs.params() if isinstance(rngs, nnx.Rngs) else rngs
    full = init(key, shape, self.param_dtype)
    if not isinstance(full, jax.core.Tracer):  # (traced under nnx.eval_shape: stays so)
      full = np.asarray(full)  # pad on the host, as flax_tp.params.sharded_param does
    names = [None] * len(shape)
    axes = self.expert_axes
    names[0] = axes[0] if len(axes) == 1 else axes if axes else None
    stored = self.expert_layout.pad(full, 0)
    splits = (Split(EXPERT_SPLIT, 0, self.expert_layout),)
    if ffn_dim is not None:
      names[ffn_dim] = split_over(self.axis_name, self.ffn_layout.parts)
      stored = self.expert_layout.pad(self.ffn_layout.pad(full, ffn_dim), 0)
      splits += (Split(MODEL_SPLIT, ffn_dim, self.ffn_layout),)
    meta = {NAMES_KEY: tuple(names), MESH_KEY: self.mesh, **keys_of(dict(splits=splits))}
    return nnx.Param(place(stored, NamedSharding(self.mesh, P(*names))), **meta)

  # -- inside a map -------------------------------------------------------------

  def _local_experts(self) -> tuple[Array, Array, Array]:
    """This device's ``gate, up [E_local, d, I_local]`` and ``down [E_local, I_local, d]``,
    their FFN padding forced to zero (so its gradient is zero)."""
    e_local, i_local = self.expert_layout.padded_size, self.ffn_layout.padded_size
    shapes = {"gate": (e_local, self.d_model, i_local), "up": (e_local, self.d_model, i_local),
              "down": (e_local, i_local, self.d_model)}
    out = []
    for name, ffn_dim in (("gate", 2), ("up", 2), ("down", 1)):
      value = self._checked_local(name, getattr(self, name)[...], shapes[name])
      out.append(masked(value, self.ffn_layout, ffn_dim, self.axis_name))
    return tuple(out)

  def _local_biases(self, compute_dtype: Any) -> ExpertBiases | None:
    """This device's ``ExpertBiases`` in ``compute_dtype`` (None without them): the FFN
    padding of gate's and up's forced to zero, and down's zero on all but the first
    "model" device when the FFN is split over it (the partial sums, summed over
    "model", then hold it once; its gradient is that device's, summed back over "model"
    by the cast to varying)."""
    if not self.expert_bias:
      return None
    e_local, i_local = self.expert_layout.padded_size, self.ffn_layout.padded_size
    gate, up = (masked(self._checked_local(name, getattr(self, name)[...], (e_local, i_local)),
                       self.ffn_layout, 1, self.axis_name)
                for name in ("gate_bias", "up_bias"))
    down = self._checked_local("down_bias", self.down_bias[...], (e_local, self.d_model))
    if self.ffn_layout.parts > 1:
      down = jnp.where(shard_index(self.axis_name) == 0, down, jnp.zeros((), down.dtype))
    return ExpertBiases(*(b.astype(compute_dtype) for b in (gate, up, down)))

  def _route(self, x: Array, valid: Array | None = None):
    """``x [t, d]`` -> float32 ``(weights [t, k], experts [t, k], RouterStats)``."""
    logits = jnp.dot(x.astype(jnp.float32), self.router[...].astype(jnp.float32),
                     precision=self.precision)
    if self.router_bias is not None:
      logits = logits + self.router_bias[...].astype(jnp.float32)
    bias = None if self.selection_bias is None else self.selection_bias[...]
    weights, experts, probs = self.router_spec(logits, bias)
    return weights, experts, router_stats(logits, probs, experts, valid)

  def _local(self, x: Array, seq: SequenceSplit | None = None, dropless: bool = False,
             context: ContextSplit | None = None) -> tuple[Array, RouterStats]:
    compute_dtype = self.dtype or jnp.result_type(x.dtype, self.param_dtype)
    # Context parallel: this device's slots hold tokens of the sequence, the padding
    # slots past its end none (ContextSplit.real): those are routed nowhere and left out
    # of the statistics.
    real = None if context is None else context.real()  # [local_len]
    if seq is None:
      shape = x.shape
      tokens = x.reshape(-1, self.d_model)
      valid = None if real is None else jnp.broadcast_to(real, shape[:-1]).reshape(-1)
      weights, experts, stats = self._route(tokens, valid)
    else:
      # Sequence parallelism: x [b, s_pad, d] is this device's block of the sequence.
      # Each device routes its own block (the replicated router and gate then get each
      # token's gradient once), its padding rows left out of the statistics; then the
      # tokens and their routing are gathered to the whole sequence [b, s, d], as the
      # dense MLP gathers its input.
      b, s_pad, _ = x.shape
      mask = seq.layout.local_mask(shard_index(self.axis_name))
      if real is not None:
        mask = mask & seq.block(real[None])[0]
      valid = jnp.broadcast_to(mask[None], (b, s_pad)).reshape(-1)
      weights, experts, stats = self._route(x.reshape(-1, self.d_model), valid)
      stats = stats.all_reduce(self.axis_name)
      weights, experts = (seq.gather(t.reshape(b, s_pad, -1)) for t in (weights, experts))
      whole = seq.gather(x)
      shape = whole.shape
      tokens = whole.reshape(-1, self.d_model)
      weights, experts = weights.reshape(-1, self.top_k), experts.reshape(-1, self.top_k)
      valid = None if real is None else jnp.broadcast_to(real, shape[:-1]).reshape(-1)
    routed, context_dropped = None, None
    if context is not None and self._to_all(dropless):  # padding slots sent nowhere
      routed = jnp.broadcast_to(valid[:, None], experts.shape)
    elif context is not None:
      routed, context_dropped = self._context_routing(x, weights, experts, valid, shape[0],
                                                      context, dropless)
    y, dropped = self._routed(tokens.astype(compute_dtype), weights.astype(compute_dtype),
                              experts, compute_dtype, dropless, routed)
    stats = stats._replace(dropped=dropped if context_dropped is None else context_dropped)
    y = y.reshape(shape[:-1] + (self.d_model,))
    if seq is None:
      y = all_reduce(y, "sum", self.axis_name)
    else:  # back to this device's block: one reduce-scatter over the sequence
      y = reduce_scatter(seq.for_scatter(y), axis=1, axis_name=self.axis_name)
    if self.shared_d_ff:
      y = y + self._shared(tokens.reshape(shape).astype(compute_dtype), compute_dtype,
                           x.astype(compute_dtype), seq)
    return y, stats

  def _context_routing(self, x: Array, weights: Array, experts: Array, valid: Array,
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
    block = 0
    for a in axes:
      block = block * jax.lax.axis_size(a) + shard_index(a)
    mine = jax.lax.dynamic_slice_in_dim(kept.reshape(-1, k), block * queue.shape[0],
                                        queue.shape[0])
    dropped = jnp.sum(routed & ~mine).astype(jnp.float32)
    if is_varying(dropped, self.axis_name):  # sequence parallel: equal on every device
      dropped = jax.lax.pmax(dropped, self.axis_name)
    return routed & mine, dropped

  def _to_all(self, dropless: bool) -> bool:
    """Whether this call dispatches by all-to-all (a dropless call, decoding, gathers)."""
    return self.dispatcher == "all_to_all" and not dropless

  def _routed(self, xc: Array, weights: Array, experts: Array, compute_dtype: Any,
              dropless: bool, routed: Array | None = None) -> tuple[Array, Array]:
    """This device's tokens ``xc [n, d]`` with their routing ``weights, experts [n, k]``
    through the experts: ``[n, d]``, this device's partial sum over ``"model"`` (the
    caller reduces it), and how many choices this device's experts dropped (zero
    without a capacity). ``routed [n, k]`` (context parallel): the choices that go to
    their experts, all of them run dropless; the others add nothing
    (``_context_routing`` decided).

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
    if exchange and self._to_all(dropless):
      to_all = self._all_to_all if self.capacity_factor else self._ragged_all_to_all
      return to_all(xc, weights, experts, compute_dtype, exchange, summed, routed)
    if exchange:
      xc = gather_to_parallel(xc, axis=0, axis_name=exchange)
      weights = gather_to_parallel(weights, axis=0, axis_name=exchange)
      experts = jax.lax.all_gather(experts, exchange, axis=0, tiled=True)
      if routed is not None:
        routed = jax.lax.all_gather(routed, exchange, axis=0, tiled=True)
    offsets = jnp.asarray(layout.offsets, jnp.int32)
    owner = jnp.searchsorted(offsets, experts, side="right") - 1
    here = 0  # this device's block of the experts: row-major over expert_axes
    for a in self.expert_axes:
      here = here * jax.lax.axis_size(a) + shard_index(a)
    mine = owner == here if routed is None else (owner == here) & routed
    slots = jnp.where(mine, experts - offsets[owner], layout.padded_size)
    gate, up, down = (w.astype(compute_dtype) for w in self._local_experts())
    experts_kw = dict(biases=self._local_biases(compute_dtype), activation=self.activation)
    xc = copy_to_parallel(xc, self.axis_name)
    dropped = jnp.zeros((), jnp.float32)
    if self.capacity_factor is None or dropless or routed is not None:
      y = grouped_swiglu(xc, slots, weights, gate, up, down, self.precision, **experts_kw)
    else:
      capacity = expert_capacity(xc.shape[0], self.top_k, self.num_experts,
                                 self.capacity_factor)
      y, dropped = capacity_swiglu(xc, slots, weights, gate, up, down, capacity,
                                   self.drop_policy, self.precision, **experts_kw)
      dropped = jax.lax.stop_gradient(dropped)
      if self.axis_name in self.expert_axes:  # each model shard its own experts'
        dropped = all_reduce(dropped, "sum", self.axis_name)
      elif is_varying(dropped, self.axis_name):  # sequence parallel: equal on every device
        dropped = jax.lax.pmax(dropped, self.axis_name)
      if summed:  # the same tokens on those devices: each its own experts'
        dropped = all_reduce(dropped, "sum", summed)
    if exchange:  # each token's partial outputs back to its own device, summed
      y = reduce_scatter(y, axis=0, axis_name=exchange)
    if summed:
      y = all_reduce(y, "sum", summed)
    return y, dropped

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
    if self.axis_name in self.expert_axes:  # each model device its own experts' choices
      dropped = all_reduce(dropped, "sum", self.axis_name)
    elif is_varying(dropped, self.axis_name):  # sequence parallel: equal on every device
      dropped = jax.lax.pmax(dropped, self.axis_name)
    if summed:
      dropped = all_reduce(dropped, "sum", summed)
    return dropped

  def _ragged_all_to_all(self, xc: Array, weights: Array, experts: Array,
                         compute_dtype: Any, exchange: tuple[str, ...],
                         summed: tuple[str, ...], routed: Array | None
                         ) -> tuple[Array, Array]:
    """``_routed`` by all-to-all, dropless: exactly this device's routed choices sent to
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
    me = 0
    for a in exchange:
      me = me * jax.lax.axis_size(a) + shard_index(a)
    earlier = jnp.arange(devices) < me
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
    gate, up, down = (w_.astype(compute_dtype) for w_ in self._local_experts())
    ye = grouped_swiglu(copy_to_parallel(received, self.axis_name), slot[:, None],
                        jnp.ones((rows, 1), compute_dtype), gate, up, down, self.precision,
                        biases=self._local_biases(compute_dtype), activation=self.activation)
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
                  routed: Array | None) -> tuple[Array, Array]:
    """``_routed`` by all-to-all: this device's ``n`` tokens' choices sent only to the
    devices (over ``exchange``) holding their experts, and the outputs sent back.

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
    gate, up, down = (w_.astype(compute_dtype) for w_ in self._local_experts())
    ye = batched_swiglu(copy_to_parallel(xe, self.axis_name), gate, up, down, self.precision,
                        biases=self._local_biases(compute_dtype), activation=self.activation)
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

  def _shared(self, x: Array, compute_dtype: Any, block: Array,
              seq: SequenceSplit | None) -> Array:
    """The gated shared expert of ``x [..., d]`` (replicated over "model"), or under
    sequence parallelism of the whole sequence ``x [b, s, d]`` with ``block [b, s_pad,
    d]`` this device's part of it, the output then reduce-scattered to the block."""
    gate, up = fused_column_parallel((self.shared_gate, self.shared_up), x)
    hidden = jax.nn.silu(gate) * up
    if seq is None:
      shared = self.shared_down(hidden)
    else:
      down = self.shared_down
      shared = down._local(*down._params(), seq.for_scatter(hidden), parallel_input=True,
                           scatter=True)
    if self.shared_expert_gate is None:  # DeepSeek-V3, GLM-4.5: shared experts ungated
      return shared
    gate_logit = jnp.dot(block, self.shared_expert_gate[...].astype(compute_dtype),
                         precision=self.precision)
    return jax.nn.sigmoid(gate_logit) * shared

  # -- standalone ------------------------------------------------------------------

  def __call__(self, x: Array, seq: SequenceSplit | None = None, *,
               dropless: bool = False,
               context: ContextSplit | None = None) -> tuple[Array, RouterStats]:
    """``seq`` (inside a ``shard_map``, sequence parallelism): ``x [b, s_pad, d]`` is this
    device's block of the sequence, split as ``seq`` says (padding rows zero), and so is
    the output; the statistics are still this data shard's whole sequence's.
    ``context`` (inside a ``shard_map`` with a context axis, context parallelism):
    ``x [b, local_len, d]`` is this device's slots of the sequence (``seq``, if given,
    then splits those); the padding slots are routed nowhere and counted in no
    statistic, and a capacity drops what it drops on one device (``_context_routing``).
    The statistics are this device's tokens': sum them over data and context.
    ``dropless``: ignore ``capacity_factor`` (a decode step routes as transformers does)."""
    if x.shape[-1] != self.d_model:
      raise ValueError(f"MoE expects inputs [..., {self.d_model}], got {tuple(x.shape)}")
    if self._is_local():
      unbound = [a for a in (DATA_AXIS, *self.expert_axes, self.axis_name)
                 if not axis_is_bound(a)]
      if unbound:
        raise ValueError(f"MoE inside a shard_map needs the axes {unbound} bound: its "
                         f"experts are split over {self.expert_axes or (DATA_AXIS,)} and "
                         f"their FFN over {self.axis_name!r}")
      if seq is not None and (x.ndim != 3 or x.shape[1] != seq.layout.padded_size
                              or self.axis_name != MODEL_AXIS):
        raise ValueError(f"MoE with sequence parallelism expects this device's block "
                         f"[b, {seq.layout.padded_size}, {self.d_model}] over {MODEL_AXIS!r}, "
                         f"got {tuple(x.shape)} over {self.axis_name!r}")
      if context is not None:
        if not axis_is_bound(CONTEXT_AXIS):
          raise ValueError(f"MoE(context=...) needs the {CONTEXT_AXIS!r} axis bound")
        slots = seq.layout.size if seq is not None else x.shape[1] if x.ndim == 3 else None
        if x.ndim != 3 or slots != context.local_len:
          raise ValueError(f"MoE with context parallelism expects this device's "
                           f"{context.local_len} slots [b, {context.local_len}, "
                           f"{self.d_model}], got {tuple(x.shape)}")
      return self._local(x, seq, dropless, context)
    if seq is not None or context is not None:
      raise ValueError("MoE(seq=..., context=...) is for a call inside a shard_map "
                       "(sequence or context parallelism)")
    if math.prod(x.shape[:-1]) == 0:  # no tokens: an empty output, as nnx.Linear gives
      dtype = self.dtype or jnp.result_type(x.dtype, self.param_dtype)
      zero = jnp.zeros((), jnp.float32)
      return (jnp.zeros(x.shape, dtype),
              RouterStats(jnp.zeros((self.num_experts,), jnp.float32),
                          jnp.zeros((self.num_experts,), jnp.float32), zero, zero, zero))
    stats_sharding = RouterStats(*(NamedSharding(self.mesh, P()),) * len(RouterStats._fields))
    run = lambda x: self._call_standalone(x, dropless)
    if self.mesh.axis_types[0] != AxisType.Explicit:
      return run(x)
    out = (NamedSharding(self.mesh, P(*(None,) * x.ndim)), stats_sharding)
    return jax.sharding.auto_axes(run, out_sharding=out)(x)

  def _call_standalone(self, x: Array, dropless: bool) -> tuple[Array, RouterStats]:
    mesh = map_mesh(self.mesh)
    tokens = x.reshape(-1, self.d_model)
    data = self.mesh.shape[DATA_AXIS]
    split = data > 1 and tokens.shape[0] % data == 0
    x_spec = P(DATA_AXIS) if split else P()
    graphdef, state = nnx.split(self)

    def local(state, tokens):
      y, stats = nnx.merge(graphdef, state)._local(tokens, dropless=dropless)
      return y, (stats.all_reduce(DATA_AXIS) if split else stats)

    y, stats = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(nnx.get_partition_spec(state), x_spec),
        out_specs=(x_spec, RouterStats(*(P(),) * len(RouterStats._fields))),
        check_vma=True))(state, tokens)
    return y.reshape(x.shape), stats
