"""The training loop behind ``train/run.py``: set-up, steps, eval, checkpoints, sample."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import flax_tp
from flax_tp.checkpoint import Checkpointer, CheckpointError
from models.config import TransformerConfig
from models.transformer import Transformer
from train.data import ByteCorpus
from train.errors import UsageError
from train.sample import generate
from train.step import LossOptions, Trainer, make_optimizer

EVAL_BATCHES = 4


def is_main_process() -> bool:
  return jax.process_index() == 0


def global_batch(corpus: ByteCorpus, split: str, seed: int, step: int, batch_size: int,
                 seq_len: int, sharding: NamedSharding) -> jax.Array:
  """The step's ``[batch, seq_len + 1]`` tokens, sharded over "data".

  Only the rows this process's devices hold are read (each device's block is
  built by the callback), so a process never reads another's share.
  """
  starts = corpus.window_starts(split, seed, step, batch_size, seq_len)
  return jax.make_array_from_callback(
      (batch_size, seq_len + 1), sharding,
      lambda index: corpus.rows(split, starts[index[0]], seq_len)[:, index[1]])


def param_summary(params: nnx.State) -> dict[str, int]:
  """Logical parameter count and per-device bytes, split into sharded and replicated."""
  total = sharded = replicated = 0
  for _, var in nnx.to_flat_state(params):
    value = var[...]
    layout = var.get_metadata().get("tp_layout")
    shard_bytes = value.addressable_shards[0].data.nbytes
    if layout is not None:
      total += value.size // layout.padded_total * layout.size
      sharded += shard_bytes
    else:
      total += value.size
      replicated += shard_bytes
  return dict(params=total, sharded_bytes_per_device=sharded,
              replicated_bytes_per_device=replicated)


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


class MetricsWriter:
  def __init__(self, path: str | None):
    self.file = open(path, "a", encoding="utf-8") if path and is_main_process() else None

  def write(self, record: dict[str, Any]) -> None:
    if self.file:
      self.file.write(json.dumps(record) + "\n")
      self.file.flush()

  def close(self) -> None:
    if self.file:
      self.file.close()


def run(args: argparse.Namespace) -> int:
  console = Console(quiet=not is_main_process(), highlight=False, soft_wrap=True)
  errors = Console(stderr=True, highlight=False, soft_wrap=True)
  try:
    mesh = flax_tp.make_mesh(args.mesh)
  except ValueError as err:
    raise UsageError(str(err)) from None
  data_size = mesh.shape[flax_tp.DATA_AXIS]
  if args.batch_size % data_size:
    raise UsageError(f"--batch-size {args.batch_size} is not divisible by the {data_size}-way "
                     f"data axis of --mesh {args.mesh}")
  cfg = TransformerConfig.preset(args.preset, max_seq_len=args.seq_len, dropout=args.dropout,
                                 dtype=args.dtype)
  try:
    corpus = ByteCorpus.load(args.data, seq_len=args.seq_len)
  except ValueError as err:
    raise UsageError(str(err)) from None

  model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(args.seed))
  tx = make_optimizer(lr=args.lr, steps=args.steps, warmup_steps=args.warmup_steps,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip)
  trainer = Trainer(model, tx, LossOptions(args.label_smoothing, args.z_loss))
  del model
  params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)

  checkpointer = Checkpointer(args.checkpoint_dir) if args.checkpoint_dir else None
  start = 0
  run_meta = dict(config=dataclasses.asdict(cfg), seed=args.seed, batch_size=args.batch_size,
                  seq_len=args.seq_len, steps=args.steps)
  if args.resume:
    if checkpointer.latest_step() is None:
      raise UsageError(f"--resume: no checkpoint in {args.checkpoint_dir!r}")
    try:
      meta = checkpointer.read_meta()
      if meta.get("config") != run_meta["config"]:
        raise UsageError(f"checkpoint in {args.checkpoint_dir!r} was written for another model "
                         f"config ({meta.get('config')}); pass the same --preset/--seq-len/"
                         "--dropout/--dtype")
      if int(meta["step"]) >= args.steps:  # decided before reading any array
        raise UsageError(f"--resume: the checkpoint in {args.checkpoint_dir!r} is at step "
                         f"{meta['step']}, already at --steps {args.steps}; raise --steps to "
                         "train further")
      restored, meta = checkpointer.restore({"params": params, "opt_state": opt_state})
    except CheckpointError as err:
      raise UsageError(str(err)) from None
    params, opt_state, start = restored["params"], restored["opt_state"], int(meta["step"])

  summary = param_summary(params)
  devices = jax.devices()
  console.print(f"[bold]flax_tp[/bold] jax {jax.__version__} | {len(devices)} "
                f"{devices[0].platform} device(s), {jax.process_count()} process(es) | mesh "
                f"{args.mesh} (data={data_size}, model={mesh.shape[flax_tp.MODEL_AXIS]})")
  if jax.process_count() > 1:
    local_rows = all(len({d.process_index for d in row}) == 1 for row in mesh.devices)
    console.print(f"processes: {jax.process_count()} x {jax.local_device_count()} devices; the "
                  f"model axis {'stays inside' if local_rows else 'spans'} a process")
  console.print(f"model: preset {args.preset}, {summary['params']:,} params | per device: "
                f"sharded {_mib(summary['sharded_bytes_per_device'])}, replicated "
                f"{_mib(summary['replicated_bytes_per_device'])}")
  console.print(f"data: {corpus.source}, {len(corpus.train):,} train / {len(corpus.eval):,} "
                f"eval bytes, unigram entropy {corpus.unigram_entropy():.3f} nats | batch "
                f"{args.batch_size} x {args.seq_len} tokens")
  if start:
    console.print(f"resumed from step {start} in {args.checkpoint_dir}")

  metrics = MetricsWriter(args.metrics_file)
  dropout_key = jax.random.key(args.seed + 1) if args.dropout > 0 else None

  def evaluate(params) -> float:
    losses = [trainer.eval_step(params, global_batch(
        corpus, "eval", args.seed, i, args.batch_size, args.seq_len, trainer.batch_sharding))
              for i in range(EVAL_BATCHES)]
    return float(np.mean([float(x) for x in losses]))

  def save(step: int) -> None:
    if checkpointer is not None:
      checkpointer.save(step, {"params": params, "opt_state": opt_state},
                        {**run_meta, "step": step})

  tokens_per_step = args.batch_size * args.seq_len
  first_eval = evaluate(params) if start == 0 else None
  if first_eval is not None:
    console.print(f"step 0: eval loss {first_eval:.4f}")
    metrics.write({"step": 0, "eval_loss": first_eval})
  last_eval, loss, rate = first_eval, float("nan"), 0.0
  progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("loss {task.fields[loss]}"),
                      TextColumn("{task.fields[rate]} tok/s"), TimeRemainingColumn(),
                      console=console, transient=False)
  task = progress.add_task("train", total=args.steps, completed=start, loss="-", rate="-")
  timed_steps, timed_seconds = 0, 0.0
  done = start
  try:
    with progress:
      for step in range(start, args.steps):
        t0 = time.perf_counter()
        tokens = global_batch(corpus, "train", args.seed, step, args.batch_size, args.seq_len,
                              trainer.batch_sharding)
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, step)
        new_params, new_opt_state, out = trainer.train_step(params, opt_state, tokens, key)
        loss = float(out["loss"])
        if not math.isfinite(loss):
          last = checkpointer.latest_step() if checkpointer else None
          kept = (f"last good checkpoint: step {last} in {args.checkpoint_dir}" if last is not None
                  else "no checkpoint was written")
          progress.stop()
          errors.print(f"error: loss is {loss} at step {step + 1}; stopping ({kept})",
                       markup=False)
          metrics.write({"step": step + 1, "loss": loss, "error": "non-finite loss"})
          return 1
        params, opt_state = new_params, new_opt_state
        elapsed = time.perf_counter() - t0
        if step > start:  # the first step compiles
          timed_steps, timed_seconds = timed_steps + 1, timed_seconds + elapsed
          rate = tokens_per_step * timed_steps / timed_seconds
        done = step + 1
        record = {"step": done, "loss": loss, "grad_norm": float(out["grad_norm"]),
                  "tokens_per_s": round(rate, 1), "step_time_s": round(elapsed, 4)}
        if (args.eval_every and done % args.eval_every == 0) or done == args.steps:
          last_eval = record["eval_loss"] = evaluate(params)
          progress.console.print(f"step {done}: train loss {loss:.4f}, eval loss "
                                 f"{last_eval:.4f}")
        metrics.write(record)
        progress.update(task, completed=done, loss=f"{loss:.4f}", rate=f"{rate:,.0f}")
        if args.checkpoint_every and done % args.checkpoint_every == 0 and done != args.steps:
          save(done)
  except KeyboardInterrupt:
    progress.stop()
    # The step in flight has consumed (donated) the old params; only a state that
    # is still whole is saved.
    whole = not any(x.is_deleted() for x in jax.tree.leaves((params, opt_state)))
    if checkpointer is not None and jax.process_count() == 1 and done > start and whole:
      save(done)  # params and optimizer state of the last completed step
      errors.print(f"interrupted after step {done}; checkpoint saved in {args.checkpoint_dir}",
                   markup=False)
    else:
      errors.print(f"interrupted after step {done}", markup=False)
    return 130
  finally:
    metrics.close()
  save(args.steps)
  if checkpointer is not None:
    checkpointer.close()

  if args.sample_length:
    sample = generate(trainer, params, args.sample_prompt.encode(), length=args.sample_length,
                      seq_len=args.seq_len, seed=args.seed)
    console.rule("sample")
    console.print(args.sample_prompt + sample.decode("utf-8", errors="replace"), markup=False)
    console.rule()
  console.print(f"done: {args.steps} steps, final train loss {loss:.4f}, eval loss "
                f"{last_eval:.4f} (unigram entropy {corpus.unigram_entropy():.3f}), "
                f"{rate:,.0f} tokens/s on mesh {args.mesh}")
  return 0
