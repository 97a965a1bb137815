"""The checkpoint folder's ownership: a run holds its folder while it runs, never mixes with
or silently deletes another run's checkpoints, and resumes only its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from rich.console import Console

from flax_tp.checkpoint import Checkpointer, describe_not_ours
from flax_tp.run_lock import LOCK_NAME, FolderInUse, FolderLock
from models.config import TransformerConfig
from train.data import TokenCorpus
from train.errors import UsageError
from train.job import Job
from train.metrics import is_main_process


def run_identity(job: Job, cfg: TransformerConfig,
                 corpus: TokenCorpus) -> dict[str, Any]:
  """What makes a run this run: a checkpoint of another is never resumed silently. With
  LoRA the adapters' settings too (left out without, so earlier runs still resume), and
  the base they adapt: ``init_from`` and the sha256 of its weights (or the preset's config
  and seed)."""
  identity = dict(
      config=cfg.identity(), seed=job.schedule.seed, batch_size=job.schedule.batch_size,
      seq_len=job.model.seq_len, data=corpus.source, tokenizer=corpus.tokenizer.name,
      init_from=str(Path(job.model.init_from).resolve()) if job.model.init_from else None,
      # lr, warmup_steps, weight_decay, grad_clip; label_smoothing, z_loss
      optimizer=dataclasses.asdict(job.optimizer), loss=job.loss.identity())
  if job.lora.rank:
    identity["lora"] = job.lora.identity()
    if job.model.init_from:  # a LoRA checkpoint holds no base: the base must be the same
      from models.hf import weights_digest
      identity["lora_base_sha256"] = weights_digest(job.model.init_from)
  return identity


def _differences(saved: dict[str, Any], ours: dict[str, Any], prefix: str = "") -> list[str]:
  out = []
  for key in sorted(set(saved) | set(ours)):
    a, b = saved.get(key), ours.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _differences(a, b, f"{prefix}{key}.")
    elif a != b:
      out.append(f"{prefix}{key} {a!r} there, {b!r} here")
  return out


def claim_checkpoint_dir(job: Job, checkpointer: Checkpointer,
                         console: Console) -> None:
  """A fresh run never mixes with, or silently deletes, another run's checkpoints; no run
  starts where a later save or --overwrite would have to delete what flax_tp did not write."""
  foreign = checkpointer.not_ours()
  if foreign:
    raise UsageError(f"--checkpoint-dir {job.checkpoint.dir!r}: "
                     f"{describe_not_ours(foreign[0])}, where "
                     "this run saves its checkpoints; flax_tp never deletes what it did not "
                     "write: move it elsewhere, or choose another --checkpoint-dir")
  steps = checkpointer.steps()
  if job.checkpoint.resume or not steps:
    return
  listed = ", ".join(map(str, steps))
  if not job.checkpoint.overwrite:
    raise UsageError(
        f"--checkpoint-dir {job.checkpoint.dir!r} holds checkpoints of an earlier run (steps "
        f"{listed}); pass --resume to continue that run, choose another --checkpoint-dir, or "
        "pass --overwrite to delete them")
  if is_main_process():
    checkpointer.delete_all()
  console.print(f"--overwrite: deleted the earlier run's checkpoints (steps {listed}) in "
                f"{job.checkpoint.dir!r}")


def resume_point(job: Job, checkpointer: Checkpointer, identity: dict[str, Any],
                 corpus: TokenCorpus, same_layers: Any = None) -> tuple[int, list[str]]:
  """The step to resume from, after checking that the checkpoint is this run's.

  ``same_layers(saved_targets, our_targets) -> bool``: whether two ``--lora-targets``
  strings adapt the same layers (``'a,b'`` and ``'b,a'`` do); without it they must be
  equal strings."""
  if checkpointer.latest_step() is None:
    raise UsageError(f"--resume: no checkpoint in {job.checkpoint.dir!r}")
  meta = checkpointer.read_meta()
  notes = []
  saved = meta.get("run")
  if saved is None:  # written by flax_tp 0.1.0, which recorded less of the run
    saved = {k: meta[k] for k in ("config", "seed", "batch_size", "seq_len") if k in meta}
    identity = {k: identity[k] for k in saved}
    notes.append("note: a checkpoint of flax_tp 0.1.0; only the model, seed, batch size and "
                 "sequence length could be checked against this run")
  if isinstance(saved.get("config"), dict):  # fields added since: their defaults (those
    # of the families are left out of an identity at their defaults, here and there)
    saved = {**saved, "config": {**TransformerConfig().identity(), **saved["config"]}}
  saved_lora, our_lora = saved.get("lora"), identity.get("lora")
  if (same_layers is not None and isinstance(saved_lora, dict) and isinstance(our_lora, dict)
      and saved_lora.get("targets") != our_lora.get("targets")
      and isinstance(saved_lora.get("targets"), str)
      and same_layers(saved_lora["targets"], our_lora["targets"])):
    saved = {**saved, "lora": {**saved_lora, "targets": our_lora["targets"]}}
  differences = _differences(saved, identity)
  if differences:
    raise UsageError(
        f"--resume: the checkpoints in {job.checkpoint.dir!r} belong to another run ("
        f"{'; '.join(differences[:4])}{'; ...' if len(differences) > 4 else ''}); pass the "
        "flags it was started with, or use another --checkpoint-dir")
  if int(meta["step"]) >= job.schedule.steps:  # decided before reading any array
    raise UsageError(f"--resume: the checkpoint in {job.checkpoint.dir!r} is at step "
                     f"{meta['step']}, already at --steps {job.schedule.steps}; raise --steps to "
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


def lock_checkpoint_dir(job: Job) -> FolderLock | None:
  """This run's hold on ``--checkpoint-dir`` for as long as it runs (``FolderLock``:
  released when the process ends, however it ends). Process 0 takes it and every
  process learns what it found, so a second run (another job, another host sharing
  the folder) stops whole with one line naming the holder, before touching anything."""
  if not job.checkpoint.dir:
    return None
  lock = FolderLock(job.checkpoint.dir)
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
    raise UsageError(f"--checkpoint-dir {job.checkpoint.dir!r} {problem}")
  return lock
