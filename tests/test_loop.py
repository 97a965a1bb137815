"""The training loop (train/loop.py) as a run lives it: a fresh run never touches
another's checkpoints, signals save and resume exactly, a failing save is one line,
and checkpoints of the previous version still resume."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from flax import nnx
from helpers import TINY_RUN_FLAGS, subprocess_env, write_small_corpus

import flax_tp
from flax_tp.checkpoint import Checkpointer
from models.config import TransformerConfig
from models.transformer import Transformer
from train.run import main
from train.step import Trainer, make_optimizer

ROOT = Path(__file__).resolve().parent.parent


FLAGS = TINY_RUN_FLAGS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_small_corpus(tmp_path_factory.mktemp("data") / "corpus.py")


def steps_in(ck):
  return sorted(int(p.name) for p in Path(ck).iterdir() if p.name.isdigit())


def _trainer(spec, seed, cfg=TransformerConfig.tiny()):
  return Trainer(Transformer(cfg, mesh=flax_tp.make_mesh(spec), rngs=nnx.Rngs(seed)),
                 make_optimizer(lr=1e-2, steps=10))


@pytest.mark.slow
def test_a_fresh_run_never_touches_another_runs_checkpoints(tmp_path, corpus, capsys):
  ck = tmp_path / "ck"
  base = [*FLAGS, "--mesh", "1x2", "--data", corpus, "--checkpoint-dir", str(ck)]
  assert main([*base, "--steps", "4", "--checkpoint-every", "2"]) == 0
  # Every checkpoint file (the folder's run lock is each run's: it names its holder).
  before = {p: p.stat().st_mtime_ns for p in ck.rglob("*") if p.name != ".flax_tp-run.lock"}
  capsys.readouterr()
  # The repro: another seed, saving every step, into the same folder.
  assert main([*base, "--steps", "4", "--checkpoint-every", "1", "--seed", "7"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "holds checkpoints of an earlier run (steps 2, 4)" in err
  assert "--resume" in err and "--overwrite" in err
  assert {p: p.stat().st_mtime_ns for p in ck.rglob("*")
          if p.name != ".flax_tp-run.lock"} == before  # untouched
  # --resume of it with another seed is refused, naming the difference.
  assert main([*base, "--steps", "6", "--resume", "--seed", "7"]) == 2
  assert "belong to another run (seed 0 there, 7 here)" in capsys.readouterr().err
  # Only an explicit --overwrite deletes them.
  assert main([*base, "--steps", "3", "--checkpoint-every", "1", "--seed", "7",
               "--overwrite", "--keep-checkpoints", "0"]) == 0
  assert steps_in(ck) == [1, 2, 3]
  assert Checkpointer(ck).read_meta()["run"]["seed"] == 7


def _run_until(argv, metrics, at_least, sig, env):
  """Starts train/run.py, sends ``sig`` once ``metrics`` has a step >= at_least."""
  proc = subprocess.Popen([sys.executable, str(ROOT / "train" / "run.py"), *argv],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists():
      steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
               if line.endswith("}")]
      if steps and max(steps) >= at_least:
        break
    time.sleep(0.05)
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=120)
  return proc.returncode, err


@pytest.mark.slow
def test_signals_save_the_last_step_and_resume_exactly(tmp_path, corpus):
  """SIGINT, then SIGTERM on resume, then a resume to the end: the losses of an
  uninterrupted run, each step once in the metrics file."""
  steps = "120"  # more than the runs get to before their signals (they stop near 3 and 6)
  common = [*FLAGS, "--mesh", "2x4", "--data", corpus, "--steps", steps]
  env = subprocess_env()
  ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
  argv = [*common, "--checkpoint-dir", str(ck), "--metrics-file", str(metrics)]
  code, err = _run_until(argv, metrics, 3, signal.SIGINT, env)
  assert code == 130, err
  last = steps_in(ck)[-1]
  assert last >= 3 and f"SIGINT: stopped after step {last}; checkpoint of step {last}" in err
  code, err = _run_until([*argv, "--resume"], metrics, last + 3, signal.SIGTERM, env)
  assert code == 143, err
  second = steps_in(ck)[-1]
  assert second >= last + 3 and f"SIGTERM: stopped after step {second}" in err
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == list(range(1, second + 1))  # once each
  # The uninterrupted run, same flags, in-process.
  ref = tmp_path / "ref.jsonl"
  assert main([*common, "--metrics-file", str(ref)]) == 0
  ref_losses = [r["loss"] for r in map(json.loads, ref.read_text().splitlines()) if "loss" in r]
  assert [r["loss"] for r in records if "loss" in r] == ref_losses[:second]


def test_a_failing_save_exits_1_with_one_line(tmp_path, corpus, capsys, monkeypatch):
  def disk_full(*_):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(Checkpointer, "_commit", disk_full)
  assert main([*FLAGS, "--mesh", "1x2", "--data", corpus, "--steps", "2",
               "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "cannot write checkpoint step 1" in err
  assert "No space left on device" in err


def _write_legacy(directory, step, trees, meta):
  """A checkpoint as flax_tp 0.1.0 wrote it: orbax, whole logical arrays keyed by path."""
  import orbax.checkpoint as ocp

  from flax_tp.checkpoint.keys import is_leaf, key_of
  from flax_tp.logical import logical_value
  state = {}
  for name, tree in trees.items():
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    state[name] = {key_of(path): logical_value(leaf) for path, leaf in flat}
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True),
                                  item_names=("state", "meta"))
  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()
  manager.close()


@pytest.mark.slow
def test_checkpoints_of_the_previous_version_still_resume(tmp_path, corpus, capsys):
  """A 0.1.0 (orbax) checkpoint resumes on another mesh with the losses of a new-format one."""
  new = tmp_path / "new"
  base = [*FLAGS, "--data", corpus, "--steps", "4"]
  assert main([*base, "--mesh", "1x2", "--checkpoint-dir", str(new), "--checkpoint-every",
               "2"]) == 0
  trainer = _trainer("1x2", 9)
  like = {"params": trainer.params, "opt_state": trainer.init_opt_state(trainer.params)}
  state, meta = Checkpointer(new).restore(like, step=2)
  run = meta["run"]
  old = tmp_path / "old"
  _write_legacy(old, 2, state, {k: run[k] for k in ("config", "seed", "batch_size", "seq_len")}
                | {"steps": 4, "step": 2})
  assert Checkpointer(old).steps() == [2] and Checkpointer(old).read_meta()["step"] == 2
  for later in Checkpointer(new).steps()[1:]:  # both folders now end at step 2
    shutil.rmtree(new / str(later))
  capsys.readouterr()
  resumed = []
  for folder in (new, old):
    metrics = tmp_path / f"{folder.name}.jsonl"
    assert main([*base, "--mesh", "2x4", "--resume", "--checkpoint-dir", str(folder),
                 "--metrics-file", str(metrics)]) == 0
    resumed.append([r["loss"] for r in map(json.loads, metrics.read_text().splitlines())
                    if "loss" in r])
  assert len(resumed[0]) == 2 and resumed[0] == resumed[1]
  assert "checkpoint of flax_tp 0.1.0" in capsys.readouterr().out
