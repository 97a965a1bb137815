"""The MoE layer: its params and their placement, the router's call, the dispatch, the
shared expert, and the standalone call (one ``shard_map`` over the mesh).

What the layer computes and where each piece lives: ``flax_tp.moe``'s docstring.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.linear import default_kernel_init
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from flax_tp.collectives import all_reduce, axis_is_bound, reduce_scatter, shard_index
from flax_tp.context import ContextSplit
from flax_tp.layer import ParallelModule, map_mesh
from flax_tp.linear import ColumnParallelDense, RowParallelDense, fused_column_parallel
from flax_tp.mesh import CONTEXT_AXIS, DATA_AXIS, MODEL_AXIS, MeshAxes, split_over
from flax_tp.moe import dispatch
from flax_tp.moe.dispatch import Dispatcher
from flax_tp.moe.experts import (
  DROP_POLICIES,
  ExpertBiases,
  LocalExperts,
  SwiGLU,
  capacity_is_capped,
  expert_capacity,
)
from flax_tp.moe.router import Router, RouterStats, SelectionBias, router_stats
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
  only to its expert's shard, with a capacity factor in static buffers, dropless with
  ``jax.lax.ragged_all_to_all`` where XLA has it (``flax_tp.moe.dispatch``).

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
    dispatch.check_dispatcher(dispatcher, capacity_factor, mesh.devices.flat[0].platform)
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
    # Each expert whole on its device (its FFN not split) as asked, whatever the model
    # axis's size (the start-up line's wording: ``describe``).
    self.whole_experts = MODEL_AXIS in MeshAxes.of(mesh).expert_roles(expert_axes)
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

  def _local_weights(self, compute_dtype: Any) -> LocalExperts:
    """This device's experts as the dispatcher runs them, in ``compute_dtype``."""
    gate, up, down = (w.astype(compute_dtype) for w in self._local_experts())
    return LocalExperts(gate, up, down, self._local_biases(compute_dtype), self.activation,
                        self.precision)

  def dispatch(self) -> Dispatcher:
    """How this layer's routed choices reach their experts (``flax_tp.moe.dispatch``),
    and whether what a capacity drops depends on the mesh
    (``.drops_depend_on_mesh``)."""
    return Dispatcher(self.dispatcher, self.num_experts, self.top_k, self.expert_layout,
                      self.expert_axes, self.axis_name, self.capacity_factor, self.drop_policy)

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
    dispatch = self.dispatch()
    routed, context_dropped = None, None
    if context is not None and dispatch.to_all(dropless):  # padding slots sent nowhere
      routed = jnp.broadcast_to(valid[:, None], experts.shape)
    elif context is not None:
      routed, context_dropped = dispatch.context_routing(x, weights, experts, valid, shape[0],
                                                         context, dropless)
    y, dropped = dispatch(tokens.astype(compute_dtype), weights.astype(compute_dtype),
                          experts, compute_dtype, dropless, routed, self._local_weights)
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

  # -- the start-up line ------------------------------------------------------------

  def describe(self, tokens: int, unit: str = "step") -> str:
    """How this layer is laid out and dispatches, for a ``unit`` (a step, or a
    microbatch routed and capped on its own) of ``tokens`` tokens: ``top-k (the
    router), the capacity | over the expert axes: experts per shard | the FFN | the
    dispatch`` (``train/run.py``'s start-up line)."""
    k, e, factor = self.top_k, self.num_experts, self.capacity_factor
    mesh_axes = MeshAxes.of(self.mesh)
    over = self.expert_axes
    exchanged = [a for a in over if a in mesh_axes.BATCH_ROLES]
    to_all = self.dispatcher == "all_to_all" and bool(exchanged)
    if to_all:
      dispatch = [f"each routed choice sent all-to-all over {' x '.join(exchanged)} to its "
                  "expert's shard, its output back"]
    else:
      dispatch = [f"tokens all-gathered over {' x '.join(exchanged)}, outputs "
                  "reduce-scattered back"] if exchanged else []
    if MODEL_AXIS in over:
      dispatch.append("each model device runs its own experts, outputs summed over model")
    dispatch = "; ".join(dispatch) or "every expert on every device: no dispatch"
    spec = self.router_spec
    router = []  # beyond Mixtral's softmax top-k (DeepSeek-V3, GLM-4.5)
    if spec.score != "softmax":
      router.append(f"{spec.score} scores")
    if self.selection_bias is not None:
      router.append("picked with a selection bias")
    if spec.groups > 1:
      router.append(f"from the best {spec.top_groups} of {spec.groups} groups")
    if spec.scale != 1.0:
      router.append(f"weights x {spec.scale:g}")
    router = f" ({', '.join(router)})" if router else ""
    keeps = "largest weights" if self.drop_policy == "probs" else "earliest tokens"
    if factor is None:
      capacity = "dropless"
    elif to_all:  # Megatron's per-rank capacity: each source shard's own choices
      local = tokens // math.prod(mesh_axes.size(a) for a in exchanged)
      per_expert = expert_capacity(local, k, e, factor)
      if per_expert >= local:  # an expert can take every token of a shard: no drops
        capacity = (f"capacity factor {factor:g} per source shard, room for each shard's "
                    f"{local} tokens: nothing dropped")
      else:
        capacity = (f"capacity factor {factor:g} per source shard ({per_expert} of each "
                    f"shard's {local} tokens per expert: what drops depends on the "
                    f"{' x '.join(exchanged)} axis), full experts keep the {keeps}")
    elif capacity_is_capped(tokens, k, e, factor):  # never a buffer past every token
      capacity = (f"capacity factor {factor:g}, capped at all {tokens} tokens of a {unit} "
                  "(an expert can take no more): nothing dropped")
    else:
      capacity = (f"capacity factor {factor:g} ({expert_capacity(tokens, k, e, factor)} of a "
                  f"{unit}'s {tokens} tokens per expert), full experts keep the {keeps}")
    experts = self.expert_layout
    padded = "" if experts.is_even else f" (padded to {experts.padded_size})"
    ffn = (f"each expert whole on its device (FFN {self.d_ff})" if self.whole_experts else
           f"each expert's FFN {self.d_ff} over model: "
           f"{', '.join(map(str, self.ffn_layout.sizes))}")
    shared = (f" | shared expert FFN {self.shared_d_ff}{'' if self.shared_gated else ', ungated'}"
              if self.shared_d_ff else "")
    return (f"top-{k}{router}, {capacity} | over {' x '.join(over or ('data',))}: "
            f"{', '.join(map(str, experts.sizes))} per shard{padded} | {ffn}{shared} | "
            f"{dispatch}")

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
    statistic, and a capacity drops what it drops on one device (``Dispatcher.context_routing``).
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
