"""flax_tp.param_info: the one record of what flax_tp knows of a param."""

import pytest
from flax import nnx

import flax_tp
from flax_tp.param_info import FLAX_TP_KEYS, ParamInfo, record


def test_a_column_kernel_records_its_layout_and_placement():
  mesh = flax_tp.make_mesh("1x3")
  layer = flax_tp.ColumnParallelDense(4, 10, mesh=mesh, rngs=nnx.Rngs(0))
  info = ParamInfo.of(layer.kernel)
  assert info.mesh == mesh and info.names == (None, "model") and info.is_split
  assert info.layout == flax_tp.ShardLayout(10, 3) and info.dim == 1
  assert not info.is_stacked and not info.over_data and not info.fsdp_per_block
  assert info.logical_shape(layer.kernel[...].shape) == (4, 10)
  assert info.sharding.mesh == mesh and tuple(info.sharding.spec) == (None, "model")


def test_record_writes_and_removes_fields_under_the_same_keys():
  var = nnx.Param(1.0)
  assert ParamInfo.of(var) == ParamInfo() and ParamInfo.of(3.0) == ParamInfo()
  record(var, names=(None,), layers=4, layer_at=-2, fsdp_dim=0, fsdp_per_block=True)
  meta = var.get_metadata()
  assert (meta["tp_layers"], meta["tp_layer_at"], meta["fsdp_dim"], meta["fsdp_per_block"],
          meta["out_sharding"]) == (4, -2, 0, True, (None,))
  info = ParamInfo.of(var)
  assert info.is_stacked and info.over_data and info.fsdp_per_block
  record(var, fsdp_dim=None, fsdp_per_block=False)
  assert "fsdp_dim" not in var.get_metadata() and "fsdp_per_block" not in var.get_metadata()
  assert set(FLAX_TP_KEYS) == {"tp_layout", "tp_dim", "tp_layers", "tp_layer_at",
                               "tp_first_layer", "fsdp_dim", "fsdp_per_block", "ep_layout",
                               "ep_dim", "tp_layer_slots"}
  with pytest.raises(KeyError):
    record(var, no_such_field=1)
