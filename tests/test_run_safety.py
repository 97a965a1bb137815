"""A run owns its checkpoint folder, temporary files are flax_tp's own and never outlive
their process, odd checkpoint steps and linked step folders, the tokenizer's long lines,
simulated CPU devices' threads, and one-line messages that quote names."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_RUN_FLAGS, write_small_corpus

from flax_tp.checkpoint import Checkpointer, CheckpointSaveError
from flax_tp.run_lock import FolderInUse, FolderLock
from train.run import main

ROOT = Path(__file__).resolve().parent.parent
FLAGS = [*TINY_RUN_FLAGS, "--mesh", "1x2", "--steps", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_small_corpus(tmp_path_factory.mktemp("data") / "corpus.py", files=10,
                            max_bytes=40_000)


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
  return {**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **extra}


def _wait_for(condition, timeout=60.0, what="the condition"):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if condition():
      return
    time.sleep(0.05)
  raise AssertionError(f"timed out waiting for {what}")


# -- a run owns its --checkpoint-dir --------------------------------------------------

HOLD = """
import sys, time
from flax_tp.run_lock import FolderLock
FolderLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_second_run_in_a_held_checkpoint_dir_refuses_naming_the_holder(tmp_path, corpus,
                                                                          capsys):
  """While another process (another job, or a host sharing the folder) holds the folder,
  a run exits 2 with one line naming it, before touching anything, --overwrite included;
  the lock dies with its holder, however it ends (kill -9 here)."""
  ck = tmp_path / "ck"
  Checkpointer(ck).save(2, _tiny_state(), {})
  before = {p: p.stat().st_mtime_ns for p in ck.rglob("*")}
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ck)], env=_env(),
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    for extra in (["--resume", "--steps", "4"], ["--overwrite"]):
      assert main([*FLAGS, "--data", corpus, "--checkpoint-dir", str(ck), *extra]) == 2
      err = capsys.readouterr().err
      assert err.count("\n") == 1 and f"is in use by another run: pid {holder.pid} on host" \
          in err and "wait for it to end, or choose another --checkpoint-dir" in err, err
      assert {p: p.stat().st_mtime_ns for p in ck.rglob("*")
              if p.name != ".flax_tp-run.lock"} == before  # nothing deleted or written
  finally:
    holder.kill()
    holder.wait()
  lock = FolderLock(ck)
  with lock:  # the holder's lock went with it
    with pytest.raises(FolderInUse, match="already locked by this process"):
      FolderLock(ck).acquire()
  assert not lock.held


# -- temporary files ----------------------------------------------------------------

def test_a_users_file_beside_the_metrics_file_stays_and_a_full_disk_leaves_nothing(
    tmp_path, monkeypatch):
  """--resume rewrites the metrics file (dropping the records past the checkpoint) through
  a temporary name of flax_tp's own: the user's m.jsonl.tmp keeps its bytes; a failing
  write leaves the file as it was, and no temporary file."""
  from train import metrics as metrics_file
  metrics, theirs = tmp_path / "m.jsonl", tmp_path / "m.jsonl.tmp"
  theirs.write_text("my notes\n")
  metrics.write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(4)))
  metrics_file.MetricsWriter(str(metrics), resume_from=1).close()
  assert theirs.read_text() == "my notes\n"
  assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1]
  before = metrics.read_bytes()

  def full(*_):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(metrics_file.os, "replace", full)
  with pytest.raises(OSError, match="No space left"):
    metrics_file._drop_records_after(metrics, 0)
  assert metrics.read_bytes() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl", "m.jsonl.tmp"]


TOKENIZE = """
import sys, time
from pathlib import Path
from train.errors import exit_on_interrupt
exit_on_interrupt("tokenize")
from train import data

class Slow(data.ByteTokenizer):
  def encode(self, b, special_tokens=False):
    time.sleep(0.02)
    return super().encode(b)

data.CHUNK_BYTES = 4096
files = sorted(Path(sys.argv[1]).glob("*.py"))
data._cached_tokens(files, "k" * 40, Slow(), Path(sys.argv[2]), False)
print("finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_tokenizing_leaves_no_partial_token_file(tmp_path, signum):
  """Ctrl-C or SIGTERM during start-up ends the process with os._exit (no traceback), which
  runs no finally: the token file being written is removed first. The next run clears
  what a kill -9 left (a dead process's file, and the old naming's once stale), and only
  that."""
  source, cache = tmp_path / "src", tmp_path / "cache"
  source.mkdir()
  for i in range(40):
    (source / f"f{i}.py").write_text(f"x = {i}\n" * 3000)
  proc = subprocess.Popen([sys.executable, "-c", TOKENIZE, str(source), str(cache)],
                          env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    _wait_for(lambda: cache.is_dir() and any(cache.glob(".tokens-*.tmp")),
              what="the partial token file")
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signum and "finished" not in out
  assert err == "tokenize: interrupted\n", err
  assert list(cache.iterdir()) == []

  from train.data import ByteTokenizer, _cached_tokens
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  import socket
  host = socket.gethostname()
  left = cache / f".tokens-abc.bin.flax_tp-{host}-{dead.stdout.strip()}.tmp"
  old = cache / ".tokens-x1y2.tmp"  # the naming before: no pid, stale after an hour
  recent = cache / ".tokens-z3w4.tmp"
  other_host = cache / f".tokens-abc.bin.flax_tp-elsewhere-{os.getpid()}.tmp"
  for path in (left, old, recent, other_host):
    path.write_bytes(b"partial")
  os.utime(old, (time.time() - 7200, time.time() - 7200))
  _cached_tokens([source / "f0.py"], "q" * 40, ByteTokenizer(), cache, False)
  assert not left.exists() and not old.exists()
  assert recent.exists() and other_host.exists()


def test_a_line_longer_than_a_chunk_is_cut_where_the_tokens_do_not_change(tmp_path,
                                                                          monkeypatch):
  """A line longer than the 1 MiB read chunk (4 KiB here) is cut before a space, so a
  byte-level BPE gives the whole file's tokens; without spaces it is cut between
  characters, never inside one (which inserted U+FFFD: 12 extra tokens in a 3.2 MB line)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  from train import data
  line = ("Grüße, café — naïve Ω≈ç√∫ 日本語のテキスト, and more words; " * 800).rstrip()
  unbroken = "日本語のテキストé" * 2000  # no whitespace at all
  raw = Tokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  raw.train_from_iterator([line[:5000], unbroken[:2000]], trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  raw.save(str(tmp_path / "tokenizer.json"))
  tokenizer = data.HFTokenizer(tmp_path / "tokenizer.json")
  monkeypatch.setattr(data, "CHUNK_BYTES", 4096)
  for text, exact in ((line, True), (unbroken, False)):
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    with open(tmp_path / "ids.bin", "wb") as out:
      data.tokenize_to_file([tmp_path / "t.txt"], out, tokenizer)
    ids = np.fromfile(tmp_path / "ids.bin", tokenizer.dtype)
    assert "\ufffd" not in tokenizer.decode(ids)
    assert tokenizer.decode(ids) == text
    if exact:
      np.testing.assert_array_equal(ids, tokenizer.encode(text.encode()))


def test_a_binary_file_named_with_a_newline_is_one_line(tmp_path, capsys):
  folder = tmp_path / "data"
  folder.mkdir()
  (folder / "bad\nname.txt").write_bytes(b"\0\1\2" * 100)
  assert main([*FLAGS, "--data", str(folder)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "'" in err and "bad\\nname.txt" in err, err


# -- checkpoints: odd steps, links ----------------------------------------------------

def _tiny_state():
  import jax.numpy as jnp
  return {"params": {"w": jnp.arange(6.0).reshape(2, 3)}}


@pytest.mark.parametrize("step", [-1, 5.0, True, "08", "7", None, np.float32(3)])
def test_save_refuses_a_step_that_is_not_a_non_negative_integer(tmp_path, step):
  ck = Checkpointer(tmp_path)
  with pytest.raises(ValueError, match=r"checkpoint step must be an integer >= 0, got"):
    ck.save(step, _tiny_state(), {})
  assert list(tmp_path.iterdir()) == []


def test_numpy_integer_steps_save_list_restore_and_rotate(tmp_path):
  ck = Checkpointer(tmp_path, max_to_keep=2)
  for step in (np.int64(7), np.int32(8), 9):
    ck.save(step, _tiny_state(), {"n": int(step)})
  assert ck.steps() == [8, 9] and sorted(p.name for p in tmp_path.iterdir()) == ["8", "9"]
  restored, meta = ck.restore(_tiny_state(), step=np.int64(8))
  np.testing.assert_array_equal(restored["params"]["w"], _tiny_state()["params"]["w"])
  assert ck.read_meta(np.int64(9)) == {"n": 9}


def test_a_linked_step_folder_is_never_followed_nor_fails_a_save(tmp_path, corpus, capsys):
  """flax_tp writes no links: a run refuses to start where a step is one (a save or
  --overwrite would delete through it); one made while a run rotates is left alone
  (not a step), and a step that cannot be rotated out is a warning, not a failed save."""
  elsewhere = tmp_path / "elsewhere"
  ck = Checkpointer(tmp_path / "ck", max_to_keep=1)
  ck.save(4, _tiny_state(), {})
  (tmp_path / "ck" / "4").rename(elsewhere)
  (tmp_path / "ck" / "4").symlink_to(elsewhere, target_is_directory=True)
  assert ck.steps() == []  # a link is not a step: nothing rotates it or restores from it
  ck.save(16, _tiny_state(), {})
  ck.save(17, _tiny_state(), {})
  assert ck.steps() == [17] and (tmp_path / "ck" / "4").is_symlink()
  assert sorted(p.name for p in elsewhere.iterdir()) == ["index.0.json", "meta.json",
                                                         "shards.0.bin"]
  with pytest.raises(CheckpointSaveError, match="is a symbolic link, which flax_tp did not"):
    ck.save(4, _tiny_state(), {})
  assert main([*FLAGS, "--checkpoint-dir", str(tmp_path / "ck"), "--overwrite"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "/ck/4' is a symbolic link" in err, err
  assert elsewhere.is_dir()

  (tmp_path / "ck" / "4").unlink()
  import flax_tp.checkpoint.checkpointer as checkpoint

  def busy(folder):
    raise OSError(errno.EBUSY, "Device or resource busy", str(folder))
  original, checkpoint.rotate_out = checkpoint.rotate_out, busy
  try:
    with pytest.warns(UserWarning, match="checkpoint step 18 saved in .*, but older step 17 "
                                         "could not be deleted: Device or resource busy"):
      ck.save(18, _tiny_state(), {})
  finally:
    checkpoint.rotate_out = original
  assert ck.steps() == [17, 18]


# -- simulated CPU devices get their spare threads from the library --------------------

THREADS = """
import os
import flax_tp
print(os.environ.get("NPROC"))
"""

LATE = """
import jax
jax.devices()  # JAX's backend starts before flax_tp is imported
import flax_tp
try:
  flax_tp.make_mesh("1x8")
except ValueError as err:
  print("refused:", err)
"""


@pytest.mark.slow
def test_the_library_gives_simulated_devices_their_spare_threads():
  """Imported before JAX starts, flax_tp sets NPROC for the devices XLA_FLAGS asks for (a
  library generate() on 8 devices without it aborted in an all-reduce); imported after,
  make_mesh refuses in one clear line instead of risking the deadlock; a user's NPROC
  stays."""
  flags = "--xla_force_host_platform_device_count=8"
  out = subprocess.run([sys.executable, "-c", THREADS], env=_env(XLA_FLAGS=flags),
                       capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == str(max(os.cpu_count() or 1, 16)), out.stderr
  out = subprocess.run([sys.executable, "-c", THREADS], env=_env(XLA_FLAGS=flags, NPROC="3"),
                       capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == "3"
  late = subprocess.run([sys.executable, "-c", LATE], env=_env(XLA_FLAGS=flags),
                        capture_output=True, text=True, timeout=120)
  if (os.cpu_count() or 1) >= 16:
    assert "refused" not in late.stdout  # enough cores: XLA's default pool is big enough
  else:
    assert late.stdout.startswith("refused: 8 simulated CPU devices share XLA's default "
                                  "thread pool") and "Set NPROC=16" in late.stdout, late
