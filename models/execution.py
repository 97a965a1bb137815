"""How a step runs, apart from what the model is (``models.config.TransformerConfig``).

An ``Execution`` changes no param, and no result but one: a checkpoint moves between runs
that differ only in it, and ``TransformerConfig.identity()`` (what a checkpoint must match)
knows nothing of it. The one exception is ``expert_dispatcher="all_to_all"`` with a
capacity factor: each expert's capacity is per source data shard, so what it drops
depends on the data axis (``flax_tp.moe.Dispatcher.drops_depend_on_mesh``; every other
dispatch drops what one device would, or nothing). Within float rounding, every other
field changes nothing a step computes. It is given to ``Transformer``, ``load_hf`` and the trainer (through
the model), and applied to a built model in one place, ``apply``, in this order:

1. sequence parallelism: the layers that close a tensor-parallel region (the embedding,
   each block's attention output and MLP down projection) reduce-scatter over the
   sequence instead of all-reducing (Megatron-SP); it changes no param;
2. scanned layers: the blocks' params stacked ``[num_layers, ...]`` into one module
   (after 1, so the stacked module's graph carries it); a model mixing dense and
   mixture-of-experts blocks gets one stacked module per run of blocks of one kind,
   scanned in turn;
3. pipeline stages: on a mesh whose ``"stage"`` axis has more than one device the
   stacked blocks (stacked whatever ``scan_layers`` says) are split over it
   (``flax_tp.pipeline``), identity layers padding their count, and the model runs
   them as ``pipeline_schedule`` says on ``microbatches`` microbatches;
4. FSDP: every param split over ``"data"`` too (last: it splits the stacked params
   once, on their final shapes, per stage).

Recomputation (``remat``) is read when the blocks run (``flax_tp.remat.run_blocks``).
The attention kernel (``attention``) is set on each block's attention before step 2
(``set_attention_kernel``), and the choice is kept, with its reason, as the model's
``attention_kernel``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

import flax_tp
from flax_tp.context import STRATEGIES as CONTEXT_STRATEGIES
from flax_tp.data_parallel import shard_over_data
from flax_tp.remat import REMAT_CHOICES
from models.splash import KERNELS as ATTENTION_KERNELS, choose_kernel


def _positive_int(value) -> bool:
  """Whether ``value`` is an int (not a bool) of at least 1."""
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class Execution:
  sequence_parallel: bool = False  # Megatron-SP: [b, s/M, d] between blocks
  remat: str = "none"  # "block" or a jax.checkpoint_policies name: recompute in backward
  scan_layers: bool = False  # jax.lax.scan over the blocks: compile time flat in depth
  fsdp: bool = False  # params, gradients, optimizer state split over "data" too (ZeRO-3)
  # How attention sees other context shards' keys on a mesh with a context axis:
  # "all_gather" (each device gathers k and v over "context") or "ring" (k/v blocks
  # passed around the context devices: flax_tp.ring_attention).
  context_parallel: str = "all_gather"
  # The mesh roles a mixture of experts' experts split over (flax_tp.MeshAxes.expert_roles):
  # "data" (the default); with "context" too, each context shard's tokens reach the
  # experts on the others and the experts take 1/(D*C) per device; with "model", each
  # expert is whole on one device (its FFN not split: Megatron's expert-tensor-parallel
  # size 1). A role with one device on the mesh splits nothing. Chosen when the experts
  # are built (their params' layout); checkpoints move between every choice. A string
  # "data,context" is taken too.
  expert_axes: tuple[str, ...] = flax_tp.MeshAxes.DEFAULT_EXPERT_ROLES
  # How a mixture of experts' routed tokens reach their experts' shards (flax_tp.MoE's
  # dispatcher): "all_gather" (every shard's tokens to every shard: drops that do not
  # depend on the mesh) or "all_to_all" (each routed choice only to its expert's shard,
  # with expert_capacity_factor's capacity per source shard: drops that depend on D).
  expert_dispatcher: str = "all_gather"
  # Pipeline parallelism (a mesh with a "stage" axis; without one, nothing changes): the
  # batch each data shard runs is cut into this many microbatches, which flow through
  # the stages; "gpipe" (each stage one group of consecutive layers), "circular"
  # (each stage pipeline_repeats groups of non-adjacent layers: a smaller bubble; by
  # default as many groups as it holds layers) or "1f1b" (GPipe's layers, each stage
  # alternating one microbatch's forward and another's backward: activation memory
  # that does not grow with microbatches, for one more forward; flax_tp.pipeline).
  microbatches: int = 1
  pipeline_schedule: str = "gpipe"
  pipeline_repeats: int | None = None
  # False: a "stage" axis splits no layer; every stage holds them all, replicated (what
  # ``unpipeline`` leaves). The KV-cached decoder and an export run the layers one by one,
  # so train/generate.py and train/export.py build so, a model mixing dense and expert
  # layers (which no pipeline holds) included.
  pipelined: bool = True
  # The kernel of attention over a whole sequence in training and prefill: "auto" (jax's
  # Pallas splash attention kernel on a TPU where the model allows it, XLA's einsums
  # elsewhere), "xla", or "splash" (an error where it cannot run: a context axis, dropout
  # on the probabilities; off a TPU it runs in Pallas interpret mode, slowly).
  # models.splash.choose_kernel decides; the results agree to float rounding.
  attention: str = "auto"
  # The head and the loss by pieces of the sequence (flax_tp.chunked_token_loss): 1 makes
  # the logits [b, s, V] at once; k > 1 makes them [b, s/k, V] at a time (float32 in the
  # loss), again in backward: a step's logits memory cut k-fold for the head's matmul
  # once more. The same loss and gradients to float rounding.
  loss_chunks: int = 1

  def __post_init__(self):
    object.__setattr__(self, "expert_axes", flax_tp.MeshAxes.expert_roles(self.expert_axes))
    if self.remat not in REMAT_CHOICES:
      raise ValueError(f"remat must be one of {REMAT_CHOICES}, got {self.remat!r}")
    if self.context_parallel not in CONTEXT_STRATEGIES:
      raise ValueError(f"context_parallel must be one of {CONTEXT_STRATEGIES}, got "
                       f"{self.context_parallel!r}")
    if not _positive_int(self.microbatches):
      raise ValueError(f"microbatches must be a positive integer, got {self.microbatches!r}")
    if self.pipeline_repeats is not None and not _positive_int(self.pipeline_repeats):
      raise ValueError(f"pipeline_repeats must be a positive integer or None, got "
                       f"{self.pipeline_repeats!r}")
    flax_tp.StagePlan.of(1, 1, self.pipeline_schedule, self.pipeline_repeats)  # checks both
    if self.attention not in ATTENTION_KERNELS:
      raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got "
                       f"{self.attention!r}")
    if not _positive_int(self.loss_chunks):
      raise ValueError(f"loss_chunks must be a positive integer, got {self.loss_chunks!r}")
    if self.expert_dispatcher not in flax_tp.moe.DISPATCHERS:
      raise ValueError(f"expert_dispatcher must be one of {flax_tp.moe.DISPATCHERS}, got "
                       f"{self.expert_dispatcher!r}")

  def stage_plan(self, num_layers: int, stages: int) -> flax_tp.StagePlan | None:
    """Which layers each of ``stages`` pipeline stages holds; None for one stage."""
    if stages == 1:
      return None
    return flax_tp.StagePlan.of(num_layers, stages, self.pipeline_schedule,
                                self.pipeline_repeats)

  def describe(self) -> list[str]:
    """The options in effect, in words (the training CLI's start-up line)."""
    return [name for name, on in (("sequence parallel", self.sequence_parallel),
                                  (f"remat {self.remat}", self.remat != "none"),
                                  ("scanned layers", self.scan_layers),
                                  ("FSDP over data", self.fsdp),
                                  ("ring attention over context",
                                   self.context_parallel == "ring"),
                                  (f"experts over {' x '.join(self.expert_axes)}",
                                   self.expert_axes != flax_tp.MeshAxes.DEFAULT_EXPERT_ROLES),
                                  ("experts dispatched all-to-all",
                                   self.expert_dispatcher == "all_to_all"),
                                  (f"head and loss in {self.loss_chunks} pieces",
                                   self.loss_chunks > 1),
                                  ) if on]


def set_sequence_parallel(model: Any, on: bool) -> None:
  """Step 1 of ``apply`` on ``model`` (a ``Transformer``), in place: its region-closing
  layers scatter over the sequence (``on``) or all-reduce."""
  model.embed.sequence_parallel = on
  # the blocks one by one, or (scanned) the module(s) of their stacked params
  blocks = list(model.blocks) if isinstance(model.blocks, nnx.List) else [model.blocks]
  for block in blocks:
    block.attn.o.sequence_parallel = on
    if isinstance(block.mlp, flax_tp.MoE):
      continue  # a MoE scatters when its call is given the SequenceSplit
    block.mlp.down.sequence_parallel = on


def set_attention_kernel(model: Any, execution: Execution) -> None:
  """Chooses ``execution.attention``'s kernel for ``model`` (``choose_kernel``: its
  config, its mesh's platform and context axis) and sets it on every block's attention
  (one by one, or the stacked modules), in place; ``model.attention_kernel`` keeps
  ``(kernel, why)``."""
  platform = model.mesh.devices.flat[0].platform
  context = flax_tp.MeshAxes.of(model.mesh).context
  kernel, why = choose_kernel(execution.attention, model.cfg, platform=platform,
                              context=context)
  blocks = list(model.blocks) if isinstance(model.blocks, nnx.List) else [model.blocks]
  for block in blocks:
    block.attn.attention_kernel = kernel
  model.attention_kernel = (kernel, why)


def apply(model: Any, execution: Execution) -> None:
  """Applies ``execution`` to a freshly built ``Transformer`` (blocks in an ``nnx.List``,
  nothing split over ``"data"``), in place, in the module docstring's order. (The params
  FSDP leaves replicated over ``"data"`` are read back from their records where they are
  reported, after a checkpoint or HF weights are loaded too.)"""
  set_sequence_parallel(model, execution.sequence_parallel)
  set_attention_kernel(model, execution)
  stages = flax_tp.MeshAxes.of(model.mesh).stage if execution.pipelined else 1
  if stages > 1 and not execution.scan_layers:  # a pipeline's stages hold stacked layers
    execution = dataclasses.replace(execution, scan_layers=True)
  if execution.scan_layers:
    # One module holding every block's params stacked [num_layers, ...] (one per run
    # of dense or MoE blocks): the scan reads them in place and the optimizer sees one
    # array per kind of param. Initialised per block first, so the values do not
    # depend on it.
    cfg = model.cfg
    model.blocks = flax_tp.stack_layer_runs(
        list(model.blocks), [cfg.is_moe_layer(i) for i in range(cfg.num_layers)])
  model.pipeline = execution.stage_plan(model.cfg.num_layers, stages)
  if model.pipeline is not None:
    if isinstance(model.blocks, nnx.List):
      kinds = sorted({"mixture-of-experts" if model.cfg.is_moe_layer(i) else "dense"
                      for i in range(model.cfg.num_layers)})
      raise ValueError(f"pipeline stages hold layers of one kind; this model mixes "
                       f"{' and '.join(kinds)} layers (e.g. first_k_dense_replace): run it "
                       "on a mesh without a 'stage' axis")
    if model.pipeline.schedule == "1f1b" and model.cfg.has_experts:
      raise ValueError("pipeline_schedule='1f1b' takes each microbatch's loss as it leaves "
                       "the last stage, and a mixture of experts' load-balancing loss needs "
                       "every microbatch's routing first: use 'gpipe' or 'circular'")
    flax_tp.split_into_stages(model.blocks, model.pipeline)
  if execution.fsdp:  # params (and so the optimizer state) split over "data" too
    shard_over_data(model, per_block=(model.blocks,))
  model.execution = execution


def view(model: Any, execution: Execution) -> Any:
  """The same params as ``model`` (shared, not copied) under another ``execution`` that
  differs only in what changes no param (sequence parallelism, remat): e.g. the
  decoder's, which has no sequence to split."""
  held = model.execution
  if model.pipeline is not None and not execution.scan_layers:
    execution = dataclasses.replace(execution, scan_layers=True)
  if ((held.scan_layers, held.fsdp, held.expert_axes)
      != (execution.scan_layers, execution.fsdp, execution.expert_axes)):
    raise ValueError(f"a view may change sequence_parallel, remat, context_parallel and "
                     f"attention only: {held} -> {execution}")
  other = nnx.merge(*nnx.split(model))
  set_sequence_parallel(other, execution.sequence_parallel)
  set_attention_kernel(other, execution)
  other.execution = execution
  if model.pipeline is not None:  # which layers a stage holds is the params' layout
    plan = execution.stage_plan(model.cfg.num_layers, model.pipeline.stages)
    if plan != model.pipeline:
      raise ValueError(f"a view keeps the pipeline's stages: {model.pipeline} -> {plan}")
  other.pipeline = model.pipeline
  return other


def unpipeline(model: Any) -> Any:
  """``model``'s stacked blocks back to the unpipelined layout on the same mesh
  (``flax_tp.pipeline.merge_stages``: in layer order, replicated over ``"stage"``), in
  place; returns ``model``. The KV-cached decoder runs a model's layers one by one, so
  it decodes a pipelined model this way (a training run's sample, ``train/generate.py``
  on a mesh with a stage axis)."""
  if model.pipeline is not None:
    flax_tp.merge_stages(model.blocks)
    model.pipeline = None
  return model
