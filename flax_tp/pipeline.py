"""Pipeline parallelism over the mesh's ``"stage"`` axis: each stage holds some of the
stacked layers, and microbatches flow through the stages inside the step's one
``shard_map``.

Where the layers live (``StagePlan``): a model's ``L`` layers are cut into ``S * R``
groups of ``G = ceil(L / (S * R))`` consecutive layers (``R``: the repeats, 1 for GPipe);
group ``g`` sits on stage ``g mod S``, so each stage holds ``R`` non-adjacent groups
(the circular schedule, MaxText's ``num_pipeline_repeats``; Megatron's interleaved
virtual stages). Layers past ``L`` that fill the last groups are identity layers: all
their params zero, their output replaced by their input, never saved. A stacked param
``[L, ...]`` is stored ``[S * R * G, ...]`` split over ``"stage"`` on its leading axis,
each stage's groups in repeat order (``ParamInfo.layer_slots`` says which layer each
slot holds): per-layer names, checkpoints and HF export stay the unpipelined model's.

How a step runs (``run_pipeline``, inside the ``shard_map``): the embedding runs on every
stage (its params are replicated over ``"stage"``) and the batch is cut into ``M``
microbatches. At iteration ``t`` stage ``s`` runs its group of repeat ``r`` on
microbatch ``m``, where ``t - s = r * P + m`` and ``P = max(M, S)`` for the circular
schedule (``M`` for GPipe); then every stage hands its output to the next with one
``ppermute`` over ``"stage"`` (the last stage's, under the circular schedule, goes back
to stage 0, which keeps it until that microbatch's next repeat). After ``(R - 1) * P + M
+ S - 1`` iterations the last stage holds every microbatch's output, which one
all-reduce over ``"stage"`` gives every stage, so the final norm, the head and the loss
run as in the unpipelined model. The backward pass is the forward's transpose (the
``ppermute``s reversed), by ``jax.grad``. A stage idles, computing what is thrown away,
for ``1 - R * M / iterations`` of the step (the bubble: ``(S - 1) / (R * M + S - 1)``
when ``M >= S``).

The 1F1B schedule (``pipeline_1f1b_loss``; GPipe's plan) instead takes the loss inside
the pipeline: at iteration ``t`` stage ``s`` runs microbatch ``t - s`` forward and ``t -
2(S - 1) + s`` backward (``one_f_one_b``), keeping each microbatch's stage input until its
backward recomputes the stage's forward from it under ``jax.vjp``; the last stage runs the
head and the loss on a microbatch as soon as it leaves the layers and starts its backward
in the same iteration. A stage so holds ``min(M, 2S - 1)`` inputs, not every microbatch's
activations.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from flax_tp.collectives import all_reduce
from flax_tp.data_parallel import gather_block
from flax_tp.mesh import STAGE_AXIS
from flax_tp.param_info import ParamInfo, record
from flax_tp.remat import remat_policy

SCHEDULES = ("gpipe", "circular", "1f1b")


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """Which layers each pipeline stage holds, and in what order it runs them.

  ``layers``: the model's layers ``L``; ``stages``: ``S``; ``repeats``: ``R``, the
  groups each stage holds (1: GPipe; more: the circular schedule); ``schedule``: the
  schedule asked for (a circular plan of one repeat runs as GPipe does).
  """

  layers: int
  stages: int
  repeats: int = 1
  schedule: str = "gpipe"

  @classmethod
  def of(cls, layers: int, stages: int, schedule: str = "gpipe",
         repeats: int | None = None) -> StagePlan:
    """The plan of ``schedule`` (``SCHEDULES``): GPipe holds one group of consecutive
    layers per stage; the circular schedule ``repeats`` groups per stage (default: as
    many as there are layers per stage, one layer per group, the smallest bubble).
    ``ValueError`` naming the value for an unknown schedule or a bad repeat count."""
    if schedule not in SCHEDULES:
      raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule != "circular":
      if repeats not in (None, 1):
        raise ValueError(f"pipeline_repeats={repeats!r} is for the circular schedule; "
                         f"{schedule} holds one group of layers per stage")
      repeats = 1
    elif repeats is None:
      repeats = max(1, math.ceil(layers / stages))
    return cls(layers, stages, repeats, schedule)

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    if self.schedule != "circular" and self.repeats != 1:
      raise ValueError(f"{self.schedule} holds one group of layers per stage, got "
                       f"repeats={self.repeats}")
    for name in ("layers", "stages", "repeats"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"pipeline {name} must be a positive integer, got {value!r}")

  @property
  def group(self) -> int:
    """``G``: the layers of one group (one stage's share of one repeat)."""
    return math.ceil(self.layers / (self.stages * self.repeats))

  @property
  def slots(self) -> int:
    """The stored layers, identity layers included: ``S * R * G``."""
    return self.stages * self.repeats * self.group

  def layer_at(self, stage: int, repeat: int, j: int) -> int:
    """The layer number of the ``j``-th layer of ``stage``'s group of ``repeat`` (``>=
    layers`` for an identity layer)."""
    return (repeat * self.stages + stage) * self.group + j

  @property
  def slot_layers(self) -> tuple[int | None, ...]:
    """The layer each stored slot holds, in stored order (stage by stage, each stage's
    groups in repeat order); None for an identity layer."""
    out = []
    for stage in range(self.stages):
      for repeat in range(self.repeats):
        for j in range(self.group):
          layer = self.layer_at(stage, repeat, j)
          out.append(layer if layer < self.layers else None)
    return tuple(out)

  def stage_layers(self, stage: int) -> list[int]:
    """The model's layers ``stage`` holds, in the order it runs them."""
    per_stage = self.repeats * self.group
    return [layer for layer in self.slot_layers[stage * per_stage:(stage + 1) * per_stage]
            if layer is not None]

  def period(self, microbatches: int) -> int:
    """``P``: iterations between a microbatch's repeats at one stage (its output must be
    back at stage 0 first: ``max(M, S)`` with repeats)."""
    return microbatches if self.repeats == 1 else max(microbatches, self.stages)

  def iterations(self, microbatches: int) -> int:
    """The pipeline's iterations for ``microbatches`` microbatches."""
    return (self.repeats - 1) * self.period(microbatches) + microbatches + self.stages - 1

  def bubble(self, microbatches: int) -> float:
    """The share of the iterations a stage idles: ``1 - R * M / iterations`` (GPipe and
    1F1B: ``(S - 1) / (M + S - 1)``; 1F1B's ``M + 2(S - 1)`` iterations each run a
    forward and a backward where both are real, one alone in the first and last ``S -
    1``)."""
    return 1.0 - self.repeats * microbatches / self.iterations(microbatches)

  def describe(self, microbatches: int) -> str:
    """The start-up line: which layers each stage holds and the bubble."""
    def spans(layers):
      runs, start = [], None
      for i, layer in enumerate(layers):
        if start is None:
          start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
          runs.append(str(start) if start == layer else f"{start}-{layer}")
          start = None
      return ",".join(runs)

    if self.schedule == "circular":
      schedule = (f"circular, {self.repeats} group{'s' if self.repeats > 1 else ''} per "
                  f"stage" + (": the same as gpipe" if self.repeats == 1 else ""))
    elif self.schedule == "1f1b":
      schedule = f"1f1b, each stage keeping {stash_slots(self, microbatches)} microbatch inputs"
    else:
      schedule = "gpipe"
    per_stage = self.repeats * self.group

    def held(stage):
      identity = self.slot_layers[stage * per_stage:(stage + 1) * per_stage].count(None)
      layers = self.stage_layers(stage)
      return (f"stage {stage}: " + (f"layers {spans(layers)}" if layers else "no layer")
              + (f" + {identity} identity" if identity else ""))

    return (f"pipeline of {self.stages} stages ({schedule}), {microbatches} microbatch"
            f"{'es' if microbatches > 1 else ''}, "
            f"bubble {self.bubble(microbatches):.0%}; "
            + "; ".join(held(s) for s in range(self.stages)))


@functools.cache
def _slotter(rows: tuple[int, ...], real: tuple[bool, ...], sharding: NamedSharding):
  def place(value):
    taken = value[np.array(rows)]
    keep = np.array(real).reshape((-1,) + (1,) * (value.ndim - 1))
    return jnp.where(keep, taken, jnp.zeros((), value.dtype))
  return jax.jit(place, out_shardings=sharding)


def split_into_stages(stacked: nnx.Module, plan: StagePlan) -> None:
  """Splits the params of ``stacked`` (a ``flax_tp.stack_layers`` module of
  ``plan.layers`` layers) over ``"stage"`` as ``plan`` says, in place: each becomes
  ``[plan.slots, ...]`` in stored order, identity layers zero, its leading axis named
  ``"stage"``."""
  slots = plan.slot_layers
  rows = tuple(0 if layer is None else layer for layer in slots)
  real = tuple(layer is not None for layer in slots)
  for path, var in nnx.to_flat_state(nnx.state(stacked, nnx.Param)):
    info = ParamInfo.of(var)
    if info.layers != plan.layers or info.first_layer is not None:
      raise ValueError(f"param {'.'.join(map(str, path))} is not a stack of the model's "
                       f"{plan.layers} layers (stacked: {info.layers})")
    names = (STAGE_AXIS,) + tuple(info.names[1:])
    var.set_value(_slotter(rows, real, NamedSharding(info.mesh, P(*names)))(var[...]))
    record(var, names=names, layer_slots=slots)


def merge_stages(stacked: nnx.Module) -> None:
  """Undoes ``split_into_stages`` in place: each param of ``stacked`` back to ``[layers,
  ...]`` in layer order, identity layers dropped, replicated over ``"stage"`` (the
  unpipelined model's layout, e.g. to decode with a KV cache on the same mesh)."""
  for _, var in nnx.to_flat_state(nnx.state(stacked, nnx.Param)):
    info = ParamInfo.of(var)
    if info.layer_slots is None:
      continue
    rows = tuple(info.slot_of(layer) for layer in range(info.layers))
    names = (None,) + tuple(info.names[1:])
    real = (True,) * len(rows)
    var.set_value(_slotter(rows, real, NamedSharding(info.mesh, P(*names)))(var[...]))
    record(var, names=names, layer_slots=None)


def _check_fits(plan: StagePlan, x: jax.Array, microbatches: int) -> None:
  """Inside the map: ``ValueError`` naming both unless the mesh's ``"stage"`` axis has the
  plan's stages and ``microbatches`` divides the rows of ``x [b, ...]``."""
  if jax.lax.axis_size(STAGE_AXIS) != plan.stages:
    raise ValueError(f"the plan has {plan.stages} stages, the mesh's {STAGE_AXIS!r} axis "
                     f"{jax.lax.axis_size(STAGE_AXIS)}")
  if x.shape[0] % microbatches:
    raise ValueError(f"a batch of {x.shape[0]} rows (per data shard) does not split into "
                     f"{microbatches} microbatches: microbatches must divide it")


def split_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
  """``x [b, ...]`` as ``[M, b / M, ...]``, microbatch ``m`` holding rows ``m, m + M, m +
  2M, ...``: strided, so that with ``M`` dividing each data shard's rows a microbatch is
  the same set of global rows (those ``== m`` mod ``M``) whatever the data axis's size,
  and what it routes, caps and drops does not depend on the mesh."""
  return jnp.swapaxes(x.reshape((x.shape[0] // microbatches, microbatches) + x.shape[1:]),
                      0, 1)


def merge_microbatches(xs: jax.Array) -> jax.Array:
  """``split_microbatches``' inverse: ``[M, b / M, ...]`` -> ``[b, ...]``."""
  return jnp.swapaxes(xs, 0, 1).reshape((-1,) + xs.shape[2:])


def _group_runner(graphdef: Any, call: Callable, plan: StagePlan, remat: str,
                  with_aux: bool) -> Callable:
  """``run_group(stacked, x, repeat, rows) -> (y, aux [G, ...] or None)``: this stage's
  group of ``repeat`` (its ``G`` layers, a ``lax.scan``) on one microbatch ``x``;
  ``stacked``: this stage's slots ``[R * G, ...]``. Each layer's params split over
  ``"data"`` (FSDP) are gathered in its step, which ``remat`` recomputes in backward;
  an identity layer passes its input on."""
  S, G = plan.stages, plan.group
  policy = remat_policy(remat)

  def layer_step(params, x, layer, rows):  # FSDP: this layer's params gathered here
    out = call(nnx.merge(graphdef, gather_block(params)), x, layer, *rows)
    y, aux = out if with_aux else (out, None)
    real = layer < plan.layers  # an identity layer passes its input on
    y = jnp.where(real, y, x)
    aux = jax.tree.map(lambda a: jnp.where(real, a, jnp.zeros((), a.dtype)), aux)
    return y, aux

  if policy is not None:
    layer_step = jax.checkpoint(layer_step, policy=policy)

  def run_group(stacked, x, repeat, rows):
    params = jax.tree.map(lambda p: jax.lax.dynamic_slice_in_dim(p, repeat * G, G), stacked)
    first = (repeat * S + jax.lax.axis_index(STAGE_AXIS)) * G
    return jax.lax.scan(lambda x, pj: layer_step(pj[0], x, first + pj[1], rows),
                        x, (params, jnp.arange(G)))

  return run_group


def run_pipeline(blocks: nnx.Module, x: jax.Array, call: Callable, batched: tuple = (), *,
                 plan: StagePlan, microbatches: int, remat: str = "none",
                 with_aux: bool = False) -> Any:
  """Inside a ``shard_map`` over a mesh with ``"stage"``: ``x [b, ...]`` (the same on
  every stage) through the layers of ``blocks`` (stacked and split by
  ``split_into_stages``: this stage's slots ``[R * G, ...]``) in layer order, as the
  module docstring says.

  ``call(block, x, layer, *batched_rows)`` runs one layer (``layer`` a traced int) on one
  microbatch ``[b / M, ...]``; ``batched``: arrays ``[b, ...]`` cut into microbatches
  with ``x`` (row ids). ``with_aux``: ``call`` returns ``(x, aux)``; the result is then
  ``(x, aux per microbatch and layer [M, L, ...], on every stage)``.
  ``remat``: each layer recomputed in backward (``flax_tp.remat.REMAT_CHOICES``).
  Returns ``x [b, ...]``, the same on every stage.
  """
  M, S, R, G = microbatches, plan.stages, plan.repeats, plan.group
  _check_fits(plan, x, M)
  period, iterations = plan.period(M), plan.iterations(M)
  stage = jax.lax.axis_index(STAGE_AXIS)
  graphdef, stacked = nnx.split(blocks)
  xs = split_microbatches(x, M)
  batched = tuple(split_microbatches(b, M) for b in batched)
  run_group = _group_runner(graphdef, call, plan, remat, with_aux)

  def position(t):
    """(repeat, microbatch, whether real) of what this stage runs at iteration ``t``."""
    local = t - stage
    repeat, m = local // period, local % period
    real = (local >= 0) & (repeat < R) & (m < M)
    return jnp.clip(repeat, 0, R - 1), jnp.clip(m, 0, M - 1), real

  # Each stage's output goes to the next; the last's back to stage 0 only when it has a
  # next repeat to run.
  perm = [(s, s + 1) for s in range(S - 1)] + ([(S - 1, 0)] if R > 1 else [])
  varying = lambda a: jax.lax.pcast(a, STAGE_AXIS, to="varying")
  zeros = varying(jnp.zeros_like(xs[0]))

  def iteration(carry, t):
    received, waiting, outputs = carry
    repeat, m, real = position(t)
    if R > 1:  # stage 0 keeps what the last stage sent until its next repeat
      back = t - S
      back_repeat, back_m = back // period, back % period
      keep = (stage == 0) & (back >= 0) & (back_m < M) & (back_repeat < R - 1)
      slot = jnp.clip(back_m, 0, M - 1)
      waiting = jax.lax.dynamic_update_index_in_dim(
          waiting, jnp.where(keep, received, waiting[slot]), slot, 0)
      first_input = jnp.where(repeat == 0, xs[m], waiting[m])
    else:
      first_input = xs[m]
    x = jnp.where(stage == 0, first_input, received)
    y, aux = run_group(stacked, x, repeat, tuple(b[m] for b in batched))
    done = (stage == S - 1) & real & (repeat == R - 1)
    outputs = jax.lax.dynamic_update_index_in_dim(
        outputs, jnp.where(done, y, outputs[m]), m, 0)
    if aux is not None:  # [G, ...], each this stage's layer's, kept for real runs only
      aux = jax.tree.map(lambda a: jnp.where(real, a, jnp.zeros((), a.dtype)), aux)
      aux = (aux, (repeat * S + stage) * G + jnp.arange(G), m)
    received = jax.lax.ppermute(y, STAGE_AXIS, perm)
    return (received, waiting, outputs), aux

  waiting = varying(jnp.zeros_like(xs)) if R > 1 else None
  outputs = varying(jnp.zeros_like(xs))
  (_, _, outputs), aux = jax.lax.scan(iteration, (zeros, waiting, outputs),
                                      jnp.arange(iterations))
  # The last stage's outputs, on every stage (adding zeros elsewhere: exact).
  x = merge_microbatches(outputs)
  x = all_reduce(jnp.where(stage == S - 1, x, jnp.zeros((), x.dtype)), "sum", STAGE_AXIS)
  if not with_aux:
    return x
  if aux is None:
    return x, None
  aux, layers, ms = aux  # [iterations, G, ...], [iterations, G], [iterations]
  layers = layers.reshape(-1)
  ms = jnp.repeat(ms, G)

  def per_layer(a):
    by_layer = jnp.zeros((M, plan.layers) + a.shape[2:], a.dtype).at[ms, layers].add(
        a.reshape((-1,) + a.shape[2:]), mode="drop")  # (identity layers' rows dropped)
    return all_reduce(by_layer, "sum", STAGE_AXIS)

  return x, jax.tree.map(per_layer, aux)


def _varying_as_carried(body: Callable, carry: Any) -> Any:
  """``carry`` made to vary over every mesh axis that ``body``'s carry comes out varying
  over (a scan's carry must keep its type: what the layers make of an input, e.g. a
  FSDP-gathered param's gradient, can vary over more axes than the zeros it starts
  from)."""
  def varying(a):
    return frozenset(jax.typeof(a).manual_axis_type.varying)

  for _ in range(4):  # a fixed point: each pass can only add axes
    out = jax.eval_shape(lambda c: body(c, jnp.int32(0))[0], carry)
    leaves, treedef = jax.tree.flatten(carry)
    missing = [tuple(sorted(frozenset(o.manual_axis_type.varying) - varying(c)))
               for c, o in zip(leaves, jax.tree.leaves(out), strict=True)]
    if not any(missing):
      return carry
    carry = treedef.unflatten([jax.lax.pcast(c, m, to="varying") if m else c
                               for c, m in zip(leaves, missing, strict=True)])
  raise AssertionError("the pipeline's carry did not settle on a type")


def _when(pred: jax.Array, f: Callable, *args: Any) -> Any:
  """``f(*args)`` where ``pred`` holds, zeros of its result's type elsewhere.

  A ``lax.cond``, so that a stage with nothing real to run skips the work, unless ``f``
  holds a ``ppermute``: a collective-permute is one instruction over all the mesh's
  devices, and a stage that skipped it would leave the others' exchange unmatched (on
  XLA:CPU ring attention's then gave a wrong loss). Such an ``f`` runs everywhere and
  its result is masked.
  """
  jaxpr, out = jax.make_jaxpr(f, return_shape=True)(*args)

  def zeros(*_):
    def zero(o):
      z = jnp.zeros(o.shape, o.dtype)
      axes = tuple(sorted(o.manual_axis_type.varying))
      return jax.lax.pcast(z, axes, to="varying") if axes else z
    return jax.tree.map(zero, out)

  if _holds(jaxpr.jaxpr, "ppermute"):
    return jax.tree.map(lambda a, z: jnp.where(pred, a, z), f(*args), zeros())
  return jax.lax.cond(pred, f, zeros, *args)


def _holds(jaxpr: Any, primitive: str) -> bool:
  """Whether ``jaxpr`` or any jaxpr inside it (a scan's body, a cond's branches, a
  remat's or custom rule's call) applies ``primitive``."""
  def inner(value):
    if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):  # a ClosedJaxpr
      return [value.jaxpr]
    if hasattr(value, "eqns"):
      return [value]
    if isinstance(value, (tuple, list)):
      return [j for v in value for j in inner(v)]
    return []

  return any(eqn.primitive.name == primitive
             or any(_holds(j, primitive) for v in eqn.params.values() for j in inner(v))
             for eqn in jaxpr.eqns)


def one_f_one_b(t: Any, stage: Any, stages: int, microbatches: int) -> tuple:
  """What ``stage`` runs at 1F1B iteration ``t``: ``((f, real), (b, real))``, microbatch
  ``f`` forward and ``b`` backward, each only where ``real`` (ints or traced arrays).
  A microbatch goes forward one stage per iteration, and back the same way from the
  last stage, where its backward starts in the iteration of its forward."""
  f, b = t - stage, t - 2 * (stages - 1) + stage
  return (f, (f >= 0) & (f < microbatches)), (b, (b >= 0) & (b < microbatches))


def _summed_like(gradient: jax.Array, param: jax.Array) -> jax.Array:
  """``gradient`` summed over the mesh axes it varies over and ``param`` does not."""
  extra = tuple(sorted(set(jax.typeof(gradient).manual_axis_type.varying)
                       - set(jax.typeof(param).manual_axis_type.varying)))
  return all_reduce(gradient, "sum", extra if len(extra) > 1 else extra[0]) if extra else gradient


def stash_slots(plan: StagePlan, microbatches: int) -> int:
  """How many microbatches' stage inputs 1F1B keeps at once on a stage: each from its
  forward to its backward, ``2 (S - 1 - s)`` iterations later at stage ``s``, at most
  ``min(M, 2S - 1)`` (GPipe keeps all ``M``)."""
  return min(microbatches, 2 * plan.stages - 1)


def pipeline_1f1b_loss(blocks: nnx.Module, tail: nnx.Module, x: jax.Array, call: Callable,
                       tail_loss: Callable, batched: tuple = (), *, plan: StagePlan,
                       microbatches: int, remat: str = "none") -> jax.Array:
  """Inside a ``shard_map`` over a mesh with ``"stage"``: the loss of ``x [b, ...]`` (the
  same on every stage) run through the layers of ``blocks`` (split by
  ``split_into_stages`` under a one-repeat plan) and then ``tail``, with the 1F1B
  schedule: each stage alternates one microbatch's forward and an earlier one's backward.

  ``call(block, x, layer, *rows)`` runs one layer on one microbatch, as in
  ``run_pipeline``; ``tail_loss(tail, y, *rows)`` gives the loss of one microbatch's
  output ``y [b / M, ...]`` (a scalar: its share of a loss that is a sum over
  microbatches, such as a token sum divided by the global token count). ``batched``:
  arrays ``[b, ...]`` cut into microbatches with ``x``. Returns the sum over
  microbatches, the same on every stage, differentiable (``jax.grad``) with respect to
  ``blocks``' and ``tail``'s params and ``x``; nothing else it reads may be.

  How: forward and backward run together in the forward pass (a ``jax.custom_vjp``
  whose backward only scales the gradients by the loss's cotangent). At iteration ``t``
  stage ``s`` runs microbatch ``t - s`` forward, keeping its input, and microbatch ``t -
  2(S - 1) + s`` backward: its forward recomputed from the kept input under ``jax.vjp``,
  the cotangent from stage ``s + 1`` (on the last stage, from ``tail_loss`` of that
  microbatch, just run). Activations go forward and cotangents back by one ``ppermute``
  each per iteration; ``M + 2(S - 1)`` iterations. A stage keeps ``stash_slots`` inputs
  ``[b / M, ...]``, not every microbatch's activations: the activation memory does not
  grow with ``M``. The price is one more forward of each microbatch (the recomputation,
  as ``remat="block"`` pays at the stage's scale).
  """
  M, S = microbatches, plan.stages
  if plan.repeats != 1:
    raise ValueError(f"1F1B runs one group of layers per stage, got repeats={plan.repeats}")
  _check_fits(plan, x, M)
  graphdef, stacked = nnx.split(blocks)
  tail_def, tail_state = nnx.split(tail)
  run_group = _group_runner(graphdef, call, plan, remat, with_aux=False)
  K = stash_slots(plan, M)

  def stage_fn(stacked, x, rows):
    return run_group(stacked, x, 0, rows)[0]

  def tail_fn(tail_state, y, rows):
    return tail_loss(nnx.merge(tail_def, tail_state), y, *rows)

  def schedule(stacked, tail_state, x, batched, backward=True):
    """(loss, (d stacked, d tail, d x)) on every stage; ``backward=False`` (not
    differentiated): the forward alone, ``(loss, None)``."""
    stage = jax.lax.axis_index(STAGE_AXIS)
    varying = lambda a: jax.lax.pcast(a, STAGE_AXIS, to="varying")
    # Stage-varying from the start, so that no iteration's backward sums a gradient
    # over "stage": each stage accumulates its own, summed once at the end.
    tail_v = jax.tree.map(varying, tail_state)
    xs = varying(split_microbatches(x, M))
    rows = tuple(split_microbatches(b, M) for b in batched)
    zeros = jnp.zeros_like
    last = stage == S - 1

    def iteration(carry, t):
      received, cotangent, stash, d_stacked, d_tail, d_xs, loss = carry
      (f, f_real), (b, b_real) = one_f_one_b(t, stage, S, M)
      f, b = jnp.clip(f, 0, M - 1), jnp.clip(b, 0, M - 1)
      # Forward of microbatch f, its input kept until its backward.
      x_in = jnp.where(stage == 0, xs[f], received)
      if backward:
        stash = jax.lax.dynamic_update_index_in_dim(
            stash, jnp.where(f_real, x_in, stash[f % K]), f % K, 0)
      # (Each piece of work runs only where it is real: a stage's devices take the same
      # branch, so the collectives inside meet.)
      y = _when(f_real, lambda st, x: stage_fn(st, x, tuple(r[f] for r in rows)),
                stacked, x_in)
      # The last stage: the tail's loss of microbatch f and its cotangent, the start of
      # f's backward in this same iteration (there b == f).
      keep_f = last & f_real
      received = jax.lax.ppermute(y, STAGE_AXIS, [(s, s + 1) for s in range(S - 1)])
      if not backward:
        f_loss = _when(keep_f, lambda ts, y: tail_fn(ts, y, tuple(r[f] for r in rows)),
                       tail_v, y)
        loss = loss + f_loss
        return (received, cotangent, stash, d_stacked, d_tail, d_xs, loss), None

      def tail_with_cotangents(ts, y):
        f_loss, tail_vjp = jax.vjp(lambda ts, y: tail_fn(ts, y, tuple(r[f] for r in rows)),
                                   ts, y)
        return f_loss, tail_vjp(jnp.ones_like(f_loss))

      f_loss, (dt, dy) = _when(keep_f, tail_with_cotangents, tail_v, y)
      loss = loss + f_loss
      d_tail = jax.tree.map(jnp.add, d_tail, dt)

      # Backward of microbatch b: its forward recomputed from the kept input.
      def stage_backward(st, xb, cotangent):
        _, stage_vjp = jax.vjp(lambda st, xb: stage_fn(st, xb, tuple(r[b] for r in rows)),
                               st, xb)
        return stage_vjp(cotangent)

      ds, dx = _when(b_real, stage_backward, stacked, stash[b % K],
                     jnp.where(last, dy, cotangent))
      d_stacked = jax.tree.map(jnp.add, d_stacked, ds)
      d_xs = jax.lax.dynamic_update_index_in_dim(
          d_xs, jnp.where((stage == 0) & b_real, dx, d_xs[b]), b, 0)
      cotangent = jax.lax.ppermute(dx, STAGE_AXIS, [(s + 1, s) for s in range(S - 1)])
      return (received, cotangent, stash, d_stacked, d_tail, d_xs, loss), None

    carry = (zeros(xs[0]), zeros(xs[0]), varying(jnp.zeros((K,) + xs.shape[1:], xs.dtype)),
             jax.tree.map(zeros, stacked), jax.tree.map(zeros, tail_v), zeros(xs),
             varying(jnp.zeros((), jnp.float32)))
    iterations = M + 2 * (S - 1) if backward else M + S - 1
    carry = _varying_as_carried(iteration, carry)
    carry, _ = jax.lax.scan(iteration, carry, jnp.arange(iterations))
    _, _, _, d_stacked, d_tail, d_xs, loss = carry
    # The loss and the tail's gradients are the last stage's, the input's cotangent
    # stage 0's: one all-reduce over "stage" each gives them to every stage (adding
    # zeros elsewhere: exact).
    only = lambda on, a: all_reduce(jnp.where(on, a, jnp.zeros((), a.dtype)), "sum",
                                    STAGE_AXIS)
    if not backward:
      return only(last, loss), None
    # Each gradient summed over the axes it varies over and its param does not (as
    # autodiff transposes a value used where it varies): "stage" for the tail's and the
    # input's (the last stage's, stage 0's: adding zeros elsewhere, exact).
    d_tail = jax.tree.map(_summed_like, jax.tree.map(
        lambda g: jnp.where(last, g, jnp.zeros((), g.dtype)), d_tail), tail_state)
    d_x = _summed_like(merge_microbatches(jnp.where(stage == 0, d_xs,
                                                    jnp.zeros((), d_xs.dtype))), x)
    return only(last, loss), (jax.tree.map(_summed_like, d_stacked, stacked), d_tail, d_x)

  @jax.custom_vjp
  def pipelined(stacked, tail_state, x, batched):
    return schedule(stacked, tail_state, x, batched, backward=False)[0]

  def forward(stacked, tail_state, x, batched):
    loss, grads = schedule(stacked, tail_state, x, batched)
    return loss, (grads, batched)

  def backward(saved, g):
    (d_stacked, d_tail, d_x), batched = saved
    # (The loss's cotangent may vary over axes a gradient does not, e.g. a data shard's
    # share of the loss: summed over them, as autodiff would.)
    scale = lambda a: _summed_like((a * g.astype(a.dtype)).astype(a.dtype), a)
    return (jax.tree.map(scale, d_stacked), jax.tree.map(scale, d_tail), scale(d_x),
            jax.tree.map(lambda _: None, batched))

  pipelined.defvjp(forward, backward)
  return pipelined(stacked, tail_state, x, batched)
