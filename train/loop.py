"""The training loop behind ``train/run.py``: set-up, steps, eval, checkpoints, sample."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import flax_tp
from flax_tp.checkpoint import Checkpointer, CheckpointError, CheckpointSaveError, describe_not_ours
from flax_tp.data_parallel import unshard_over_data
from flax_tp.param_info import ParamInfo
from flax_tp.run_lock import LOCK_NAME, FolderInUse, FolderLock
from models.config import TransformerConfig
from models.execution import Execution
from models.hf import load_hf
from models.transformer import Transformer
from train.data import TokenCorpus
from train.errors import RunError, UsageError, say
from train.hf_folder import hf_model_and_tokenizer
from train.sample import sample_tokens
from train.step import LossOptions, Trainer, make_optimizer
from train.tempfiles import remove_registered, remove_stale, temp_beside

EVAL_BATCHES = 4


def is_main_process() -> bool:
  return jax.process_index() == 0


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


class MetricsWriter:
  """One JSON line per record, appended (process 0 only).

  On resume from step ``resume_from``, records past it (steps the interrupted
  run did after its last checkpoint, which this run does again) are dropped
  first, so the file holds each step once.
  """

  def __init__(self, path: str | None, resume_from: int | None = None):
    self.file = None
    if not (path and is_main_process()):
      return
    if resume_from is not None and os.path.exists(path):
      _drop_records_after(Path(path), resume_from)
    self.file = open(path, "a", encoding="utf-8")

  def write(self, record: dict[str, Any]) -> None:
    if self.file:
      self.file.write(json.dumps(record) + "\n")
      self.file.flush()

  def close(self) -> None:
    if self.file:
      self.file.close()


def _drop_records_after(path: Path, step: int) -> None:
  kept = []
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      record = json.loads(line)
    except ValueError:
      continue  # a line cut short by a kill
    if not (isinstance(record, dict) and isinstance(record.get("step"), int)
            and record["step"] > step):
      kept.append(line)
  # Beside it under a name of flax_tp's own (a user's m.jsonl.tmp stays theirs), removed
  # on every way out, a full disk included.
  remove_stale(path.parent)
  with temp_beside(path) as tmp:
    with open(tmp, "x", encoding="utf-8") as f:
      f.write("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class Interrupts:
  """SIGINT and SIGTERM ask the loop to stop after the step in flight; a second aborts.

  The handler only records the signal: the step runs to completion, so its
  (donated) inputs are replaced by whole outputs before anything is saved.
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.received: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> Interrupts:
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _handle(self, signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    if self.received is not None:
      say(f"train/run.py: second signal ({name}): aborting without saving")
      remove_registered()  # os._exit runs no finally
      os._exit(128 + signum)
    self.received = signum
    # On a terminal a new line first ends the progress bar's line; a log gets no blank line.
    say(("\n" if sys.stdout.isatty() else "") + f"{name} received: stopping after the current "
        "step (send it again to abort at once)")

  def requested(self) -> bool:
    """Whether any process of the run was signalled (all processes agree, then stop
    at the same step)."""
    if jax.process_count() == 1:
      return self.received is not None
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.int32(self.received is not None))
    return bool(np.any(flags))

  @property
  def exit_status(self) -> int:
    return 128 + (self.received or signal.SIGINT)


def run_identity(args: argparse.Namespace, cfg: TransformerConfig,
                 corpus: TokenCorpus) -> dict[str, Any]:
  """What makes a run this run: a checkpoint of another is never resumed silently."""
  return dict(config=cfg.identity(), seed=args.seed, batch_size=args.batch_size,
              seq_len=args.seq_len, data=corpus.source, tokenizer=corpus.tokenizer.name,
              init_from=str(Path(args.init_from).resolve()) if args.init_from else None,
              optimizer=dict(lr=args.lr, warmup_steps=args.warmup_steps,
                             weight_decay=args.weight_decay, grad_clip=args.grad_clip),
              loss=dict(label_smoothing=args.label_smoothing, z_loss=args.z_loss))


def _differences(saved: dict[str, Any], ours: dict[str, Any], prefix: str = "") -> list[str]:
  out = []
  for key in sorted(set(saved) | set(ours)):
    a, b = saved.get(key), ours.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _differences(a, b, f"{prefix}{key}.")
    elif a != b:
      out.append(f"{prefix}{key} {a!r} there, {b!r} here")
  return out


def claim_checkpoint_dir(args: argparse.Namespace, checkpointer: Checkpointer,
                         console: Console) -> None:
  """A fresh run never mixes with, or silently deletes, another run's checkpoints; no run
  starts where a later save or --overwrite would have to delete what flax_tp did not write."""
  foreign = checkpointer.not_ours()
  if foreign:
    raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r}: "
                     f"{describe_not_ours(foreign[0])}, where "
                     "this run saves its checkpoints; flax_tp never deletes what it did not "
                     "write: move it elsewhere, or choose another --checkpoint-dir")
  steps = checkpointer.steps()
  if args.resume or not steps:
    return
  listed = ", ".join(map(str, steps))
  if not args.overwrite:
    raise UsageError(
        f"--checkpoint-dir {args.checkpoint_dir!r} holds checkpoints of an earlier run (steps "
        f"{listed}); pass --resume to continue that run, choose another --checkpoint-dir, or "
        "pass --overwrite to delete them")
  if is_main_process():
    checkpointer.delete_all()
  console.print(f"--overwrite: deleted the earlier run's checkpoints (steps {listed}) in "
                f"{args.checkpoint_dir!r}")


def resume_point(args: argparse.Namespace, checkpointer: Checkpointer,
                 identity: dict[str, Any], corpus: TokenCorpus) -> tuple[int, list[str]]:
  """The step to resume from, after checking that the checkpoint is this run's."""
  if checkpointer.latest_step() is None:
    raise UsageError(f"--resume: no checkpoint in {args.checkpoint_dir!r}")
  meta = checkpointer.read_meta()
  notes = []
  saved = meta.get("run")
  if saved is None:  # written by flax_tp 0.1.0, which recorded less of the run
    saved = {k: meta[k] for k in ("config", "seed", "batch_size", "seq_len") if k in meta}
    identity = {k: identity[k] for k in saved}
    notes.append("note: a checkpoint of flax_tp 0.1.0; only the model, seed, batch size and "
                 "sequence length could be checked against this run")
  if isinstance(saved.get("config"), dict):  # fields added since: their defaults
    defaults = TransformerConfig().identity()
    saved = {**saved, "config": {k: saved["config"].get(k, defaults[k]) for k in defaults}}
  differences = _differences(saved, identity)
  if differences:
    raise UsageError(
        f"--resume: the checkpoints in {args.checkpoint_dir!r} belong to another run ("
        f"{'; '.join(differences[:4])}{'; ...' if len(differences) > 4 else ''}); pass the "
        "flags it was started with, or use another --checkpoint-dir")
  if int(meta["step"]) >= args.steps:  # decided before reading any array
    raise UsageError(f"--resume: the checkpoint in {args.checkpoint_dir!r} is at step "
                     f"{meta['step']}, already at --steps {args.steps}; raise --steps to "
                     "train further")
  if "run" in meta and meta.get("data_fingerprint") != corpus.fingerprint:
    notes.append("note: the data files changed since the checkpoint was written; batches "
                 "after it will differ from the interrupted run's")
  return int(meta["step"]), notes


def _from_process_0(text: str) -> str:
  """``text`` as process 0 has it, on every process (one line, at most 1 KiB)."""
  if jax.process_count() == 1:
    return text
  from jax.experimental import multihost_utils
  data = np.zeros(1024, np.uint8)
  raw = text.encode("utf-8")[:1024]
  data[:len(raw)] = np.frombuffer(raw, np.uint8)
  data = np.asarray(multihost_utils.broadcast_one_to_all(data))
  return bytes(data).rstrip(b"\0").decode("utf-8", "replace")


def lock_checkpoint_dir(args: argparse.Namespace) -> FolderLock | None:
  """This run's hold on ``--checkpoint-dir`` for as long as it runs (``FolderLock``:
  released when the process ends, however it ends). Process 0 takes it and every
  process learns what it found, so a second run (another job, another host sharing
  the folder) stops whole with one line naming the holder, before touching anything."""
  if not args.checkpoint_dir:
    return None
  lock = FolderLock(args.checkpoint_dir)
  problem = ""
  if is_main_process():
    try:
      lock.acquire()
    except FolderInUse as err:
      problem = (f"is in use by another run: {err.holder}; wait for it to end, or choose "
                 "another --checkpoint-dir")
    except OSError as err:
      problem = f"cannot be locked ({LOCK_NAME}): {err.strerror or err}"
  problem = _from_process_0(problem)
  if problem:
    raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r} {problem}")
  return lock


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
