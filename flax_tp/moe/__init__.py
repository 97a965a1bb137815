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
both axes, so they are one device's (``Dispatcher.context_routing``).

With a ``capacity_factor`` each expert takes at most ``expert_capacity`` of the choices
one dispatch sees, chosen by a drop policy (``capacity_swiglu``), and runs them as
batched matmuls of static shape ``[E_local, capacity, d]``; the drops are counted.

The all-gather above is the default dispatcher (``dispatcher="all_gather"``): what drops
does not depend on the mesh. Per shard and direction it moves ``(D - 1) * t * d``
activations against the all-to-all minimum of ``(D - 1) / D * t * k * d`` (``t`` tokens
per shard, uniform routing): ``D / k`` times that minimum. ``dispatcher="all_to_all"``
(with a capacity factor) sends each routed choice only to its expert's shard: a static
``[D, E_local, C, d]`` buffer per direction, ``C`` per expert and source shard, so what
drops depends on ``D`` (``Dispatcher.drops_depend_on_mesh``). Dropless it sends exactly
the routed choices with
``jax.lax.ragged_all_to_all``, where the backend has it (``RAGGED_ALL_TO_ALL_PLATFORMS``:
XLA:CPU does not, jax 0.10.2, and such a MoE is refused there naming why).

The router runs in float32: the logits ``x @ router`` and their softmax, then top-k
(renormalised when ``normalize_top_k``, as in Mixtral and Qwen3-MoE; without it, as in
Qwen2-MoE with ``norm_topk_prob: false``). The weights are then cast to the activations'
dtype, as transformers does. Each call also returns ``RouterStats``, the sums that the
load-balancing loss (transformers' ``load_balancing_loss_func``) and the router z-loss
are built from, so they can be summed over layers and data shards before the loss.

The package, by idea: ``router`` (routers, their statistics and losses), ``experts`` (an
expert's arithmetic on one device: SwiGLU, grouped and batched matmuls, capacity and
queues), ``dispatch`` (how routed choices reach their experts' devices and come back:
the ``Dispatcher``), ``layer`` (the ``MoE`` module). Every public name is here.
"""

from flax_tp.moe.dispatch import (
  DISPATCHERS,
  RAGGED_ALL_TO_ALL_PLATFORMS,
  Dispatcher,
  exclusive_cumsum,
  ragged_all_to_all,
)
from flax_tp.moe.experts import (
  DROP_POLICIES,
  PROBS_RANK_GRID,
  ExpertBiases,
  LocalExperts,
  SwiGLU,
  batched_swiglu,
  capacity_is_capped,
  capacity_swiglu,
  expert_capacity,
  expert_queues,
  grouped_swiglu,
  rank_weight,
)
from flax_tp.moe.layer import MoE, default_expert_init, default_router_init
from flax_tp.moe.router import (
  SCORES,
  TRAINED,
  Router,
  RouterStats,
  SelectionBias,
  load_balancing_loss,
  route,
  router_stats,
  router_z_loss,
)

__all__ = ["DISPATCHERS", "DROP_POLICIES", "PROBS_RANK_GRID", "RAGGED_ALL_TO_ALL_PLATFORMS",
           "SCORES", "TRAINED", "Dispatcher", "ExpertBiases", "LocalExperts", "MoE", "Router",
           "RouterStats", "SelectionBias", "SwiGLU", "batched_swiglu", "capacity_is_capped",
           "capacity_swiglu", "default_expert_init", "default_router_init",
           "exclusive_cumsum", "expert_capacity", "expert_queues", "grouped_swiglu",
           "load_balancing_loss", "ragged_all_to_all", "rank_weight", "route", "router_stats",
           "router_z_loss"]
