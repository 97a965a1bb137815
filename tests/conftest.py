"""Test set-up: 8 simulated CPU devices, set before jax is first imported."""

import os
import tempfile

# A busy host may hold a simulated device's thread back for a while: let collectives
# wait longer than XLA's 40 s before it aborts the process (as train/run.py does).
#
# The tests' programs are small and run once or twice; compiling them is most of the
# suite's time. XLA:CPU's LLVM backend therefore optimises the code it emits less
# (FAST_COMPILE_XLA_FLAGS: ~35% less time per test file), emits fusions with its older
# (LLVM IR) emitters rather than the MLIR fusion emitters, and compiles a program as one
# LLVM module (with the first two: tests/test_context.py's fast tests 103 s -> 69 s, cache
# off). The collectives and the sharding are untouched: what the tests assert about a
# program's communication is what a user's run compiles. The older emitters let XLA:CPU's
# fusion pass group a few elementwise ops differently (tiny's 2x4 step: 336 fusions
# against 353, the same all-reduces), so a result may round differently in its last bit,
# on both sides of every comparison alike; the bitwise numerics goldens are therefore
# computed in a child process without these flags (tests/golden/record.py). A caller's
# own XLA_FLAGS come after, and win.
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0",
                          "--xla_llvm_disable_expensive_passes=true",
                          "--xla_cpu_use_fusion_emitters=false",
                          "--xla_cpu_parallel_codegen_split_count=1")
os.environ["XLA_FLAGS"] = " ".join(
    (*FAST_COMPILE_XLA_FLAGS, os.environ.get("XLA_FLAGS", ""),
     "--xla_force_host_platform_device_count=8",
     "--xla_cpu_collective_call_terminate_timeout_seconds=600")).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A spare XLA:CPU pool thread per simulated device, as train/run.py gives its runs (see
# flax_tp.mesh.cpu_thread_pool_size: collectives hold their threads while they wait).
os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 2 * 8)))
# Token caches of the tests' corpora go to a folder of this run, not the user's.
os.environ.setdefault("FLAX_TP_CACHE", tempfile.mkdtemp(prefix="flax_tp_test_cache_"))
# jax's persistent compilation cache (most of the suite's time is XLA:CPU compiling): in
# the checkout's own .jax_cache/ (git-ignored, never the user's home), shared by both
# xdist workers, both lanes of .ci/run and the processes the tests spawn (they inherit
# these variables). Every program is kept, however quick to compile. A cached program is
# the same executable: the numerics goldens compare bit for bit through it. A caller's
# own JAX_COMPILATION_CACHE_DIR is kept; "" turns the cache off.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                   ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after XLA_FLAGS, as it must be)
import pytest  # noqa: E402

import flax_tp  # noqa: E402


@pytest.fixture(scope="session")
def meshes():
  """The meshes every layer test runs on; "1x3" is a sub-mesh of 3 devices."""
  return {spec: flax_tp.make_mesh(spec) for spec in ("1x1", "1x2", "2x4", "1x8", "1x3", "4x2", "8x1")}


def pytest_configure(config):
  assert jax.device_count() == 8, "tests need 8 simulated devices (XLA_FLAGS set too late?)"


# FLAX_TP_TEST_COMPILE_REPORT=PATH: per test file, how many programs XLA compiled in this
# process (spawned processes not counted), the seconds it took, and the persistent
# cache's hits, written as JSON to PATH.<worker>.<pid> when the session ends (the README's
# table of where the suite's time goes).
_COMPILES = {}
_CURRENT = [None]
if os.environ.get("FLAX_TP_TEST_COMPILE_REPORT"):
  from jax import monitoring

  def _on_duration(event, seconds, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      entry = _COMPILES.setdefault(_CURRENT[0], [0, 0.0, 0])
      entry[0] += 1
      entry[1] += seconds

  def _on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
      _COMPILES.setdefault(_CURRENT[0], [0, 0.0, 0])[2] += 1

  monitoring.register_event_duration_secs_listener(_on_duration)
  monitoring.register_event_listener(_on_event)


def pytest_runtest_setup(item):
  _CURRENT[0] = item.location[0]


def pytest_sessionfinish(session):
  path = os.environ.get("FLAX_TP_TEST_COMPILE_REPORT")
  if path and _COMPILES:
    import json
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{path}.{worker}.{os.getpid()}", "w", encoding="utf-8") as f:
      json.dump({str(k): v for k, v in _COMPILES.items()}, f, indent=1)
