"""The training loop behind ``train/run.py``: set-up, steps, eval, checkpoints, sample."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from flax_tp.checkpoint import CheckpointSaveError
from flax_tp.data_parallel import unshard_over_data
from models.execution import unpipeline
from train.data import TokenCorpus
from train.errors import RunError
from train.job import Job
from train.metrics import MetricsWriter
from train.resume import lock_checkpoint_dir
from train.sample import sample_tokens
from train.setup import SetUp
from train.signals import Interrupts

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


def run(args: argparse.Namespace) -> int:
  """The whole run of ``train/run.py``'s (checked) flags, holding ``--checkpoint-dir``
  throughout (``lock_checkpoint_dir``)."""
  job = Job.from_args(args)
  lock = lock_checkpoint_dir(job)
  try:
    return _run(job)
  finally:
    if lock is not None:
      lock.release()


def _run(job: Job) -> int:
  """Set-up, then the steps, then the sample and the summary (``_Run``)."""
  training = _Run(job)
  training.report_start()
  status = training.steps()
  if status is not None:
    return status
  training.finish()
  return 0


class _Run(SetUp):
  """One training run: what set-up built (``train.setup.SetUp``), then its steps and what
  they leave (the last loss, eval loss, rate)."""

  def __init__(self, job: Job):
    super().__init__(job)
    self.last_eval, self.loss, self.rate = None, float("nan"), 0.0
    self._held = None  # the steps' state (train.step.HeldState) once they start

  def _sync(self) -> None:
    """``params`` and ``opt_state`` as the last step left them (the steps hold them as
    lists of arrays, ``HeldState``; these are rebuilt once per step at most)."""
    if self._held is not None:
      self.params, self.opt_state = self._held.state()

  def evaluate(self) -> float:
    job = self.job
    self._sync()
    losses = [self.trainer.eval_step(self.params, global_batch(
        self.corpus, "eval", job.schedule.seed, i, job.schedule.batch_size, job.model.seq_len,
        self.trainer.batch_sharding)) for i in range(EVAL_BATCHES)]
    return float(np.mean([float(x) for x in losses]))

  def save(self, step: int) -> None:
    self._sync()
    if self.checkpointer is not None:
      try:
        # With LoRA the adapters alone (the base is --init-from's, or the preset's at the
        # run's seed, and is read from there on resume).
        self.checkpointer.save(step, {"params": self.trainer.saved(self.params),
                                      "opt_state": self.opt_state},
                               {"run": self.identity, "step": step,
                                "steps": self.job.schedule.steps,
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
    metrics = MetricsWriter(self.job.metrics_file,
                            resume_from=self.start if self.job.checkpoint.resume else None)
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
    job, start, trainer = self.job, self.start, self.trainer
    schedule, steps = job.schedule, job.schedule.steps
    dropout_key = jax.random.key(job.schedule.seed + 1) if job.model.dropout > 0 else None
    tokens_per_step = job.schedule.batch_size * job.model.seq_len
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
    task = progress.add_task("train", total=steps, completed=start, loss="-", rate="-")
    self._held = held = trainer.held(self.params, self.opt_state)
    with progress:
      for step in range(start, steps):
        if interrupts.requested():
          break
        t0 = time.perf_counter()
        tokens = global_batch(self.corpus, "train", schedule.seed, step, schedule.batch_size,
                              job.model.seq_len, trainer.batch_sharding)
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, step)
        # (A step that is not finite comes back unapplied: the last good state is held.)
        out = held.step(tokens, key)
        self.loss = loss = float(out["loss"])
        grad_norm = float(out["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
          what = "loss" if not math.isfinite(loss) else "gradient norm"
          return self._stop_at_non_finite(metrics, progress, step + 1, what,
                                          loss if what == "loss" else grad_norm,
                                          {"loss": loss, "grad_norm": grad_norm})
        elapsed = time.perf_counter() - t0
        if step > start:  # the first step compiles
          timed_steps, timed_seconds = timed_steps + 1, timed_seconds + elapsed
          self.rate = tokens_per_step * timed_steps / timed_seconds
        done = step + 1
        record = {"step": done, "loss": loss, "grad_norm": grad_norm,
                  "tokens_per_s": round(self.rate, 1), "step_time_s": round(elapsed, 4)}
        if "expert_load" in out:  # mixture of experts: the router's figures
          record.update(router_aux_loss=float(out["router_aux_loss"]),
                        router_z_loss=float(out["router_z_loss"]),
                        expert_dropped=float(out["expert_dropped"]),
                        expert_load=[round(float(v), 5) for v in out["expert_load"]])
        if "selection_bias_spread" in out:  # loss-free balancing: how far the biases moved
          record["selection_bias_spread"] = float(out["selection_bias_spread"])
        if (schedule.eval_every and done % schedule.eval_every == 0) or done == steps:
          self.last_eval = record["eval_loss"] = self.evaluate()
          if not math.isfinite(self.last_eval):  # these params are not saved
            return self._stop_at_non_finite(metrics, progress, done, "eval loss",
                                            self.last_eval, {"eval_loss": self.last_eval})
          progress.console.print(f"step {done}: train loss {loss:.4f}, eval loss "
                                 f"{self.last_eval:.4f}")
        metrics.write(record)
        progress.update(task, completed=done, loss=f"{loss:.4f}", rate=f"{self.rate:,.0f}")
        if job.checkpoint.every and done % job.checkpoint.every == 0 and done != steps:
          self.save(done)
    if done < steps:  # stopped by a signal
      return self._stop_at_signal(done, interrupts)
    self.save(steps)
    self.finish_saves()
    return None

  def _stop_at_non_finite(self, metrics: MetricsWriter, progress: Progress, step: int,
                          what: str, value: float, values: dict[str, float]) -> int:
    """A NaN/inf ``what`` (loss, gradient norm, eval loss) ``value``; ``values``: its
    step's figures for the metrics file)
    at ``step``: the run stops (exit status 1) with nothing of that step saved; the last
    checkpoint stays the last good one."""
    self.finish_saves()
    last = self.checkpointer.latest_step() if self.checkpointer else None
    kept = (f"last good checkpoint: step {last} in {self.job.checkpoint.dir!r}"
            if last is not None else "no checkpoint was written")
    progress.stop()
    self.errors.print(f"error: {what} is {value} at step {step}; stopping, step {step} not "
                      f"saved ({kept})", markup=False)
    metrics.write({"step": step, **values, "error": f"non-finite {what}"})
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
      saved = f"checkpoint of step {done} saved in {self.job.checkpoint.dir!r}; --resume " \
              "continues from it"
    self.errors.print(f"{name}: stopped after step {done}; {saved}", markup=False)
    return interrupts.exit_status

  def finish(self) -> None:
    """The sample (``--sample-length``) and the closing line."""
    job, console, corpus = self.job, self.console, self.corpus
    self._sync()
    if job.sample.length:
      tokenizer = corpus.tokenizer
      prompt = [int(t) for t in tokenizer.encode(job.sample.prompt.encode())]
      # Standalone, and layer by layer for the KV-cached decoder.
      model = unpipeline(unshard_over_data(nnx.merge(self.trainer.graphdef, self.params)))
      sample = sample_tokens(model, prompt, length=job.sample.length,
                             window=min(job.model.seq_len, self.cfg.max_seq_len),
                             seed=job.schedule.seed)
      console.rule("sample")
      console.print(job.sample.prompt + tokenizer.decode(sample), markup=False)
      console.rule()
    console.print(f"done: {job.schedule.steps} steps, final train loss {self.loss:.4f}, eval "
                  f"loss {self.last_eval:.4f} (unigram entropy {corpus.unigram_entropy():.3f}), "
                  f"{self.rate:,.0f} tokens/s on mesh {job.mesh}")
