"""The training job: one record built from ``train/run.py``'s flags, by section, and the
only holder of their defaults (argparse reads ``DEFAULTS``, ``make_optimizer`` reads
``OptimizerJob``'s). Importing it touches no device (``train/run.py`` reads it before it
sets XLA's device count)."""

from __future__ import annotations

import argparse
import dataclasses

from models.execution import Execution


@dataclasses.dataclass(frozen=True)
class ModelJob:
  preset: str | None = None  # None: "small", unless init_from gives the model
  init_from: str | None = None  # an HF folder: its config, weights and tokenizer
  seq_len: int = 128
  dropout: float = 0.0
  dtype: str = "float32"
  # mixture of experts: None trains dropless; else each expert's capacity (flax_tp.MoE)
  expert_capacity_factor: float | None = None
  expert_drop_policy: str = "probs"

  @property
  def preset_name(self) -> str:
    return self.preset or "small"

  def overrides(self) -> dict:
    """The config fields the job sets, whatever the preset or HF config says (a capacity
    only when one is asked for: a dense model has no expert fields to set)."""
    out = dict(max_seq_len=self.seq_len, dropout=self.dropout, dtype=self.dtype)
    if self.expert_capacity_factor is not None:
      out.update(expert_capacity_factor=self.expert_capacity_factor,
                 expert_drop_policy=self.expert_drop_policy)
    return out


@dataclasses.dataclass(frozen=True)
class OptimizerJob:
  lr: float = 3e-3
  warmup_steps: int = 40
  weight_decay: float = 0.1
  grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class LossJob:
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  router_z_loss: float = 0.0  # mixture of experts: the router z-loss's weight
  # DeepSeek-V3's auxiliary-loss-free balancing: how far each step moves a router's
  # selection bias toward its layer's mean load (0: off)
  router_bias_rate: float = 0.0

  def identity(self) -> dict:
    """The fields as a run's identity holds them: one added after runs were written
    (``router_z_loss``, ``router_bias_rate``) is left out at its default, so those runs
    still resume."""
    out = dataclasses.asdict(self)
    for name in ("router_z_loss", "router_bias_rate"):
      if out[name] == 0.0:
        del out[name]
    return out


@dataclasses.dataclass(frozen=True)
class LoRAJob:
  """LoRA fine-tuning (rank 0: full fine-tuning). Defaults as PEFT's LoraConfig: alpha 8,
  adapters on the attention's q and v."""
  rank: int = 0
  alpha: float = 8.0
  targets: str = "blocks.*.attn.[qv]"  # comma-separated globs over module paths
  rslora: bool = False

  def config(self, seed: int):
    """The ``flax_tp.LoRAConfig``, or None without adapters (imported here: this module
    touches no device)."""
    if not self.rank:
      return None
    from flax_tp.lora import LoRAConfig
    return LoRAConfig(rank=self.rank, alpha=self.alpha, rslora=self.rslora, seed=seed,
                      targets=target_globs(self.targets))

  def identity(self) -> dict | None:
    return dataclasses.asdict(self) if self.rank else None


def target_globs(targets: str) -> tuple[str, ...]:
  """``--lora-targets``' comma-separated globs, blanks dropped."""
  return tuple(t.strip() for t in targets.split(",") if t.strip())


@dataclasses.dataclass(frozen=True)
class ScheduleJob:
  steps: int = 400
  batch_size: int = 32
  seed: int = 0
  eval_every: int = 100


@dataclasses.dataclass(frozen=True)
class CheckpointJob:
  dir: str | None = None
  every: int = 0
  keep: int = 3
  resume: bool = False
  overwrite: bool = False


@dataclasses.dataclass(frozen=True)
class SampleJob:
  prompt: str = "def "
  length: int = 200


@dataclasses.dataclass(frozen=True)
class DistributedJob:
  init_timeout: int = 60
  heartbeat_timeout: int = 20


@dataclasses.dataclass(frozen=True)
class Job:
  mesh: str = "2x4"
  model: ModelJob = ModelJob()
  execution: Execution = Execution()
  optimizer: OptimizerJob = OptimizerJob()
  loss: LossJob = LossJob()
  lora: LoRAJob = LoRAJob()
  schedule: ScheduleJob = ScheduleJob()
  checkpoint: CheckpointJob = CheckpointJob()
  data: str | None = None
  metrics_file: str | None = None
  sample: SampleJob = SampleJob()
  distributed: DistributedJob = DistributedJob()

  @classmethod
  def from_args(cls, args: argparse.Namespace) -> Job:
    """The job of ``train/run.py``'s parsed (and checked) flags."""
    section = lambda kind, **names: kind(**{field: getattr(args, flag)
                                            for field, flag in names.items()})
    return cls(
        mesh=args.mesh,
        model=section(ModelJob, preset="preset", init_from="init_from", seq_len="seq_len",
                      dropout="dropout", dtype="dtype",
                      expert_capacity_factor="expert_capacity_factor",
                      expert_drop_policy="expert_drop_policy"),
        execution=section(Execution, sequence_parallel="sequence_parallel", remat="remat",
                          scan_layers="scan_layers", fsdp="fsdp",
                          context_parallel="context_parallel", attention="attention",
                          loss_chunks="loss_chunks",
                          expert_axes="expert_axes",
                          expert_dispatcher="expert_dispatcher",
                          microbatches="microbatches", pipeline_schedule="pipeline_schedule",
                          pipeline_repeats="pipeline_repeats"),
        optimizer=section(OptimizerJob, lr="lr", warmup_steps="warmup_steps",
                          weight_decay="weight_decay", grad_clip="grad_clip"),
        loss=section(LossJob, label_smoothing="label_smoothing", z_loss="z_loss",
                     router_z_loss="router_z_loss", router_bias_rate="router_bias_rate"),
        lora=section(LoRAJob, rank="lora_rank", alpha="lora_alpha", targets="lora_targets",
                     rslora="lora_rslora"),
        schedule=section(ScheduleJob, steps="steps", batch_size="batch_size", seed="seed",
                         eval_every="eval_every"),
        checkpoint=section(CheckpointJob, dir="checkpoint_dir", every="checkpoint_every",
                           keep="keep_checkpoints", resume="resume", overwrite="overwrite"),
        data=args.data, metrics_file=args.metrics_file,
        sample=section(SampleJob, prompt="sample_prompt", length="sample_length"),
        distributed=section(DistributedJob, init_timeout="init_timeout",
                            heartbeat_timeout="heartbeat_timeout"))


def _defaults() -> dict:
  """``train/run.py``'s flag defaults (by flag name), read from the record's fields."""
  flags = {"checkpoint_dir": ("checkpoint", "dir"), "checkpoint_every": ("checkpoint", "every"),
           "lora_rank": ("lora", "rank"), "lora_alpha": ("lora", "alpha"),
           "lora_targets": ("lora", "targets"), "lora_rslora": ("lora", "rslora"),
           "keep_checkpoints": ("checkpoint", "keep"), "sample_prompt": ("sample", "prompt"),
           "sample_length": ("sample", "length")}
  job, out = Job(), {"mesh": Job.mesh}
  for section in ("model", "optimizer", "schedule", "distributed"):
    out.update(dataclasses.asdict(getattr(job, section)))
  out.update({flag: getattr(getattr(job, s), f) for flag, (s, f) in flags.items()})
  out["preset"] = job.model.preset_name
  return {k: v for k, v in out.items() if k not in ("init_from", "checkpoint_dir")}


DEFAULTS = _defaults()
