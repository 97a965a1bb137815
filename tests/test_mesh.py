import os
import subprocess
import sys

import jax
import pytest
from helpers import subprocess_env
from jax.sharding import AxisType

import flax_tp


@pytest.mark.parametrize("spec,shape", [("2x4", (2, 4)), ((1, 8), (1, 8)), ("1x3", (1, 3)),
                                        (" 4X2 ", (4, 2))])
def test_make_mesh(spec, shape):
  mesh = flax_tp.make_mesh(spec)
  assert mesh.axis_names == ("data", "model")
  assert tuple(mesh.shape.values()) == shape
  assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
  # The first D*M devices, consecutive devices along "model".
  assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()[:shape[0] * shape[1]]]


def test_make_mesh_explicit_devices():
  devices = jax.devices()[5:8]
  mesh = flax_tp.make_mesh("1x3", devices=devices)
  assert list(mesh.devices.flat) == devices


@pytest.mark.parametrize("spec", ["2x", "0x4", "abc", "2x4x1x1", (2,), (2, 0), "-1x2", "2x0x4",
                                  (True, 8), "data=2,data=4", "pipe=2,model=4",
                                  "data=0,model=8", "data=-2", "data:2", "data=2,,model=4"])
def test_bad_spec(spec):
  with pytest.raises(ValueError, match="bad mesh spec") as err:
    flax_tp.make_mesh(spec)
  assert repr(spec) in str(err.value)


def test_too_many_devices_names_spec_and_hint():
  with pytest.raises(ValueError) as err:
    flax_tp.make_mesh("3x3")
  message = str(err.value)
  assert "'3x3'" in message and "9 devices" in message and "found 8" in message
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=9" in message


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
  out = subprocess.run([sys.executable, "-c", THREADS], env=subprocess_env(XLA_FLAGS=flags),
                       capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == str(max(os.cpu_count() or 1, 16)), out.stderr
  out = subprocess.run([sys.executable, "-c", THREADS], env=subprocess_env(XLA_FLAGS=flags, NPROC="3"),
                       capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == "3"
  late = subprocess.run([sys.executable, "-c", LATE], env=subprocess_env(XLA_FLAGS=flags),
                        capture_output=True, text=True, timeout=120)
  if (os.cpu_count() or 1) >= 16:
    assert "refused" not in late.stdout  # enough cores: XLA's default pool is big enough
  else:
    assert late.stdout.startswith("refused: 8 simulated CPU devices share XLA's default "
                                  "thread pool") and "Set NPROC=16" in late.stdout, late
