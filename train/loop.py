"""The training loop behind ``train/run.py``: set-up, steps, eval, checkpoints, sample."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import flax_tp
from flax_tp.checkpoint import Checkpointer, CheckpointError, CheckpointSaveError
from flax_tp.data_parallel import unshard_over_data
from flax_tp.param_info import ParamInfo
from models.config import TransformerConfig
from models.execution import Execution
from models.hf import load_hf
from models.transformer import Transformer
from train.data import TokenCorpus
from train.errors import RunError, UsageError
from train.hf_folder import hf_model_and_tokenizer
from train.metrics import MetricsWriter, is_main_process
from train.resume import claim_checkpoint_dir, lock_checkpoint_dir, resume_point, run_identity
from train.sample import sample_tokens
from train.signals import Interrupts
from train.step import LossOptions, Trainer, make_optimizer

EVAL_BATCHES = 4


def global_batch(corpus: TokenCorpus, split: str, seed: int, step: int, batch_size: int,
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
    info = ParamInfo.of(var)
    layout = info.layout
    shard_bytes = value.addressable_shards[0].data.nbytes
    total += value.size if layout is None else value.size // layout.padded_total * layout.size
    if info.is_split:  # split over "model" and/or "data" (FSDP)
      sharded += shard_bytes
    else:
      replicated += shard_bytes
  return dict(params=total, sharded_bytes_per_device=sharded,
              replicated_bytes_per_device=replicated)


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


def run(args: argparse.Namespace) -> int:
  """The whole run, holding ``--checkpoint-dir`` throughout (``lock_checkpoint_dir``)."""
  lock = lock_checkpoint_dir(args)
  try:
    return _run(args)
  finally:
    if lock is not None:
      lock.release()


def _run(args: argparse.Namespace) -> int:
  """Set-up, then the steps, then the sample and the summary (``_Run``)."""
  training = _Run(args)
  training.report_start()
  status = training.steps()
  if status is not None:
    return status
  training.finish()
  return 0


class _Run:
  """One training run: what set-up built (the mesh, the model's trainer and state, the
  data, the checkpoint folder) and what the steps leave (the last loss, eval loss, rate)."""

  def __init__(self, args: argparse.Namespace):
    self.args = args
    self.console = Console(quiet=not is_main_process(), highlight=False, soft_wrap=True)
    self.errors = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
      self.mesh = mesh = flax_tp.make_mesh(args.mesh)
    except ValueError as err:
      raise UsageError(str(err)) from None
    self.data_size = data_size = mesh.shape[flax_tp.DATA_AXIS]
    if args.batch_size % data_size:
      raise UsageError(f"--batch-size {args.batch_size} is not divisible by the {data_size}-way "
                       f"data axis of --mesh {args.mesh}")
    overrides = dict(max_seq_len=args.seq_len, dropout=args.dropout, dtype=args.dtype)
    self.execution = Execution(sequence_parallel=args.sequence_parallel, remat=args.remat,
                               scan_layers=args.scan_layers, fsdp=args.fsdp)
    tokenizer = None
    if args.init_from:
      self.cfg, tokenizer = hf_model_and_tokenizer(args.init_from, overrides)
    else:
      self.cfg = TransformerConfig.preset(args.preset or "small", **overrides)
    self.checkpointer = None
    if args.checkpoint_dir:
      self.checkpointer = Checkpointer(args.checkpoint_dir,
                                       max_to_keep=args.keep_checkpoints or None,
                                       asynchronous=True)
      claim_checkpoint_dir(args, self.checkpointer, self.console)
    try:
      self.corpus = TokenCorpus.load(args.data, seq_len=args.seq_len, tokenizer=tokenizer,
                                     show_progress=is_main_process())
    except ValueError as err:
      raise UsageError(str(err)) from None
    self.identity = run_identity(args, self.cfg, self.corpus)
    self.start, self.notes = 0, []
    if args.resume:
      try:
        self.start, self.notes = resume_point(args, self.checkpointer, self.identity,
                                              self.corpus)
      except CheckpointError as err:
        raise UsageError(str(err)) from None
    self._build_state(overrides)
    self.last_eval, self.loss, self.rate = None, float("nan"), 0.0

  def _build_state(self, overrides: dict[str, Any]) -> None:
    """The model's trainer, and its params and optimizer state (restored on resume)."""
    args = self.args
    if args.init_from and self.start == 0:
      try:
        model = load_hf(args.init_from, self.mesh, seed=args.seed, execution=self.execution,
                        **overrides)
      except (ValueError, OSError) as err:  # missing or misshapen tensors: bad input
        raise UsageError(f"--init-from {args.init_from!r}: {err}") from None
    else:  # a fresh model, or one a checkpoint then overwrites
      model = Transformer(self.cfg, mesh=self.mesh, rngs=nnx.Rngs(args.seed),
                          execution=self.execution)
    tx = make_optimizer(lr=args.lr, steps=args.steps, warmup_steps=args.warmup_steps,
                        weight_decay=args.weight_decay, grad_clip=args.grad_clip)
    self.trainer = Trainer(model, tx, LossOptions(args.label_smoothing, args.z_loss))
    del model
    self.params = self.trainer.params
    self.opt_state = self.trainer.init_opt_state(self.params)
    if self.start:
      try:
        restored, _ = self.checkpointer.restore(
            {"params": self.params, "opt_state": self.opt_state}, self.start)
      except CheckpointError as err:
        raise UsageError(str(err)) from None
      self.params, self.opt_state = restored["params"], restored["opt_state"]

  def report_start(self) -> None:
    """The start-up lines: devices and processes, the model, the data, notes."""
    args, console, mesh, data_size = self.args, self.console, self.mesh, self.data_size
    summary = param_summary(self.params)
    devices = jax.devices()
    console.print(f"[bold]flax_tp[/bold] jax {jax.__version__} | {len(devices)} "
                  f"{devices[0].platform} device(s), {jax.process_count()} process(es) | mesh "
                  f"{args.mesh} (data={data_size}, model={mesh.shape[flax_tp.MODEL_AXIS]})")
    if jax.process_count() > 1:
      local_rows = all(len({d.process_index for d in row}) == 1 for row in mesh.devices)
      console.print(f"processes: {jax.process_count()} x {jax.local_device_count()} devices; "
                    f"the model axis {'stays inside' if local_rows else 'spans'} a process")
    origin = f"from {args.init_from!r}" if args.init_from else f"preset {args.preset or 'small'}"
    options = self.execution.describe()
    console.print(f"model: {origin}, {summary['params']:,} params | per device: "
                  f"sharded {_mib(summary['sharded_bytes_per_device'])}, replicated "
                  f"{_mib(summary['replicated_bytes_per_device'])}"
                  + (f" | {', '.join(options)}" if options else ""))
    console.print(f"data: {self.corpus.describe()} | unigram entropy "
                  f"{self.corpus.unigram_entropy():.3f} nats | batch {args.batch_size} x "
                  f"{args.seq_len} tokens")
    notes = self.notes
    if self.execution.fsdp and data_size > 1:  # never silently less sharded than asked
      whole = [".".join(map(str, path)) for path, var in nnx.to_flat_state(self.params)
               if not ParamInfo.of(var).over_data]
      if whole:
        notes.append(f"note: --fsdp leaves {len(whole)} param(s) replicated over the "
                     f"{data_size}-way data axis, which divides none of their dimensions: "
                     f"{', '.join(whole[:4])}{' ...' if len(whole) > 4 else ''}")
    for note in notes:
      console.print(note, markup=False)
    if self.start:
      console.print(f"resumed from step {self.start} in {args.checkpoint_dir!r}")

  def evaluate(self) -> float:
    args = self.args
    losses = [self.trainer.eval_step(self.params, global_batch(
        self.corpus, "eval", args.seed, i, args.batch_size, args.seq_len,
        self.trainer.batch_sharding)) for i in range(EVAL_BATCHES)]
    return float(np.mean([float(x) for x in losses]))

  def save(self, step: int) -> None:
    if self.checkpointer is not None:
      try:
        self.checkpointer.save(step, {"params": self.params, "opt_state": self.opt_state},
                               {"run": self.identity, "step": step, "steps": self.args.steps,
                                "data_fingerprint": self.corpus.fingerprint})
      except CheckpointSaveError as err:
        raise RunError(str(err)) from err

  def finish_saves(self) -> None:
    if self.checkpointer is not None:
      try:
        self.checkpointer.wait()
      except CheckpointSaveError as err:
        raise RunError(str(err)) from err

  def steps(self) -> int | None:
    """The steps from ``start``; an exit status when the run ends early (a signal, a
    non-finite loss), None when every step is done and saved."""
    metrics = MetricsWriter(self.args.metrics_file,
                            resume_from=self.start if self.args.resume else None)
    with Interrupts() as interrupts:
      try:
        return self._steps(metrics, interrupts)
      finally:
        metrics.close()
        if self.checkpointer is not None:
          # When an error ends the run, its save in flight still finishes (or fails)
          # before the folder's lock is let go; the error itself is already on its way.
          with contextlib.suppress(Exception):
            self.checkpointer.wait()

  def _steps(self, metrics: MetricsWriter, interrupts: Interrupts) -> int | None:
    args, start, trainer = self.args, self.start, self.trainer
    dropout_key = jax.random.key(args.seed + 1) if args.dropout > 0 else None
    tokens_per_step = args.batch_size * args.seq_len
    timed_steps, timed_seconds = 0, 0.0
    done = start
    if start == 0:
      self.last_eval = self.evaluate()
      self.console.print(f"step 0: eval loss {self.last_eval:.4f}")
      metrics.write({"step": 0, "eval_loss": self.last_eval})
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"),
                        TextColumn("{task.fields[rate]} tok/s"), TimeRemainingColumn(),
                        console=self.console, transient=False)
    task = progress.add_task("train", total=args.steps, completed=start, loss="-", rate="-")
    with progress:
      for step in range(start, args.steps):
        if interrupts.requested():
          break
        t0 = time.perf_counter()
        tokens = global_batch(self.corpus, "train", args.seed, step, args.batch_size,
                              args.seq_len, trainer.batch_sharding)
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, step)
        new_params, new_opt_state, out = trainer.train_step(self.params, self.opt_state,
                                                            tokens, key)
        self.loss = loss = float(out["loss"])
        if not math.isfinite(loss):
          return self._stop_at_non_finite(metrics, step, progress)
        self.params, self.opt_state = new_params, new_opt_state
        elapsed = time.perf_counter() - t0
        if step > start:  # the first step compiles
          timed_steps, timed_seconds = timed_steps + 1, timed_seconds + elapsed
          self.rate = tokens_per_step * timed_steps / timed_seconds
        done = step + 1
        record = {"step": done, "loss": loss, "grad_norm": float(out["grad_norm"]),
                  "tokens_per_s": round(self.rate, 1), "step_time_s": round(elapsed, 4)}
        if (args.eval_every and done % args.eval_every == 0) or done == args.steps:
          self.last_eval = record["eval_loss"] = self.evaluate()
          progress.console.print(f"step {done}: train loss {loss:.4f}, eval loss "
                                 f"{self.last_eval:.4f}")
        metrics.write(record)
        progress.update(task, completed=done, loss=f"{loss:.4f}", rate=f"{self.rate:,.0f}")
        if args.checkpoint_every and done % args.checkpoint_every == 0 and done != args.steps:
          self.save(done)
    if done < args.steps:  # stopped by a signal
      return self._stop_at_signal(done, interrupts)
    self.save(args.steps)
    self.finish_saves()
    return None

  def _stop_at_non_finite(self, metrics: MetricsWriter, step: int, progress: Progress) -> int:
    """A NaN/inf loss: the run stops, keeping the last good checkpoint (exit status 1)."""
    self.finish_saves()
    last = self.checkpointer.latest_step() if self.checkpointer else None
    kept = (f"last good checkpoint: step {last} in {self.args.checkpoint_dir!r}"
            if last is not None else "no checkpoint was written")
    progress.stop()
    self.errors.print(f"error: loss is {self.loss} at step {step + 1}; stopping ({kept})",
                      markup=False)
    metrics.write({"step": step + 1, "loss": self.loss, "error": "non-finite loss"})
    return 1

  def _stop_at_signal(self, done: int, interrupts: Interrupts) -> int:
    """Stopped by a signal after step ``done``: that step saved, one line saying so."""
    start, checkpointer = self.start, self.checkpointer
    name = signal.Signals(interrupts.received or signal.SIGINT).name
    if checkpointer is None:
      saved = "no checkpoint written (no --checkpoint-dir)"
    elif done == start:
      saved = f"no new step to save; the latest checkpoint is step {start}" if start else \
          "no step completed, nothing to save"
    else:
      if checkpointer.latest_step() != done:
        self.save(done)
      self.finish_saves()
      saved = f"checkpoint of step {done} saved in {self.args.checkpoint_dir!r}; --resume " \
              "continues from it"
    self.errors.print(f"{name}: stopped after step {done}; {saved}", markup=False)
    return interrupts.exit_status

  def finish(self) -> None:
    """The sample (``--sample-length``) and the closing line."""
    args, console, corpus = self.args, self.console, self.corpus
    if args.sample_length:
      tokenizer = corpus.tokenizer
      prompt = [int(t) for t in tokenizer.encode(args.sample_prompt.encode())]
      model = unshard_over_data(nnx.merge(self.trainer.graphdef, self.params))  # standalone
      sample = sample_tokens(model, prompt, length=args.sample_length,
                             window=min(args.seq_len, self.cfg.max_seq_len), seed=args.seed)
      console.rule("sample")
      console.print(args.sample_prompt + tokenizer.decode(sample), markup=False)
      console.rule()
    console.print(f"done: {args.steps} steps, final train loss {self.loss:.4f}, eval loss "
                  f"{self.last_eval:.4f} (unigram entropy {corpus.unigram_entropy():.3f}), "
                  f"{self.rate:,.0f} tokens/s on mesh {args.mesh}")
