"""flax_tp.host_memory: XLA:CPU's per-step buffers stay with the process (issue 41)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flax_tp import host_memory

ROOT = Path(__file__).resolve().parent.parent

# In a fresh process that has not started JAX (whose threads hold malloc arenas of their
# own): make the policy's choice, then from one new thread (a malloc arena of its own, as
# XLA:CPU's pool threads have) and from the main thread (glibc's main arena) allocate,
# touch and free four 20 MiB blocks per round, and count the page faults each round takes.
# Without the policy glibc unmaps a thread arena's emptied heaps and trims the main
# arena's free top after each round, so the blocks' pages fault in again every round.
_CHURN = r"""
import ctypes, json, resource, threading
from flax_tp import host_memory
kept = host_memory.keep_freed_host_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rounds(faults, size=20 << 20):
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(size) for _ in range(4)]
        for block in blocks:
            libc.memset(block, 1, size)
        for block in blocks:
            libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
in_thread, in_main = [], []
thread = threading.Thread(target=rounds, args=(in_thread,))
thread.start(); thread.join()
rounds(in_main)
print(json.dumps({"kept": kept, "faults": {"thread": in_thread, "main": in_main}}))
"""

_PAGES_PER_BLOCK = (20 << 20) // os.sysconf("SC_PAGE_SIZE")


def _churn(setting: str) -> dict:
  env = dict(os.environ, FLAX_TP_KEEP_FREED_MEMORY=setting, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  out = subprocess.run([sys.executable, "-c", _CHURN], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="the policy is glibc's malloc's")
def test_freed_host_memory_is_kept_for_the_next_step():
  """With the policy a block freed after one round is reused by the next: no page faults
  after the first round. Turned off, the same rounds fault the blocks' pages in again
  every round, which is what each step of a CPU mesh paid."""
  kept, off = _churn("1"), _churn("0")
  assert kept["kept"] is True and off["kept"] is False
  for arena in ("thread", "main"):
    assert kept["faults"][arena][0] >= 4 * _PAGES_PER_BLOCK * 0.9  # the first touch
    assert max(kept["faults"][arena][1:]) < 0.02 * _PAGES_PER_BLOCK, kept["faults"]
    assert min(off["faults"][arena][2:]) >= 0.9 * _PAGES_PER_BLOCK, off["faults"]


def test_a_cpu_trainer_sets_the_policy(monkeypatch):
  """The step's Trainer turns the policy on for a CPU mesh (where glibc has it), and
  leaves malloc alone when the environment says 0."""
  from flax import nnx

  import flax_tp
  from models.config import TransformerConfig
  from models.transformer import Transformer
  from train.step import Trainer, make_optimizer

  cfg = TransformerConfig(vocab_size=16, d_model=8, num_heads=2, head_dim=4, d_ff=16,
                          num_layers=1, max_seq_len=8)

  def trainer():
    return Trainer(Transformer(cfg, mesh=flax_tp.make_mesh("1x2"), rngs=nnx.Rngs(0)),
                   make_optimizer(lr=1e-3, steps=10, grad_clip=0.0))

  monkeypatch.delenv(host_memory.ENV_VAR, raising=False)
  assert trainer().keeps_freed_host_memory is (host_memory._glibc() is not None)
  assert host_memory.keep_freed_host_memory() is (host_memory._glibc() is not None)
  monkeypatch.setattr(host_memory, "_kept", None)  # as in a fresh process
  monkeypatch.setenv(host_memory.ENV_VAR, "0")
  assert trainer().keeps_freed_host_memory is False


@pytest.mark.parametrize("setting", ["yes", "", "2", " 1"])
def test_a_bad_setting_is_refused_by_name(monkeypatch, capsys, setting):
  """Not 0 or 1: the library raises naming the value, the CLIs exit 2 with one line
  before any work starts."""
  monkeypatch.setenv(host_memory.ENV_VAR, setting)
  with pytest.raises(ValueError, match=f"FLAX_TP_KEEP_FREED_MEMORY={setting!r}; expected 0"):
    host_memory._apply()
  from train.run import main
  assert main(["--mesh", "1x2"]) == 2
  err = capsys.readouterr().err
  assert err == f"train/run.py: error: {host_memory.setting_problem()}\n"
  assert err.count("\n") == 1


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_good_settings_pass(monkeypatch, setting):
  if setting is None:
    monkeypatch.delenv(host_memory.ENV_VAR, raising=False)
  else:
    monkeypatch.setenv(host_memory.ENV_VAR, setting)
  assert host_memory.setting_problem() is None
