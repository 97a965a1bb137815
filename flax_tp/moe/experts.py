"""An expert's arithmetic on one device: the SwiGLU activation, the grouped and batched
matmuls over this device's experts, the capacity a dispatch gives each expert and the
queues a drop policy fills it from.

Nothing here communicates: ``flax_tp.moe.dispatch`` brings the routed tokens to these
functions and takes their outputs back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


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


DROP_POLICIES = ("probs", "position")


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


class LocalExperts(NamedTuple):
  """This device's experts as a dispatcher runs them, in the compute dtype: ``gate, up
  [E_local, d, I_local]`` and ``down [E_local, I_local, d]`` (their FFN padding zero),
  their ``ExpertBiases`` (None without), the activation and the matmuls' precision."""
  gate: Array
  up: Array
  down: Array
  biases: ExpertBiases | None
  activation: SwiGLU
  precision: Any

  def grouped(self, x: Array, slots: Array, weights: Array) -> Array:
    """``grouped_swiglu`` of ``x [n, d]`` routed to ``slots [n, k]`` with ``weights``."""
    return grouped_swiglu(x, slots, weights, self.gate, self.up, self.down, self.precision,
                          biases=self.biases, activation=self.activation)

  def batched(self, xe: Array) -> Array:
    """``batched_swiglu`` of ``xe [E_local, c, d]``."""
    return batched_swiglu(xe, self.gate, self.up, self.down, self.precision,
                          biases=self.biases, activation=self.activation)

  def capped(self, x: Array, slots: Array, weights: Array, capacity: int,
             policy: str) -> tuple[Array, Array]:
    """``capacity_swiglu``: at most ``capacity`` choices per expert, by ``policy``."""
    return capacity_swiglu(x, slots, weights, self.gate, self.up, self.down, capacity, policy,
                           self.precision, biases=self.biases, activation=self.activation)
