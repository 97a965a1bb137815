"""flax_tp.run_lock and train/resume.py: a run owns its --checkpoint-dir while it runs."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SHORT_RUN_FLAGS, subprocess_env, tiny_state, write_small_corpus

from flax_tp.checkpoint import Checkpointer
from flax_tp.run_lock import FolderInUse, FolderLock
from train.run import main

ROOT = Path(__file__).resolve().parent.parent


FLAGS = SHORT_RUN_FLAGS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_small_corpus(tmp_path_factory.mktemp("data") / "corpus.py", files=10,
                            max_bytes=40_000)






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
  Checkpointer(ck).save(2, tiny_state(), {})
  before = {p: p.stat().st_mtime_ns for p in ck.rglob("*")}
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ck)], env=subprocess_env(),
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
