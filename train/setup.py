"""A training run's set-up: everything it starts from, built and checked before the first
step, and the start-up lines that say what it is."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx
from rich.console import Console

import flax_tp
from flax_tp.checkpoint import Checkpointer, CheckpointError
from flax_tp.param_info import ParamInfo
from models.config import TransformerConfig
from models.execution import Execution
from models.splash import block_for as splash_block
from train.data import TokenCorpus
from train.errors import UsageError
from train.hf_folder import hf_model_and_tokenizer
from train.job import Job, target_globs
from train.metrics import is_main_process
from train.resume import claim_checkpoint_dir, resume_point, run_identity
from train.run_model import EXPERT_RUN_FIELDS, build_run_model
from train.step import LossOptions, Trainer, make_optimizer


def param_summary(params: nnx.State) -> dict[str, int]:
  """Logical parameter count and per-device bytes, split into sharded and replicated."""
  total = sharded = replicated = 0
  for _, var in nnx.to_flat_state(params):
    value = var[...]
    info = ParamInfo.of(var)
    shard_bytes = value.addressable_shards[0].data.nbytes
    # Logical: without the padding of any split dim (the FFN's, the experts'), so the
    # count is the model's whatever the mesh.
    total += math.prod(info.logical_shape(value.shape))
    if info.is_split:  # split over "model" and/or "data" (FSDP)
      sharded += shard_bytes
    else:
      replicated += shard_bytes
  return dict(params=total, sharded_bytes_per_device=sharded,
              replicated_bytes_per_device=replicated)


def check_state_fits(cfg, mesh, execution: Execution, *, lora: bool, what: str,
                     mesh_spec: str) -> None:
  """Refuses (``UsageError``, one line) before anything is allocated a model whose
  float32 params alone, with their gradients and AdamW's two moments (the params alone
  under LoRA), cannot fit this process's memory: its devices' limits on an accelerator,
  the host's available memory on CPU. A lower bound (no activations, no padding): a run it
  lets through may still run out, one it refuses cannot run."""
  from models.reference import param_count
  params = param_count(cfg)
  axes = flax_tp.MeshAxes.of(mesh)
  split = axes.model * axes.stage * (axes.data * axes.context if execution.fsdp else 1)
  per_device = params * (4 if lora else 16) / split
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  if local[0].platform == "cpu":
    available = _host_memory_available()
    need, where = per_device * len(local), f"this host's {_gib(available)} available"
  else:
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
    if not all(limits):
      return  # (a device that reports no limit: nothing to compare with)
    available, need = min(limits), per_device
    where = f"a {local[0].device_kind} device's {_gib(available)}"
  if available and need > available:
    raise UsageError(
        f"{what} has {params / 1e9:.1f}B params: their float32 values"
        f"{'' if lora else ', gradients and AdamW moments'} alone need {_gib(need)} "
        f"{'per device' if local[0].platform != 'cpu' else 'on this host'} on mesh "
        f"{mesh_spec}, more than {where}: "
        + ("a smaller model (simulated devices share the host's memory)"
           if local[0].platform == "cpu" else
           "more devices on the model axis (or --fsdp over data), or a smaller model"))


def _host_memory_available() -> int | None:
  """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError):
    pass
  return None


def _gib(n: float) -> str:
  return f"{n / 2**30:,.1f} GiB"


def _axes_inside_a_process(mesh) -> dict[str, bool]:
  """For each mesh axis longer than 1: whether every line of devices along it (the others
  held fixed) lies in one process. ``mesh.devices`` has as many dimensions as axes."""
  out = {}
  for i, name in enumerate(mesh.axis_names):
    if mesh.devices.shape[i] > 1:
      lines = np.moveaxis(mesh.devices, i, -1).reshape(-1, mesh.devices.shape[i])
      out[name] = all(len({d.process_index for d in line}) == 1 for line in lines)
  return out


def _roles(mesh) -> str:
  """``data=2, context=2, model=2``: each role's devices (context only when split)."""
  axes = flax_tp.MeshAxes.of(mesh)
  return ", ".join(f"{role}={axes.size(role)}" for role in axes.axis_names)


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


def attention_line(model, execution: Execution, *, seq_len: int) -> str | None:
  """The start-up line of the attention kernel the layers run and why; None where it is
  XLA's by default off a TPU (nothing to say)."""
  kernel, why = model.attention_kernel
  platform = model.mesh.devices.flat[0].platform
  if kernel == "xla" and execution.attention == "auto" and platform != "tpu":
    return None
  what = (f"splash (jax's Pallas kernel, blocks of {splash_block(seq_len)})"
          if kernel == "splash" else "xla (einsums, the scores in HBM)")
  return f"attention: {what} on every layer in training ({why}); cached decoding: xla"


class SetUp:
  """What a run starts from: the mesh, the model's config and execution record, the
  checkpoint folder (claimed), the data, the run's identity and resume point, the trainer
  and its params and optimizer state (restored on resume)."""

  def __init__(self, job: Job):
    self.job = job
    self.console = Console(quiet=not is_main_process(), highlight=False, soft_wrap=True)
    self.errors = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
      self.mesh = mesh = flax_tp.make_mesh(job.mesh)
    except ValueError as err:
      raise UsageError(str(err)) from None
    self.data_size = data_size = mesh.shape[flax_tp.DATA_AXIS]
    if job.schedule.batch_size % data_size:
      raise UsageError(f"--batch-size {job.schedule.batch_size} is not divisible by the "
                       f"{data_size}-way data axis of --mesh {job.mesh}")
    axes = flax_tp.MeshAxes.of(mesh)
    per_shard = job.schedule.batch_size // data_size
    if per_shard % job.execution.microbatches:
      raise UsageError(f"--microbatches {job.execution.microbatches} does not divide the "
                       f"{per_shard} sequences each data shard runs (--batch-size "
                       f"{job.schedule.batch_size} over the {data_size}-way data axis of "
                       f"--mesh {job.mesh})")
    overrides = job.model.overrides()
    # (the experts' run fields go on once the model is known to have experts)
    expert_fields = {k: overrides.pop(k) for k in EXPERT_RUN_FIELDS if k in overrides}
    self.execution = job.execution
    self.lora = job.lora.config(job.schedule.seed)
    tokenizer = None
    if job.model.init_from:
      self.cfg, tokenizer = hf_model_and_tokenizer(job.model.init_from, overrides)
    else:
      self.cfg = TransformerConfig.preset(job.model.preset_name, **overrides)
    if expert_fields and not self.cfg.has_experts:
      raise UsageError(f"--expert-capacity-factor {job.model.expert_capacity_factor} is for a "
                       f"model with experts; this one has none")
    self.cfg = dataclasses.replace(self.cfg, **expert_fields)
    if (job.execution.expert_axes != Execution.expert_axes
        and not self.cfg.has_experts):  # never a layout that lays out nothing
      raise UsageError(f"--expert-axes {','.join(job.execution.expert_axes)} is for a model "
                       "with experts; this one has none")
    if job.execution.expert_dispatcher != "all_gather" and not self.cfg.has_experts:
      raise UsageError("--expert-dispatcher all-to-all is for a model with experts; this one "
                       "has none")
    platform = jax.devices()[0].platform
    if (job.execution.expert_dispatcher == "all_to_all"
        and self.cfg.expert_capacity_factor is None
        and platform not in flax_tp.moe.RAGGED_ALL_TO_ALL_PLATFORMS):
      raise UsageError(f"--expert-dispatcher all-to-all without --expert-capacity-factor "
                       f"(dropless) needs jax.lax.ragged_all_to_all, which XLA on {platform!r} "
                       f"does not implement: give a capacity factor, or use all-gather")
    kinds = {self.cfg.is_moe_layer(i) for i in range(self.cfg.num_layers)}
    if axes.stage > 1 and len(kinds) > 1:
      raise UsageError(f"--mesh {job.mesh}: pipeline stages hold layers of one kind and this "
                       "model mixes dense and mixture-of-experts layers (first_k_dense_replace "
                       "or a layer step); use a mesh without a stage axis")
    if job.loss.router_z_loss and not self.cfg.has_experts:  # never a weight that does nothing
      raise UsageError(f"--router-z-loss {job.loss.router_z_loss} is for a model with experts "
                       "(it weighs their router's z-loss); this one has none")
    if job.loss.router_bias_rate and not self.cfg.router_selection_bias:
      raise UsageError(f"--router-bias-rate {job.loss.router_bias_rate} moves a router's "
                       "selection bias (DeepSeek-V3, GLM-4.5); this model's routers have none")
    self.checkpointer = None
    if job.checkpoint.dir:
      self.checkpointer = Checkpointer(job.checkpoint.dir,
                                       max_to_keep=job.checkpoint.keep or None,
                                       asynchronous=True)
      claim_checkpoint_dir(job, self.checkpointer, self.console)
    try:
      self.corpus = TokenCorpus.load(job.data, seq_len=job.model.seq_len, tokenizer=tokenizer,
                                     show_progress=is_main_process())
    except ValueError as err:
      raise UsageError(str(err)) from None
    self.identity = run_identity(job, self.cfg, self.corpus)
    self.start, self.notes = 0, []
    if job.checkpoint.resume:
      try:
        self.start, self.notes = resume_point(job, self.checkpointer, self.identity,
                                              self.corpus, self._same_lora_layers)
      except CheckpointError as err:
        raise UsageError(str(err)) from None
    self._build_state()

  def _same_lora_layers(self, saved: str, ours: str) -> bool:
    """Whether two ``--lora-targets`` strings adapt the same layers of this model (their
    globs matched against its column/row layers' paths, which its tensors name)."""
    from flax_tp.lora import matching_layers
    from models.families import tensor_names
    paths = sorted({".".join(map(str, path[:-1])) for tensor in tensor_names(self.cfg)
                    for path in tensor.paths if path[-1] == "kernel" and tensor.expert is None})
    try:
      return (matching_layers(paths, target_globs(saved))
              == matching_layers(paths, target_globs(ours)))
    except ValueError:  # a glob matching nothing: not the same run
      return False

  def _build_state(self) -> None:
    """The model's trainer, and its params and optimizer state (restored on resume)."""
    job = self.job
    check_state_fits(self.cfg, self.mesh, self.execution, lora=self.lora is not None,
                     what=(f"--init-from {job.model.init_from!r}" if job.model.init_from
                           else f"--preset {job.model.preset_name}"), mesh_spec=job.mesh)
    # The base from --init-from on a fresh run, and with LoRA on resume too (a LoRA
    # checkpoint holds the adapters alone).
    # Otherwise a fresh model, or one a checkpoint then overwrites.
    base = (job.model.init_from if job.model.init_from and (
        self.start == 0 or self.lora is not None) else None)
    try:
      model = build_run_model(self.cfg, mesh=self.mesh, seed=job.schedule.seed,
                              init_from=base, lora=self.lora, execution=self.execution)
    except (ValueError, OSError) as err:  # a LoRA target that matches no layer; missing
      # or misshapen tensors; a model the mesh's pipeline cannot run
      if str(err).startswith("LoRA target"):
        raise UsageError(f"--lora-targets: {err}") from None
      raise UsageError(f"--init-from {base!r}: {err}" if base else str(err)) from None
    opt = job.optimizer
    tx = make_optimizer(lr=opt.lr, steps=job.schedule.steps, warmup_steps=opt.warmup_steps,
                        weight_decay=opt.weight_decay, grad_clip=opt.grad_clip)
    self.trainer = Trainer(model, tx, LossOptions(job.loss.label_smoothing, job.loss.z_loss,
                                                  router_z_loss=job.loss.router_z_loss),
                           bias_update_rate=job.loss.router_bias_rate)
    del model
    self.params = self.trainer.params
    self.opt_state = self.trainer.init_opt_state(self.params)
    if self.start:
      try:
        restored, _ = self.checkpointer.restore(
            {"params": self.trainer.saved(self.params), "opt_state": self.opt_state},
            self.start)
      except CheckpointError as err:
        raise UsageError(str(err)) from None
      self.params = self.trainer.with_saved(self.params, restored["params"])
      self.opt_state = restored["opt_state"]

  def report_start(self) -> None:
    """The start-up lines: devices and processes, the model, the data, notes."""
    job, console, mesh, data_size = self.job, self.console, self.mesh, self.data_size
    summary = param_summary(self.params)
    devices = jax.devices()
    console.print(f"[bold]flax_tp[/bold] jax {jax.__version__} | {len(devices)} "
                  f"{devices[0].platform} device(s), {jax.process_count()} process(es) | mesh "
                  f"{job.mesh} ({_roles(mesh)})")
    if jax.process_count() > 1:
      console.print(f"processes: {jax.process_count()} x {jax.local_device_count()} devices; "
                    + "; ".join(f"the {name} axis {'stays inside' if local else 'spans'} a process"
                                for name, local in _axes_inside_a_process(mesh).items()))
    origin = (f"from {job.model.init_from!r}" if job.model.init_from
              else f"preset {job.model.preset_name}")
    options = self.execution.describe()
    console.print(f"model: {origin}, {summary['params']:,} params | per device: "
                  f"sharded {_mib(summary['sharded_bytes_per_device'])}, replicated "
                  f"{_mib(summary['replicated_bytes_per_device'])}"
                  + (f" | {', '.join(options)}" if options else ""))
    line = attention_line(self.trainer.model(self.params), self.execution,
                          seq_len=job.model.seq_len)
    if line:
      console.print(line, markup=False)
    if self.cfg.has_experts:
      # A step's dispatch sees the global batch, each row's S + 1 tokens.
      console.print(experts_line(self.trainer.model(self.params),
                                 tokens=job.schedule.batch_size * (job.model.seq_len + 1),
                                 microbatches=self.execution.microbatches))
    if self.trainer.accumulation > 1:
      per_shard = job.schedule.batch_size // data_size
      console.print(f"gradient accumulation: {self.trainer.accumulation} microbatches of "
                    f"{per_shard // self.trainer.accumulation} rows per data shard, one "
                    "forward and backward each, their gradients summed (a microbatch: the "
                    "global rows equal to its number mod "
                    f"{self.trainer.accumulation}, as a pipeline's)", markup=False)
    if self.trainer.model(self.params).pipeline is not None:
      console.print(pipeline_line(self.trainer.model(self.params), self.execution,
                                  batch=job.schedule.batch_size // data_size,
                                  seq_len=job.model.seq_len), markup=False)
    if self.lora is not None:
      console.print(lora_line(self.lora, self.trainer, self.params), markup=False)
    console.print(f"data: {self.corpus.describe()} | unigram entropy "
                  f"{self.corpus.unigram_entropy():.3f} nats | batch {job.schedule.batch_size} x "
                  f"{job.model.seq_len} tokens")
    notes = self.notes
    axes = flax_tp.MeshAxes.of(mesh)
    fsdp_devices = axes.data * axes.context
    if self.execution.fsdp and fsdp_devices > 1:  # never silently less sharded than asked
      whole = [".".join(map(str, path)) for path, var in nnx.to_flat_state(self.params)
               if not (ParamInfo.of(var).over_data or ParamInfo.of(var).over_experts)]
      over = (f"{data_size}-way data axis" if axes.context == 1 else
              f"{fsdp_devices} data x context devices")
      if whole:
        notes.append(f"note: --fsdp leaves {len(whole)} param(s) replicated over the "
                     f"{over}, which {'divides' if axes.context == 1 else 'divide'} none "
                     f"of their dimensions: "
                     f"{', '.join(whole[:4])}{' ...' if len(whole) > 4 else ''}")
    if self.execution.context_parallel != Execution.context_parallel and \
        flax_tp.MeshAxes.of(mesh).context == 1:
      notes.append(f"note: --context-parallel {self.execution.context_parallel} has nothing "
                   f"to do on mesh {job.mesh}, which has no context axis (DxCxM names one)")
    if (self.execution.remat not in ("none", "block") and not self.execution.scan_layers
        and axes.stage == 1 and mesh.devices.flat[0].platform == "cpu"):
      notes.append(f"note: --remat {self.execution.remat} without --scan-layers recomputes "
                   "nothing on XLA's CPU backend (jax.checkpoint in an unrolled loop is "
                   "merged back into the forward): add --scan-layers, or use --remat block")
    idle = [r for r in self.execution.expert_axes if r != flax_tp.DATA_AXIS and axes.size(r) == 1]
    if self.cfg.has_experts and idle:  # never a layout that silently is another
      notes.append(f"note: --expert-axes names {' and '.join(idle)}, which mesh {job.mesh} "
                   f"gives one device: the experts split over "
                   f"{' x '.join(axes.expert_axes(self.execution.expert_axes)) or 'nothing'}")
    if self.execution.pipeline_schedule != Execution.pipeline_schedule and axes.stage == 1:
      notes.append(f"note: --pipeline-schedule {self.execution.pipeline_schedule} has nothing "
                   f"to do on mesh {job.mesh}, which has no stage axis (e.g. "
                   "stage=2,data=2,model=2 names one)")
    for note in notes:
      console.print(note, markup=False)
    if self.start:
      console.print(f"resumed from step {self.start} in {job.checkpoint.dir!r}")


def lora_line(lora, trainer, params) -> str:
  """The start-up line saying what LoRA trains."""
  model = trainer.model(params)
  adapters = param_summary(trainer.trained(params))["params"]
  total = param_summary(params)["params"]
  rule = f"alpha / sqrt(rank) = {lora.scaling:g}" if lora.rslora else (
      f"alpha / rank = {lora.scaling:g}")
  return (f"lora: rank {lora.rank}, {rule}, on {len(model.lora_targets)} layers "
          f"({', '.join(lora.targets)}) | training {adapters:,} adapter params "
          f"({100 * adapters / total:.2f}% of {total:,}); the base is frozen")


def experts_line(model, tokens: int, microbatches: int = 1) -> str:
  """The start-up line saying how a mixture of experts is laid out on the mesh, how its
  tokens are dispatched, and what its capacity is for a step of ``tokens`` tokens (of
  ``microbatches`` microbatches, each routed, and capped, on its own): the model's MoE
  layers' own ``describe``."""
  cfg = model.cfg
  moe = next(m for _, m in nnx.iter_graph(model) if isinstance(m, flax_tp.MoE))
  unit = "step" if microbatches == 1 else "microbatch"
  layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
  return (f"experts: {cfg.num_experts} in each of {layers} MoE layer(s), "
          + moe.describe(tokens // microbatches, unit))


def pipeline_line(model, execution: Execution, *, batch: int, seq_len: int) -> str:
  """The start-up line of a pipelined run: which layers each stage holds, the bubble,
  and what a stage holds and sends per step."""
  plan, microbatches = model.pipeline, execution.microbatches
  return (f"{plan.describe(microbatches)} | per microbatch {batch // microbatches} x "
          f"{seq_len} tokens per data shard")
