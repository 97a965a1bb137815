"""train/run.py as a user runs it: a real process, exit codes, one-line errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_RUN_FLAGS, subprocess_env

from train.run import main

FLAGS = TINY_RUN_FLAGS

ROOT = Path(__file__).resolve().parent.parent
RUN = [sys.executable, str(ROOT / "train" / "run.py")]


def env(**extra):
  """The child compiles as the tests do and picks its own devices (helpers.subprocess_env)."""
  return subprocess_env(**extra)


@pytest.mark.slow
def test_help_documents_every_flag():
  """Every flag the parser knows (read from it, so none can be skipped) is in --help."""
  from train.run import build_parser
  out = subprocess.run([*RUN, "--help"], capture_output=True, text=True, env=env(), timeout=120)
  assert out.returncode == 0
  flags = [f for action in build_parser()._actions for f in action.option_strings
           if f.startswith("--")]
  assert {"--fsdp", "--sequence-parallel", "--remat", "--scan-layers", "--init-from"} <= set(flags)
  for flag in [*flags, "llama-125m"]:
    assert flag in out.stdout, flag


@pytest.mark.slow
def test_a_few_steps_in_a_fresh_process(tmp_path):
  """No XLA_FLAGS given: the script provides the 8 simulated devices itself."""
  data = tmp_path / "data.txt"
  data.write_text("def f(x):\n    return x + 1\n" * 400)
  ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
  out = subprocess.run(
      [*RUN, "--mesh", "2x4", "--preset", "tiny", "--steps", "3", "--batch-size", "4",
       "--seq-len", "16", "--data", str(data), "--checkpoint-dir", str(ck),
       "--metrics-file", str(metrics), "--sample-length", "8"],
      capture_output=True, text=True, env=env(), timeout=300)
  assert out.returncode == 0, out.stderr
  assert "8 cpu device(s)" in out.stdout and "mesh 2x4 (data=2, model=4)" in out.stdout
  assert "sample" in out.stdout and "done: 3 steps" in out.stdout
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
  assert (ck / "3").is_dir()


@pytest.mark.slow
def test_mesh_too_large_exits_2_with_one_line():
  out = subprocess.run([*RUN, "--mesh", "3x3"], capture_output=True, text=True, timeout=120,
                       env=env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in out.stderr
  assert "'3x3' needs 9 devices, found 8" in lines[0]


@pytest.mark.parametrize("argv,message", [
    (["--mesh", "2x"], "bad mesh spec '2x'"),
    (["--mesh", "0x4"], "bad mesh spec '0x4'"),
    (["--steps", "0"], "--steps must be an integer in [1, 2147483647], got 0"),
    (["--steps", "ten"], "invalid int value: 'ten'"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--dtype", "float16"], "invalid choice: 'float16'"),
    (["--dropout", "1.5"], "--dropout must be a number in [0, 1), got 1.5"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--data", "/no/such/file"], "does not exist"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--mesh", "2x4", "--batch-size", "3"], "--batch-size 3 is not divisible by the 2-way"),
    (["--mesh", "stage=2,data=2,model=2", "--batch-size", "8", "--microbatches", "3"],
     "--microbatches 3 does not divide the 4 sequences each data shard runs (--batch-size 8 "
     "over the 2-way data axis of --mesh stage=2,data=2,model=2)"),
    (["--microbatches", "0"], "--microbatches must be an integer in [1, 2147483647], got 0"),
    (["--loss-chunks", "0"], "--loss-chunks must be an integer in [1, 2147483647], got 0"),
    (["--pipeline-repeats", "2"], "--pipeline-repeats 2 is for --pipeline-schedule circular"),
    (["--pipeline-schedule", "zero-bubble"], "invalid choice: 'zero-bubble'"),
    (["--pipeline-repeats", "2", "--pipeline-schedule", "1f1b"],
     "--pipeline-repeats 2 is for --pipeline-schedule circular (1f1b holds one group"),
    (["--preset", "moe-tiny", "--mesh", "stage=2,data=2,model=2", "--microbatches", "2",
      "--pipeline-schedule", "1f1b"], "error: pipeline_schedule='1f1b' takes each "
     "microbatch's loss as it leaves the last stage, and a mixture of experts'"),
])
def test_bad_flags_exit_2_with_one_line(capsys, argv, message):
  assert main(argv) == 2
  captured = capsys.readouterr()
  assert captured.err.count("\n") == 1 and message in captured.err
  assert captured.err.startswith("train/run.py: error: ")


@pytest.mark.slow
@pytest.mark.parametrize("script,argv,message", [
    (["train/launch.py"], ["--processes", "two"], "train/launch.py: error: argument --processes"),
    (["-m", "bench.run"], ["--repeats", "abc"], "bench/run.py: error: argument --repeats"),
    (["-m", "bench.plan"], ["--frobnicate"], "bench.plan: error: unrecognized arguments"),
])
def test_launcher_and_benchmarks_refuse_bad_flags_in_one_line(script, argv, message):
  out = subprocess.run([sys.executable, *script, *argv], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env())
  assert out.returncode == 2
  assert out.stderr.count("\n") == 1 and out.stderr.startswith(message), out.stderr


def _bench(module):
  return lambda argv: __import__(f"bench.{module}", fromlist=["main"]).main(argv)


@pytest.mark.parametrize("entry,argv,message", [
    (_bench("run"), ["--repeats", "-1"], "bench/run.py: error: argument --repeats: expected "
     "an integer >= 1, got -1"),
    (_bench("run"), ["--batch-size", "0"], "argument --batch-size: expected an integer >= 1"),
    (_bench("run"), ["--seq-len", "-5"], "argument --seq-len: expected an integer >= 1"),
    # An unknown section used to run everything and overwrite bench/results.json.
    (_bench("run"), ["--skip", "bogus"], "argument --skip: unknown 'bogus'; expected"),
    (_bench("decode"), ["--new-tokens", "-1"], "bench.decode: error: argument --new-tokens"),
    (_bench("decode"), ["--preset", "bogus"], "argument --preset: invalid choice: 'bogus'"),
    (_bench("decode"), ["--contexts", "128,x"], "argument --contexts: expected an integer"),
    (_bench("memory"), ["--out", "/proc/x"], "bench.memory: error: cannot write --out "
     "'/proc/x'"),
    (_bench("memory"), ["--sections", "bogus"], "argument --sections: unknown 'bogus'"),
    (_bench("memory"), ["--options", "plain,fast"], "argument --options: unknown 'fast'"),
    (_bench("plan"), ["--repeats", "0"], "bench.plan: error: argument --repeats"),
    (lambda argv: __import__("train.launch", fromlist=["main"]).main(argv),
     ["--port", "99999"], "train/launch.py: error: argument --port: expected a port in "
     "[1, 65535], got 99999"),
    (main, ["--metrics-file", "/proc/x"], "--metrics-file '/proc/x' cannot be written"),
    (main, ["--sample-prompt", "ab\udcff"], "--sample-prompt: it is not valid UTF-8 (byte "
     "'ff' at character 2)"),
])
def test_bad_values_anywhere_exit_2_with_one_line(capsys, entry, argv, message):
  """Every CLI refuses these before any work starts, in one line with exit status 2."""
  try:
    code = entry(argv)
  except SystemExit as stop:
    code = stop.code
  assert code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("count,why", [
    ("banana", "expected an integer >= 1"), ("-3", "expected an integer >= 1"),
    ("0", "expected an integer >= 1"), ("\u00b2", "expected an integer >= 1"),
    ("200000", "at most 1024 devices per process can be simulated on a CPU")])
def test_an_impossible_xla_device_count_is_one_line(monkeypatch, capsys, count, why):
  """XLA_FLAGS is read before JAX starts; XLA itself would fail later with a traceback
  (a Unicode digit: int() refuses what str.isdigit took), or, for 200000 devices, take
  minutes and ~20 GB while ignoring Ctrl-C before it was killed for memory."""
  monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count={count}")
  assert main(["--mesh", "1x2"]) == 2
  err = capsys.readouterr().err
  shown = count if count == "200000" else repr(count)
  assert err == (f"train/run.py: error: XLA_FLAGS sets --xla_force_host_platform_device_count="
                 f"{shown}; {why}\n")
  with pytest.raises(SystemExit) as stop:
    _bench("plan")(["--repeats", "1", "--meshes", "1x2"])
  assert stop.value.code == 2 and "bench.plan: error: XLA_FLAGS sets" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("module,argv,message", [
    ("bench.hostmem", ["--mesh", "0x0"], "bench.hostmem: error: bad mesh spec '0x0'"),
    ("bench.ckptmem", ["--processes", "0"], "bench.ckptmem: error: argument --processes: "
     "expected an integer >= 1, got 0"),
    ("bench.ckptmem", ["--processes", "3"], "argument --processes: invalid choice: 3"),
])
def test_memory_probes_refuse_bad_flags_in_one_line(module, argv, message):
  out = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env())
  assert out.returncode == 2
  assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def test_simulated_devices_get_a_spare_thread_each(monkeypatch):
  """XLA:CPU's pool gets twice as many threads as simulated devices (a collective holds
  its thread while it waits; see flax_tp.mesh.cpu_thread_pool_size), the device count the
  user chose counts, and a user's NPROC stays."""
  from train.devices import provide_cpu_devices
  monkeypatch.delenv("NPROC", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=12")
  provide_cpu_devices(8)
  assert os.environ["NPROC"] == str(max(os.cpu_count() or 1, 24))
  assert "--xla_cpu_collective_call_terminate_timeout_seconds=600" in os.environ["XLA_FLAGS"]
  monkeypatch.setenv("NPROC", "5")
  provide_cpu_devices(8)
  assert os.environ["NPROC"] == "5"


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_during_start_up_is_one_line(signals):
  """Ctrl-C while the script imports JAX (and a second one): one line, status 130."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen([sys.executable, str(ROOT / "train" / "run.py"), "--mesh", "2x4"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  time.sleep(0.5)  # python is up (the handler is set first thing), JAX is being imported
  for _ in range(signals):
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130 and err == "train/run.py: interrupted\n", err


def test_no_blank_line_before_an_error_on_a_cold_cache(tmp_path, monkeypatch, capsys):
  """Tokenizing into an empty cache shows no progress bar off a terminal (rich's transient
  bar left an empty line before the error)."""
  monkeypatch.setenv("FLAX_TP_CACHE", str(tmp_path / "cache"))
  data = tmp_path / "tiny.txt"
  data.write_text("abc\n")
  assert main([*FLAGS, "--mesh", "1x2", "--data", str(data)]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert captured.err.startswith("train/run.py: error: --data") and captured.err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["--seed", "-1"], "--seed must be an integer in [0, 2**32), got -1"),
    (["--seed", "99999999999999999999"], "--seed must be an integer in [0, 2**32)"),
    (["--grad-clip", "nan"], "--grad-clip must be a number >= 0 (0: off), got nan"),
    (["--weight-decay", "nan"], "--weight-decay must be a number >= 0, got nan"),
    (["--lr", "inf"], "--lr must be a positive number, got inf"),
    (["--z-loss", "nan"], "--z-loss must be a number >= 0, got nan"),
    (["--expert-capacity-factor", "0"], "--expert-capacity-factor must be a positive number, "
     "got 0.0"),
    (["--expert-capacity-factor", "1"], "--expert-capacity-factor 1.0 is for a model with "
     "experts; this one has none"),
    (["--expert-drop-policy", "position"], "--expert-drop-policy needs "
     "--expert-capacity-factor"),
    (["--lora-rank", "-1"], "--lora-rank must be an integer >= 0 (0: full fine-tuning), "
     "got -1"),
    (["--lora-rank", "4", "--lora-alpha", "nan"], "--lora-alpha must be a positive number"),
    (["--lora-targets", "blocks.*.attn.o"], "--lora-targets needs --lora-rank"),
    (["--lora-rank", "4", "--lora-targets", ""], "--lora-targets '' names no layer"),
    (["--lora-rank", "4", "--lora-targets", " , "], "--lora-targets ' , ' names no layer"),
    (["--router-z-loss", "0.1"], "--router-z-loss 0.1 is for a model with experts"),
    (["--router-bias-rate", "-0.1"], "--router-bias-rate must be a number >= 0, got -0.1"),
    (["--expert-dispatcher", "all-to-all"], "--expert-dispatcher all-to-all is for a model "
     "with experts; this one has none"),
    (["--preset", "moe-tiny", "--expert-dispatcher", "all-to-all"], "--expert-dispatcher "
     "all-to-all without --expert-capacity-factor (dropless) needs jax.lax.ragged_all_to_all, "
     "which XLA on 'cpu' does not implement"),
    # Mixtral's softmax router has no selection bias to move
    (["--preset", "moe-tiny", "--router-bias-rate", "0.001"], "--router-bias-rate 0.001 "
     "moves a router's selection bias (DeepSeek-V3, GLM-4.5); this model's routers have none"),
    (["--preset", "deepseek-v3"], "--preset deepseek-v3 is DeepSeek-V3's 671B params (7.3 "
     "TiB with AdamW in float32): its shapes are for the benchmarks' abstract compiles"),
    # estimated before anything is allocated (it once aborted natively, exit 134)
    (["--preset", "gpt-oss-20b"], "--preset gpt-oss-20b has 20.9B params: their float32 "
     "values, gradients and AdamW moments alone need"),
    (["--expert-axes", "data,model"], "--expert-axes data,model is for a model with experts"),
    (["--lora-rank", "4", "--router-bias-rate", "0.001"], "--router-bias-rate 0.001 moves "
     "routers' selection biases, which --lora-rank freezes"),
    (["--expert-axes", "context"], "--expert-axes: bad expert axes 'context': no 'data'"),
    (["--expert-axes", "data,stage"], "unknown role 'stage'"),
    (["--lora-rank", "4", "--lora-targets", "no.such"], "--lora-targets: LoRA target "
     "'no.such' matches no column- or row-parallel layer"),
    (["--steps", "99999999999"], "--steps must be an integer in [1, 2147483647]"),
    (["--checkpoint-dir", "/proc/foo"], "--checkpoint-dir '/proc/foo' cannot be created"),
    (["--checkpoint-dir", __file__], "is a file, not a folder"),
    (["--metrics-file", "/proc/nope/m.jsonl"], "folder '/proc/nope' does not exist"),
    (["--metrics-file", "/"], "--metrics-file '/' is a folder, not a file"),
    (["--overwrite"], "--overwrite needs --checkpoint-dir"),
    (["--mesh", "100000x100000"], "'100000x100000' needs 10000000000 devices"),
])
def test_more_bad_values_exit_2_with_one_line(capsys, argv, message):
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err and err.startswith("train/run.py: error: ")


@pytest.mark.parametrize("inside", ["4/meta.json", ".tmp-5/m.jsonl", ".flax_tp-run.lock"])
def test_a_metrics_file_inside_the_checkpoints_is_refused(tmp_path, capsys, inside):
  """Appending metrics to a step's meta.json (or anything the checkpointer owns) would
  corrupt it: exit 2, one line, before any work; a file beside the step folders is fine."""
  ck = tmp_path / "ck"
  (ck / "4").mkdir(parents=True)
  (ck / "4" / "meta.json").write_text("{}")
  (ck / ".tmp-5").mkdir()
  assert main(["--checkpoint-dir", str(ck), "--metrics-file", str(ck / inside)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "which the run's checkpoints own" in err, err
  assert (ck / "4" / "meta.json").read_text() == "{}"


@pytest.mark.slow
def test_a_named_remat_policy_without_scanned_layers_on_cpu_says_it_saves_nothing(tmp_path,
                                                                                capsys):
  from helpers import write_small_corpus
  corpus = write_small_corpus(tmp_path / "corpus.py", files=3)
  flags = [*TINY_RUN_FLAGS, "--mesh", "1x2", "--steps", "1", "--data", corpus]
  note = "note: --remat dots_saveable without --scan-layers recomputes nothing on XLA's CPU"
  assert main([*flags, "--remat", "dots_saveable"]) == 0
  assert note in capsys.readouterr().out
  assert main([*flags, "--remat", "dots_saveable", "--scan-layers"]) == 0
  assert "recomputes nothing" not in capsys.readouterr().out


@pytest.mark.slow
def test_huge_mesh_in_a_fresh_process_is_one_line():
  """Without XLA_FLAGS the script would ask XLA for the devices; it refuses first."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, str(ROOT / "train" / "run.py"), "--mesh",
                        "100000x100000"], capture_output=True, text=True, env=env, timeout=120)
  assert out.returncode == 2 and out.stderr.count("\n") == 1
  assert "at most 1024 per process can be simulated" in out.stderr


def test_export_refuses_bad_input_in_one_line(tmp_path, capsys):
  """train/export.py: a folder without a checkpoint, a bad step, a bad mesh: exit 2, one
  line naming it."""
  from train import export
  for flags, named in ((["--checkpoint", str(tmp_path / "none")], "no checkpoint found"),
                       (["--checkpoint", str(tmp_path), "--step", "-1"], "--step must be >= 0"),
                       (["--checkpoint", str(tmp_path), "--mesh", "3x5"], "15 devices")):
    assert export.main([*flags, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err


def test_export_never_writes_over_another_model(tmp_path, capsys):
  """--out holding a model (an --init-from folder, an earlier export) is refused, one line,
  exit 2, and its files are left as they were."""
  from train import export
  from train.run import main
  ck, out = tmp_path / "ck", tmp_path / "out"
  assert main(["--preset", "moe-tiny", "--mesh", "1x2", "--steps", "1", "--batch-size", "2",
               "--seq-len", "8", "--eval-every", "0", "--sample-length", "0",
               "--checkpoint-dir", str(ck)]) == 0
  out.mkdir()
  (out / "config.json").write_text("{}")
  capsys.readouterr()
  assert export.main(["--checkpoint", str(ck), "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "already holds a model (config.json)" in err, err
  assert (out / "config.json").read_text() == "{}"


def _in_process_runs(tmp_path, capsys):
  """``run(mesh, name, steps, *flags)`` -> (stdout, logged losses) of ``train/run.py``'s
  ``main`` in this process on the tiny preset."""
  from helpers import logged_losses

  from train.run import main

  def run(mesh, name, steps, *extra):
    metrics = tmp_path / f"{name}.jsonl"
    capsys.readouterr()
    code = main([*TINY_RUN_FLAGS, "--mesh", mesh, "--steps", str(steps), "--metrics-file",
                 str(metrics), *extra])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    return out.out, logged_losses(metrics)
  return run


@pytest.mark.slow
def test_a_context_mesh_trains_as_2x4_and_resumes_on_1x8(tmp_path, capsys):
  """--mesh 2x2x2 logs the losses --mesh 2x4 does (same global batch), with either
  context-parallel strategy, and its checkpoint resumes on 1x8 (no param depends on
  the context axis). (In this process: nothing here is about the process.)"""
  run = _in_process_runs(tmp_path, capsys)

  def ckpt(name):
    return ["--checkpoint-dir", str(tmp_path / name), "--checkpoint-every", "2"]

  stdout, context = run("2x2x2", "context", 4, *ckpt("context"))
  assert "(data=2, context=2, model=2)" in stdout
  _, plain = run("2x4", "plain", 4, *ckpt("plain"))
  assert len(context) == len(plain) >= 4
  assert context == pytest.approx(plain, rel=1e-5)
  stdout, ring = run("2x2x2", "ring", 4, "--context-parallel", "ring")
  assert "ring attention over context" in stdout
  assert ring == pytest.approx(plain, rel=1e-5)
  # Resumed on 1x8 (the run goes on to 6 steps, a schedule of its own), each continues
  # as the other does.
  stdout, from_context = run("1x8", "from_context", 6, *ckpt("context"), "--resume")
  assert "resumed from step 4" in stdout
  _, from_plain = run("1x8", "from_plain", 6, *ckpt("plain"), "--resume")
  assert len(from_context) == len(from_plain) == 2  # steps 5 and 6
  assert from_context == pytest.approx(from_plain, rel=1e-5)


@pytest.mark.slow
def test_a_pipelined_mesh_trains_as_2x4_and_resumes_on_1x8(tmp_path, capsys):
  """--mesh stage=2,data=2,model=2 --microbatches 4 logs the losses --mesh 2x4 does (the
  same global batch), says which layers each stage holds and the bubble, and its
  checkpoint (the unpipelined model's) resumes on 1x8 as 2x4's does; the circular
  and 1F1B schedules log the same losses. (In this process.)"""
  run = _in_process_runs(tmp_path, capsys)

  def ckpt(name):
    return ["--checkpoint-dir", str(tmp_path / name), "--checkpoint-every", "2"]

  stdout, piped = run("stage=2,data=2,model=2", "piped", 4, "--microbatches", "4",
                      *ckpt("piped"))
  assert "mesh stage=2,data=2,model=2 (stage=2, data=2, model=2)" in stdout
  assert ("pipeline of 2 stages (gpipe), 4 microbatches, bubble 20%; stage 0: layers 0; "
          "stage 1: layers 1") in stdout
  _, plain = run("2x4", "plain", 4, *ckpt("plain"))
  assert len(piped) == len(plain) >= 4
  assert piped == pytest.approx(plain, rel=1e-5)
  stdout, circular = run("model=2,stage=2,data=2", "circular", 2, "--microbatches", "2",
                         "--pipeline-schedule", "circular")
  assert "(circular, 1 group per stage: the same as gpipe), 2 microbatches" in stdout
  assert circular == pytest.approx(plain[:len(circular)], rel=1e-5)
  stdout, one_f_one_b = run("stage=2,data=2,model=2", "1f1b", 2, "--microbatches", "4",
                            "--pipeline-schedule", "1f1b")
  assert "(1f1b, each stage keeping 3 microbatch inputs), 4 microbatches" in stdout
  assert one_f_one_b == pytest.approx(plain[:len(one_f_one_b)], rel=1e-5)
  stdout, from_piped = run("1x8", "from_piped", 6, *ckpt("piped"), "--resume")
  assert "resumed from step 4" in stdout
  _, from_plain = run("1x8", "from_plain", 6, *ckpt("plain"), "--resume")
  assert len(from_piped) == len(from_plain) == 2  # steps 5 and 6
  assert from_piped == pytest.approx(from_plain, rel=1e-5)


@pytest.mark.slow
def test_a_mixture_of_experts_trains_on_a_context_mesh_as_on_2x4(tmp_path, capsys):
  """moe-tiny with a capacity that drops: --mesh 2x2x2 logs the losses and the router
  figures (load, drops) --mesh 2x4 does, with the experts over data or over data x
  context: each context shard's tokens are routed, and a capacity drops what it drops
  over the whole batch. (In this process.)"""
  import json

  from train.run import main

  def run(mesh, *extra):
    metrics = tmp_path / f"{mesh}{len(extra)}.jsonl"
    code = main([*TINY_RUN_FLAGS, "--preset", "moe-tiny", "--seq-len", "13",
                 "--expert-capacity-factor", "0.75", "--mesh", mesh, "--steps", "3",
                 "--metrics-file", str(metrics), *extra])
    assert code == 0, capsys.readouterr().err[-2000:]
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]

  plain = run("2x4")
  figures = [k for k in plain[0] if "expert" in k or "router" in k]
  assert any("dropped" in k for k in figures), figures
  assert sum(r[k] for r in plain for k in figures if "dropped" in k) > 0  # drops happen
  # the experts over data, then over data x context (each context shard's tokens
  # dispatched to the experts on the others)
  for context in (run("2x2x2"), run("2x2x2", "--expert-axes", "data,context")):
    assert len(context) == len(plain) == 3
    for one, other in zip(context, plain, strict=True):
      for name in ["loss", *figures]:
        assert one[name] == pytest.approx(other[name], rel=1e-5, abs=1e-7), name
