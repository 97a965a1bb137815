#!/usr/bin/env python
"""Train the tensor-parallel transformer on a ("data", ["context",] "model") mesh.

    python train/run.py --mesh 2x4

On the CPU platform the simulated devices the mesh needs are provided here,
before JAX starts (unless XLA_FLAGS already sets a device count, which is then
respected); on a GPU/TPU host the real devices are used. Bad input exits with
status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.errors import (
  RunError,
  UsageError,
  exit_on_interrupt,
  not_utf8,
  say,
  unwritable_file,
)

if __name__ == "__main__":  # before the imports below start JAX: Ctrl-C there is one line
  exit_on_interrupt("train/run.py")

from flax_tp.checkpoint.ownership import OWN_FOLDER
from flax_tp.context import STRATEGIES as CONTEXT_STRATEGIES
from flax_tp.mesh import MeshAxes
from flax_tp.pipeline import SCHEDULES
from flax_tp.remat import REMAT_CHOICES
from flax_tp.run_lock import LOCK_NAME
from models.config import ABSTRACT_ONLY, TransformerConfig
from models.execution import Execution
from models.splash import KERNELS as ATTENTION_KERNELS
from train import distributed as train_distributed
from train.cli import (
  INT_MAX,
  SEED_LIMIT,
  DefaultsHelpFormatter,
  UsageParser,
  exit_ladder,
  one_line,
)
from train.devices import provide_mesh_devices
from train.job import DEFAULTS, target_globs


def build_parser() -> argparse.ArgumentParser:
  d = DEFAULTS
  p = UsageParser(prog="train/run.py", description=__doc__.split("\n\n")[0],
              formatter_class=DefaultsHelpFormatter)
  p.add_argument("--mesh", default=d["mesh"],
                 help="DxM: D-way data parallel by M-way tensor (model) parallel; DxCxM "
                      "adds C-way context parallelism (the sequence split over C devices); "
                      "or named sizes in any order, e.g. data=2,context=2,model=2, and "
                      "stage=S for S pipeline stages")
  p.add_argument("--preset", default=None, choices=TransformerConfig.preset_names(),
                 help="model: 'tiny' for tests, 'small' trains usefully on a CPU; 'llama-tiny' "
                      "(grouped-query attention, RMSNorm, SwiGLU) for tests, 'llama-125m' and "
                      "'llama-350m' Llama-style sizes for benchmarks (default: "
                      f"{d['preset']})")
  p.add_argument("--init-from", default=None, metavar="HF_DIR",
                 help="continue training a HuggingFace checkpoint of a supported family (config.json, "
                      "safetensors, tokenizer.json); its config replaces --preset and its "
                      "tokenizer the byte-level one")
  p.add_argument("--steps", type=int, default=d["steps"], help="total optimizer steps")
  p.add_argument("--batch-size", type=int, default=d["batch_size"],
                 help="global batch (sequences per step), split over the data axis")
  p.add_argument("--seq-len", type=int, default=d["seq_len"], help="tokens (bytes) per sequence")
  p.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (AdamW)")
  p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"],
                 help="linear warm-up steps, then cosine decay to 10%% of --lr")
  p.add_argument("--weight-decay", type=float, default=d["weight_decay"],
                 help="AdamW decoupled weight decay (matrices only)")
  p.add_argument("--grad-clip", type=float, default=d["grad_clip"],
                 help="clip gradients to this global norm (0: off)")
  p.add_argument("--label-smoothing", type=float, default=0.0,
                 help="label smoothing over the whole vocabulary (as optax's smooth_labels)")
  p.add_argument("--z-loss", type=float, default=0.0,
                 help="weight of the z-loss (logsumexp squared) added to the loss")
  p.add_argument("--router-z-loss", type=float, default=0.0,
                 help="mixture of experts: weight of the router z-loss (the router logits' "
                      "logsumexp squared, ST-MoE) added to the loss; the load-balancing "
                      "loss's weight is the model's router_aux_loss_coef")
  p.add_argument("--router-bias-rate", type=float, default=0.0,
                 help="mixture of experts with a selection bias (DeepSeek-V3, GLM-4.5): "
                      "after each step move each expert's bias by this much toward its "
                      "layer's mean load (DeepSeek-V3's auxiliary-loss-free balancing; "
                      "its report used 0.001); default: off")
  p.add_argument("--expert-capacity-factor", type=float, default=d["expert_capacity_factor"],
                 help="mixture of experts: each expert takes at most ceil(F * tokens * "
                      "top_k / experts) of a step's routed choices, the rest dropped "
                      "(counted in the metrics as expert_dropped); default: dropless")
  p.add_argument("--expert-drop-policy", default=d["expert_drop_policy"],
                 choices=["probs", "position"],
                 help="which choices a full expert keeps: the largest routing weights "
                      "(Megatron's default) or the earliest tokens")
  p.add_argument("--lora-rank", type=int, default=d["lora_rank"],
                 help="LoRA fine-tuning: adapters of this rank on --lora-targets, trained "
                      "alone (the base frozen, outside the optimizer); 0: full fine-tuning")
  p.add_argument("--lora-alpha", type=float, default=d["lora_alpha"],
                 help="LoRA scaling alpha / rank (PEFT's lora_alpha)")
  p.add_argument("--lora-targets", default=d["lora_targets"],
                 help="comma-separated globs over module paths of the layers to adapt, "
                      "e.g. 'blocks.*.attn.[qkvo],blocks.*.mlp.*'")
  p.add_argument("--lora-rslora", action="store_true",
                 help="rsLoRA scaling alpha / sqrt(rank)")
  p.add_argument("--dropout", type=float, default=d["dropout"],
                 help="dropout rate; masks do not depend on the mesh")
  p.add_argument("--dtype", default=d["dtype"], choices=["float32", "bfloat16"],
                 help="compute dtype (params and optimizer state stay float32)")
  p.add_argument("--sequence-parallel", action="store_true",
                 help="Megatron sequence parallelism: activations between blocks split over "
                      "the sequence on the model axis (less activation memory, same result)")
  p.add_argument("--remat", default="none", choices=REMAT_CHOICES,
                 help="recompute each block in the backward pass: 'block' saves nothing, "
                      "or a jax.checkpoint_policies name (on CPU, with --scan-layers)")
  p.add_argument("--context-parallel", default=Execution.context_parallel,
                 choices=CONTEXT_STRATEGIES,
                 help="on a mesh with a context axis (DxCxM), how attention reaches the other "
                      "context shards' keys: all_gather them, or pass k/v blocks around a "
                      "ring (memory of two blocks whatever C); same results")
  p.add_argument("--attention", default=Execution.attention, choices=ATTENTION_KERNELS,
                 help="the attention kernel: 'splash' (jax's Pallas splash attention: the "
                      "scores never reach HBM), 'xla' (XLA's einsums), or 'auto': splash on "
                      "a TPU where the model allows it, XLA elsewhere; same results to "
                      "float rounding")
  p.add_argument("--loss-chunks", type=int, default=Execution.loss_chunks,
                 help="make the head's logits and score them this many pieces of the "
                      "sequence at a time (again in backward): the [batch, seq, vocab] "
                      "float32 logits never whole in memory, for the head's matmul once "
                      "more; same results to float rounding")
  p.add_argument("--expert-axes", default=",".join(Execution.expert_axes),
                 help="mixture of experts: the mesh axes the experts split over, 'data' and "
                      "any of 'context' (each context shard's tokens reach the experts on "
                      "the others) and 'model' (each expert whole on one device, its FFN not "
                      "split); same results")
  p.add_argument("--expert-dispatcher", default="all-gather",
                 choices=["all-gather", "all-to-all"],
                 help="mixture of experts: how routed tokens reach their experts' shards: "
                      "every shard's tokens to every shard (drops that do not depend on the "
                      "mesh), or each routed choice only to its expert's shard and back "
                      "(needs --expert-capacity-factor, taken per source shard: drops depend "
                      "on the data axis)")
  p.add_argument("--microbatches", type=int, default=Execution.microbatches,
                 help="on a mesh with a stage axis (e.g. stage=2,data=2,model=2): the "
                      "microbatches each data shard's batch is cut into, which flow through "
                      "the pipeline's stages (more: a smaller bubble); same results")
  p.add_argument("--pipeline-schedule", default=Execution.pipeline_schedule,
                 choices=SCHEDULES,
                 help="on a mesh with a stage axis: 'gpipe' (each stage one group of "
                      "consecutive layers), 'circular' (each stage several groups of "
                      "non-adjacent layers, the bubble divided by their number) or '1f1b' "
                      "(gpipe's layers, each stage alternating forwards and backwards: "
                      "activation memory flat in --microbatches, one more forward)")
  p.add_argument("--pipeline-repeats", type=int, default=None,
                 help="the circular schedule's groups per stage (default: as many as the "
                      "layers a stage holds)")
  p.add_argument("--fsdp", action="store_true",
                 help="also split params, gradients and optimizer state over the data axis "
                      "(ZeRO-3/FSDP): per-device memory / D; same results")
  p.add_argument("--scan-layers", action="store_true",
                 help="store the blocks stacked and run them as one lax.scan: compile time stops "
                      "growing with depth (checkpoints stay per layer)")
  p.add_argument("--seed", type=int, default=d["seed"],
                 help="seeds init, data order and dropout")
  p.add_argument("--data", default=None,
                 help="a text file or a folder of them (default: the Python standard "
                      "library's source, found through sysconfig)")
  p.add_argument("--eval-every", type=int, default=d["eval_every"],
                 help="held-out loss every N steps (0: only at the end)")
  p.add_argument("--checkpoint-dir", default=None,
                 help="where to write checkpoints (logical arrays: restore on any mesh)")
  p.add_argument("--checkpoint-every", type=int, default=d["checkpoint_every"],
                 help="checkpoint every N steps (0: only at the end); needs --checkpoint-dir")
  p.add_argument("--resume", action="store_true",
                 help="continue the run whose checkpoints are in --checkpoint-dir, on any mesh")
  p.add_argument("--overwrite", action="store_true",
                 help="start a fresh run in a --checkpoint-dir that holds another run's "
                      "checkpoints, deleting them (without it such a directory is refused)")
  p.add_argument("--keep-checkpoints", type=int, default=d["keep_checkpoints"],
                 help="how many of this run's newest checkpoints to keep (0: all)")
  p.add_argument("--metrics-file", default=None, help="append one JSON line per step here")
  p.add_argument("--sample-prompt", default=d["sample_prompt"],
                 help="prompt for the text sample printed at the end")
  p.add_argument("--sample-length", type=int, default=d["sample_length"],
                 help="bytes to generate at the end (0: no sample)")
  g = p.add_argument_group(
      "multiple processes", "join a run of several processes (hosts) through JAX's distributed "
      "runtime; each flag may also come from FLAX_TP_COORDINATOR, FLAX_TP_NUM_PROCESSES, "
      "FLAX_TP_PROCESS_ID, and on a cluster launcher JAX detects (Slurm, Open MPI, TPU, "
      "Kubernetes) none is needed. --mesh is global: it spans every process's devices")
  g.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordinator")
  g.add_argument("--num-processes", type=int, default=None, help="processes in the run")
  g.add_argument("--process-id", type=int, default=None, help="this process's id, 0..N-1")
  g.add_argument("--init-timeout", type=int, default=d["init_timeout"],
                 help="seconds to wait for the coordinator and the other processes")
  g.add_argument("--heartbeat-timeout", type=int, default=d["heartbeat_timeout"],
                 help="seconds without a heartbeat after which a process counts as dead and "
                      "the run stops")
  return p


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def check_args(args: argparse.Namespace) -> None:
  """Every flag checked as a number or a path before any work starts (UsageError)."""
  int_ranges = {"steps": 1, "batch_size": 1, "seq_len": 1, "warmup_steps": 0, "eval_every": 0,
                "checkpoint_every": 0, "keep_checkpoints": 0, "sample_length": 0,
                "init_timeout": 1, "heartbeat_timeout": 1}
  for name, low in int_ranges.items():
    value = getattr(args, name)
    if not low <= value <= INT_MAX:
      raise UsageError(f"{_flag(name)} must be an integer in [{low}, {INT_MAX}], got {value}")
  if not 0 <= args.seed < SEED_LIMIT:
    raise UsageError(f"--seed must be an integer in [0, 2**32), got {args.seed}")
  # Floats: NaN fails every comparison, so each range is written as the
  # condition that must hold, and infinities are refused separately.
  float_ranges = {"lr": ("a positive number", lambda v: v > 0),
                  "weight_decay": ("a number >= 0", lambda v: v >= 0),
                  "grad_clip": ("a number >= 0 (0: off)", lambda v: v >= 0),
                  "label_smoothing": ("a number in [0, 1]", lambda v: 0 <= v <= 1),
                  "z_loss": ("a number >= 0", lambda v: v >= 0),
                  "router_z_loss": ("a number >= 0", lambda v: v >= 0),
                  "router_bias_rate": ("a number >= 0", lambda v: v >= 0),
                  "dropout": ("a number in [0, 1)", lambda v: 0 <= v < 1)}
  if args.expert_capacity_factor is not None:
    float_ranges["expert_capacity_factor"] = ("a positive number", lambda v: v > 0)
  for name, (expected, ok) in float_ranges.items():
    value = getattr(args, name)
    if not (math.isfinite(value) and ok(value)):
      raise UsageError(f"{_flag(name)} must be {expected}, got {value}")
  if args.lora_rank < 0 or args.lora_rank > INT_MAX:
    raise UsageError(f"--lora-rank must be an integer >= 0 (0: full fine-tuning), got "
                     f"{args.lora_rank}")
  if not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
    raise UsageError(f"--lora-alpha must be a positive number, got {args.lora_alpha}")
  lora_flags = [flag for flag, given in (
      ("--lora-alpha", args.lora_alpha != DEFAULTS["lora_alpha"]),
      ("--lora-targets", args.lora_targets != DEFAULTS["lora_targets"]),
      ("--lora-rslora", args.lora_rslora)) if given]
  if lora_flags and not args.lora_rank:
    raise UsageError(f"{lora_flags[0]} needs --lora-rank (without it the run fine-tunes "
                     "every param)")
  if args.lora_rank and args.router_bias_rate:  # (Trainer says so too, after the build)
    raise UsageError(f"--router-bias-rate {args.router_bias_rate:g} moves routers' selection "
                     "biases, which --lora-rank freezes with the rest of the base (a LoRA "
                     "checkpoint holds the adapters alone)")
  if args.lora_rank and not target_globs(args.lora_targets):
    raise UsageError(f"--lora-targets {args.lora_targets!r} names no layer: give comma-"
                     "separated globs over module paths, e.g. 'blocks.*.attn.[qv]'")
  if not 1 <= args.microbatches <= INT_MAX:
    raise UsageError(f"--microbatches must be an integer in [1, {INT_MAX}], got "
                     f"{args.microbatches}")
  if not 1 <= args.loss_chunks <= INT_MAX:
    raise UsageError(f"--loss-chunks must be an integer in [1, {INT_MAX}], got "
                     f"{args.loss_chunks}")
  if args.pipeline_repeats is not None:
    if args.pipeline_schedule != "circular":
      raise UsageError(f"--pipeline-repeats {args.pipeline_repeats} is for "
                       f"--pipeline-schedule circular ({args.pipeline_schedule} holds one "
                       "group of layers per stage)")
    if not 1 <= args.pipeline_repeats <= INT_MAX:
      raise UsageError(f"--pipeline-repeats must be an integer in [1, {INT_MAX}], got "
                       f"{args.pipeline_repeats}")
  try:
    MeshAxes.expert_roles(args.expert_axes)
  except ValueError as err:
    raise UsageError(f"--expert-axes: {err}") from None
  args.expert_dispatcher = args.expert_dispatcher.replace("-", "_")  # Execution's spelling
  if args.expert_drop_policy != "probs" and args.expert_capacity_factor is None:
    raise UsageError("--expert-drop-policy needs --expert-capacity-factor (without one "
                     "nothing is dropped)")
  if args.preset in ABSTRACT_ONLY:
    raise UsageError(f"--preset {args.preset} is {ABSTRACT_ONLY[args.preset]}: its shapes are "
                     "for the benchmarks' abstract compiles (bench.families); train from "
                     "its checkpoint with --init-from")
  if not_utf8(args.sample_prompt):
    raise UsageError(f"--sample-prompt: {not_utf8(args.sample_prompt)}")
  if args.resume and args.overwrite:
    raise UsageError("--resume and --overwrite contradict each other: --resume continues the "
                     "run in --checkpoint-dir, --overwrite deletes its checkpoints")
  for flag, needs in (("resume", args.resume), ("overwrite", args.overwrite),
                      ("checkpoint_every", args.checkpoint_every)):
    if needs and not args.checkpoint_dir:
      raise UsageError(f"{_flag(flag)} needs --checkpoint-dir")
  if args.init_from is not None:
    if args.preset is not None:
      raise UsageError("--preset and --init-from contradict each other: the checkpoint's "
                       "config.json gives the model")
    if not (Path(args.init_from) / "config.json").is_file():
      raise UsageError(f"--init-from {args.init_from!r} is not a HuggingFace model folder (no "
                       "config.json)")
  if args.data is not None and not Path(args.data).exists():
    raise UsageError(f"--data {args.data!r} does not exist")
  if args.checkpoint_dir:
    check_writable_dir("--checkpoint-dir", Path(args.checkpoint_dir))
  if args.metrics_file:
    check_writable_file("--metrics-file", Path(args.metrics_file))
    if args.checkpoint_dir:
      check_outside_checkpoints("--metrics-file", Path(args.metrics_file),
                                Path(args.checkpoint_dir))


def check_outside_checkpoints(flag: str, path: Path, checkpoint_dir: Path) -> None:
  """``path`` is not inside what the run's checkpointer owns in ``checkpoint_dir``: a step's
  folder (or its ``.tmp-``/``.old-`` form), or the run's lock file; appending there would
  corrupt a checkpoint. (A file of the user's beside the step folders is fine.)"""
  path, root = path.resolve(), checkpoint_dir.resolve()
  if not path.is_relative_to(root) or path == root:
    return
  first = path.relative_to(root).parts[0]
  if OWN_FOLDER.fullmatch(first) or first == LOCK_NAME:
    raise UsageError(f"{flag} {str(path)!r} is inside {str(root / first)!r}, which the run's "
                     "checkpoints own; write it elsewhere")


def check_writable_dir(flag: str, path: Path) -> None:
  """``path`` is, or can be made, a folder this process can write into."""
  if path.exists() and not path.is_dir():
    raise UsageError(f"{flag} {str(path)!r} is a file, not a folder")
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    raise UsageError(f"{flag} {str(path)!r} cannot be created: {err.strerror}") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise UsageError(f"{flag} {str(path)!r} is not writable")


def check_writable_file(flag: str, path: Path) -> None:
  """``path`` is a file that can be appended to, or can be created (nothing is written)."""
  if path.is_dir():
    raise UsageError(f"{flag} {str(path)!r} is a folder, not a file")
  parent = path.parent
  if not parent.is_dir():
    raise UsageError(f"{flag} {str(path)!r}: folder {str(parent)!r} does not exist")
  why = unwritable_file(path)
  if why:
    raise UsageError(f"{flag} {str(path)!r} cannot be written: {why}")


# Simulated CPU devices are threads sharing the host's cores. XLA aborts the whole
# process when a collective's threads have not all arrived within 40 s; a busy host
# (another 8-device process compiling on the same 2 cores) can hold one back that long
# without any hang, so wait longer. A real deadlock still ends in XLA's abort, after
# this wait (flax_tp.mesh.cpu_thread_pool_size removes the one seen).
def main(argv: list[str] | None = None) -> int:
  return exit_ladder("train/run.py", lambda: _main(argv),
                     failures=(train_distributed.DistributedError,))


def _main(argv: list[str] | None) -> int:
  args = build_parser().parse_args(argv)
  check_args(args)
  distributed = train_distributed.from_args(args)
  provide_mesh_devices(args.mesh, (distributed.num_processes or 1) if distributed else 1)
  if distributed:
    train_distributed.silence_native_stdout()
    if os.environ.get("FLAX_TP_NATIVE_LOG"):
      train_distributed.divert_native_stderr(os.environ["FLAX_TP_NATIVE_LOG"])
    train_distributed.initialize(distributed, timeout_s=args.init_timeout,
                                 heartbeat_s=args.heartbeat_timeout)
  from train.loop import run  # imports jax: after the device count is set
  try:
    return run(args)
  except (UsageError, RunError):
    raise
  except Exception as err:
    reason = train_distributed.lost_peer(err) if distributed else None
    if reason is None:
      raise RunError(one_line(err)) from err
    # Straight to the file descriptor (a live progress display may still hold
    # sys.stderr), then skip JAX's shutdown barrier, which would wait for the
    # dead process.
    say(f"train/run.py: error: {reason}; stopping")
    os._exit(1)


if __name__ == "__main__":
  sys.exit(main())
