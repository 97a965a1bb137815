import jax
import pytest
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


@pytest.mark.parametrize("spec", ["2x", "0x4", "abc", "2x4x1", (2,), (2, 0), "-1x2"])
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
