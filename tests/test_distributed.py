"""Several processes through jax.distributed (gloo on CPU), all on localhost, bounded in time."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_RUN_FLAGS, subprocess_env

from train.launch import free_port
from train.run import main

# Processes spawned / the benchmarks run: the slow lane (.ci/run runs it second).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
FLAGS = TINY_RUN_FLAGS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  from helpers import write_small_corpus
  return write_small_corpus(tmp_path_factory.mktemp("data") / "corpus.py")


def clean_env():
  env = {k: v for k, v in subprocess_env().items() if not k.startswith("FLAX_TP")}
  return {**env, "PYTHONUNBUFFERED": "1"}


def records(path):
  return [json.loads(line) for line in Path(path).read_text().splitlines()]


def losses(path):
  return [r["loss"] for r in records(path) if "loss" in r]


def test_two_processes_equal_one_and_checkpoint_moves_to_one_process(tmp_path, corpus):
  """With FSDP: the data axis spans the two processes, so every param is all-gathered and
  every gradient reduce-scattered between them; the losses are the single process's
  without FSDP, and its checkpoint resumes there."""
  ck, metrics = tmp_path / "ck", tmp_path / "two.jsonl"
  out = subprocess.run(
      [sys.executable, str(ROOT / "train" / "launch.py"), "--processes", "2", "--",
       "--mesh", "2x4", "--steps", "4", *FLAGS, "--data", corpus, "--metrics-file", str(metrics),
       "--checkpoint-dir", str(ck), "--checkpoint-every", "3", "--fsdp"],
      capture_output=True, text=True, env=clean_env(), timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "2 process(es)" in out.stdout and "model axis stays inside a process" in out.stdout
  assert "FSDP over data" in out.stdout
  assert "[Gloo]" not in out.stdout  # the launcher filters gloo's chatter

  single = tmp_path / "one.jsonl"
  assert main(["--mesh", "2x4", "--steps", "4", *FLAGS, "--data", corpus,
               "--metrics-file", str(single)]) == 0
  assert len(losses(metrics)) == 4
  np.testing.assert_allclose(losses(metrics), losses(single), rtol=1e-5)

  # The 2-process checkpoint of step 3 restores in this single process on 1x8.
  moved = tmp_path / "moved"
  moved.mkdir()
  shutil.copytree(ck / "3", moved / "3")
  resumed = tmp_path / "resumed.jsonl"
  assert main(["--mesh", "1x8", "--steps", "4", *FLAGS, "--data", corpus, "--resume",
               "--checkpoint-dir", str(moved), "--metrics-file", str(resumed)]) == 0
  np.testing.assert_allclose(losses(resumed), losses(single)[3:], rtol=1e-5)


def two_processes_and_one(tmp_path, flags):
  """``train/launch.py --processes 2`` and then one process, with the same ``flags``:
  (the launcher's stdout, the two metrics files: two processes', one process's)."""
  two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
  out = subprocess.run(
      [sys.executable, str(ROOT / "train" / "launch.py"), "--processes", "2", "--", *flags,
       "--metrics-file", str(two)], capture_output=True, text=True, env=clean_env(),
      timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "2 process(es)" in out.stdout
  assert main([*flags, "--metrics-file", str(one)]) == 0
  return out.stdout, two, one


def test_experts_over_data_across_two_processes_equal_one(tmp_path, corpus):
  """moe-tiny with its 6 experts split over the data axis, which spans the two processes:
  each token's dispatch (all-gather over data) and combine (reduce-scatter) go between
  them, with a capacity and sequence parallelism too. Losses, expert loads and drops are
  the single process's."""
  flags = [*FLAGS, "--preset", "moe-tiny", "--mesh", "2x4", "--steps", "3",
           "--expert-capacity-factor", "1.0", "--sequence-parallel", "--data", corpus]
  stdout, two, one = two_processes_and_one(tmp_path, flags)
  assert "over data: 3, 3 per shard" in stdout
  steps_two, steps_one = ([r for r in records(p) if "loss" in r] for p in (two, one))
  assert len(steps_two) == 3
  for name in ("loss", "router_aux_loss", "expert_dropped", "expert_load"):
    np.testing.assert_allclose([r[name] for r in steps_two], [r[name] for r in steps_one],
                               rtol=1e-5, err_msg=name)
  assert steps_one[0]["expert_dropped"] > 0


def test_lora_across_two_processes_equals_one(tmp_path, corpus):
  """LoRA adapters on every projection, the base FSDP-split over a data axis spanning two
  processes: the adapters' gradients are reduced between them; the losses are the single
  process's."""
  flags = [*FLAGS, "--mesh", "2x4", "--steps", "3", "--lora-rank", "4", "--lora-targets",
           "blocks.*.attn.[qkvo],blocks.*.mlp.*", "--fsdp", "--data", corpus]
  stdout, two, one = two_processes_and_one(tmp_path, flags)
  assert "lora: rank 4" in stdout
  assert len(losses(two)) == 3
  np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)


@pytest.mark.parametrize("mesh_flags,spans", [
    (["--mesh", "2x2x2"], "the context axis stays inside a process"),
    (["--mesh", "stage=2,data=2,model=2", "--microbatches", "2", "--pipeline-schedule", "1f1b"],
     "the stage axis spans a process")])
def test_a_context_or_stage_axis_across_two_processes_equals_one(tmp_path, corpus, mesh_flags,
                                                                  spans):
  """Three-axis meshes over two processes (the first axis spans them): the start-up report
  says which axis crosses processes, and the losses are the single process's."""
  flags = [*FLAGS, "--preset", "llama-tiny", *mesh_flags, "--steps", "3", "--data", corpus]
  stdout, two, one = two_processes_and_one(tmp_path, flags)
  assert spans in stdout, stdout
  assert len(losses(two)) == 3
  np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)


def _wait_for_steps(launcher, metrics, steps: int) -> None:
  """Until the launched run's metrics file holds ``steps`` losses (bounded: 120 s)."""
  deadline = time.time() + 120
  while time.time() < deadline and not (metrics.exists() and metrics.read_text().count(
      '"loss"') >= steps):
    assert launcher.poll() is None, launcher.stderr.read()[-2000:]
    time.sleep(0.2)


def test_ctrl_c_on_the_launcher_saves_one_step_on_every_process(tmp_path, corpus):
  """The launcher forwards SIGINT once; both processes stop after the same step and save it."""
  ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
  launcher = subprocess.Popen(
      [sys.executable, str(ROOT / "train" / "launch.py"), "--processes", "2", "--",
       "--mesh", "2x4", "--steps", "100000", *FLAGS, "--data", corpus,
       "--metrics-file", str(metrics), "--checkpoint-dir", str(ck)],
      env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    _wait_for_steps(launcher, metrics, 3)
    launcher.send_signal(signal.SIGINT)
    code = launcher.wait(timeout=120)
    err = launcher.stderr.read()
  finally:
    if launcher.poll() is None:
      launcher.kill()
  assert code == 130, err[-2000:]
  steps = sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit())
  assert len(steps) == 1 and steps[0] == max(r["step"] for r in records(metrics))
  assert json.loads((ck / str(steps[0]) / "meta.json").read_text())["processes"] == 2
  for prefix in ("", "[process 1] "):
    assert f"{prefix}SIGINT: stopped after step {steps[0]}; checkpoint of step" in err, err


def test_killing_one_process_stops_the_other(tmp_path, corpus):
  port = free_port()
  metrics = tmp_path / "m.jsonl"
  procs = []
  for pid in (0, 1):
    extra = ["--metrics-file", str(metrics)] if pid == 0 else []
    procs.append(subprocess.Popen(
        [sys.executable, str(ROOT / "train" / "run.py"), "--mesh", "2x4", "--steps", "100000",
         *FLAGS, "--data", corpus, "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(pid), "--heartbeat-timeout", "10", *extra],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
  try:
    deadline = time.time() + 120
    def steps_done():  # complete lines only: the file is being written
      if not metrics.exists():
        return 0
      return sum(1 for line in metrics.read_text().split("\n")[:-1] if '"loss"' in line)

    while time.time() < deadline and steps_done() < 3:
      assert all(p.poll() is None for p in procs), "a process ended before training"
      time.sleep(0.5)
    assert steps_done() >= 3, "training did not start"
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    code = procs[0].wait(timeout=60)  # bounded: the test fails rather than hangs
    took = time.time() - killed_at
    err = procs[0].stderr.read()
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert code != 0
  assert took < 45
  assert "lost contact with another process" in err or "another task died" in err, err[-2000:]


@pytest.mark.parametrize("worker,signum,message", [
    (0, signal.SIGKILL, "process 0 was killed by SIGKILL; the run stopped"),
    (1, signal.SIGSTOP, "process 1 was stopped (SIGSTOP, or a debugger) and stopped answering; "
                        "the others lost contact with it and the run stopped")])
def test_a_killed_or_stopped_worker_of_the_launcher_is_named_in_one_line(tmp_path, corpus,
                                                                         worker, signum,
                                                                         message):
  """The survivors' gRPC logs go to files; the launcher names the process that was killed,
  or the one that stopped answering (a kill -STOP made process 0 abort on the lost
  heartbeat, and the launcher blamed process 0's SIGABRT)."""
  port = free_port()
  metrics = tmp_path / "m.jsonl"
  launcher = subprocess.Popen(
      [sys.executable, str(ROOT / "train" / "launch.py"), "--processes", "2", "--port",
       str(port), "--grace", "5", "--", "--mesh", "2x4", "--steps", "100000", *FLAGS,
       "--data", corpus, "--metrics-file", str(metrics), "--heartbeat-timeout", "5"],
      env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    _wait_for_steps(launcher, metrics, 3)
    wanted = {f"FLAX_TP_PROCESS_ID={worker}".encode(),
              f"FLAX_TP_COORDINATOR=127.0.0.1:{port}".encode()}
    (pid,) = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
              and _environ(p) >= wanted]
    os.kill(pid, signum)
    code = launcher.wait(timeout=120)
    err = launcher.stderr.read()
  finally:
    if launcher.poll() is None:
      launcher.kill()
  assert code == 1, err
  assert err.count("\n") == 1 and err.startswith(f"train/launch.py: error: {message}"), err
  logs = Path(err.split("native logs in ")[1].strip()) if "native logs in" in err else None
  if logs is not None:
    assert logs.is_dir()
    shutil.rmtree(logs)
  assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def _environ(proc: Path) -> set[bytes]:
  try:
    return set((proc / "environ").read_bytes().split(b"\0"))
  except OSError:  # gone, or not ours
    return set()


def test_missing_coordinator_is_a_clear_error_after_a_bounded_wait(corpus):
  t0 = time.time()
  out = subprocess.run(
      [sys.executable, str(ROOT / "train" / "run.py"), "--mesh", "2x4", *FLAGS, "--data", corpus,
       "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", "1",
       "--init-timeout", "3"],
      capture_output=True, text=True, env=clean_env(), timeout=60)
  assert out.returncode == 1
  assert time.time() - t0 < 30
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "could not join the distributed run at 127.0.0.1:" in lines[0]


@pytest.mark.parametrize("argv,message", [
    (["--num-processes", "2"], "missing --coordinator, --process-id"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
     "'localhost' is not HOST:PORT"),
    (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in [0, 2)"),
    (["--mesh", "1x3", "--coordinator", "localhost:1234", "--num-processes", "2",
      "--process-id", "0"], "3 devices, which 2 processes cannot share evenly"),
])
def test_bad_distributed_flags_exit_2(capsys, argv, message):
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err


def test_environment_variables_are_read(monkeypatch, capsys):
  monkeypatch.setenv("FLAX_TP_NUM_PROCESSES", "2")
  assert main([]) == 2
  assert "missing --coordinator, --process-id" in capsys.readouterr().err
