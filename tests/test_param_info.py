"""flax_tp.param_info: the one record of what flax_tp knows of a param."""

import dataclasses

import pytest
from flax import nnx

import flax_tp
from flax_tp.param_info import (
  EXPERT_SPLIT,
  FLAX_TP_KEYS,
  FSDP_SPLIT,
  MODEL_SPLIT,
  ParamInfo,
  Split,
  record,
)


def test_a_column_kernel_records_its_layout_and_placement():
  mesh = flax_tp.make_mesh("1x3")
  layer = flax_tp.ColumnParallelDense(4, 10, mesh=mesh, rngs=nnx.Rngs(0))
  info = ParamInfo.of(layer.kernel)
  assert info.mesh == mesh and info.names == (None, "model") and info.is_split
  assert info.splits == (Split(MODEL_SPLIT, 1, flax_tp.ShardLayout(10, 3)),)
  assert info.layout == flax_tp.ShardLayout(10, 3) and info.dim == 1
  assert not info.is_stacked and not info.over_data and not info.fsdp_per_block
  assert info.logical_shape(layer.kernel[...].shape) == (4, 10)
  assert info.sharding.mesh == mesh and tuple(info.sharding.spec) == (None, "model")


def test_record_writes_and_removes_fields_under_the_same_keys():
  var = nnx.Param(1.0)
  assert ParamInfo.of(var) == ParamInfo() and ParamInfo.of(3.0) == ParamInfo()
  record(var, names=(None,), splits=(Split(FSDP_SPLIT, 0),), layers=4, layer_at=-2,
         fsdp_per_block=True)
  meta = var.get_metadata()
  assert (meta["tp_layers"], meta["tp_layer_at"], meta["fsdp_dim"], meta["fsdp_per_block"],
          meta["out_sharding"]) == (4, -2, 0, True, (None,))
  info = ParamInfo.of(var)
  assert info.is_stacked and info.over_data and info.fsdp_per_block and info.fsdp_dim == 0
  record(var, splits=info.without_split(FSDP_SPLIT), fsdp_per_block=False)
  assert "fsdp_dim" not in var.get_metadata() and "fsdp_per_block" not in var.get_metadata()
  assert set(FLAX_TP_KEYS) == {"tp_layout", "tp_dim", "tp_layers", "tp_layer_at",
                               "tp_first_layer", "fsdp_dim", "fsdp_per_block", "ep_layout",
                               "ep_dim", "tp_layer_slots"}
  with pytest.raises(KeyError):
    record(var, no_such_field=1)


def test_splits_are_one_tuple_whatever_their_kind():
  """A param's splits of every kind, in one tuple: written under each kind's keys, read
  back, shifted by a stacked layer axis, and padded and unpadded alike."""
  import numpy as np
  var = nnx.Param(np.zeros((4, 3, 8), np.float32))
  experts, ffn = flax_tp.ShardLayout(3, 2), flax_tp.ShardLayout(7, 4)
  splits = (Split(EXPERT_SPLIT, 0, experts), Split(MODEL_SPLIT, 2, ffn))
  record(var, names=(("data",), None, "model"), splits=splits)
  meta = var.get_metadata()
  assert (meta["ep_layout"], meta["ep_dim"], meta["tp_layout"], meta["tp_dim"]) == (
      experts, 0, ffn, 2)
  info = ParamInfo.of(var)
  assert set(info.splits) == set(splits) and info.split(FSDP_SPLIT) is None
  assert (info.expert_layout, info.expert_dim, info.layout, info.dim) == (experts, 0, ffn, 2)
  logical = np.arange(3 * 3 * 7, dtype=np.float32).reshape(3, 3, 7)
  stored = info.pad(logical)
  assert stored.shape == (experts.padded_size * 2, 3, ffn.padded_size * 4)
  assert info.logical_shape(stored.shape) == (3, 3, 7)
  np.testing.assert_array_equal(info.unpad(stored), logical)
  stacked = dataclasses.replace(info, names=(None,) + info.names, layers=2,
                                splits=tuple(s.shifted(1) for s in info.splits))
  assert {s.dim for s in stacked.splits} == {1, 3} and stacked.per_layer() == info
  with pytest.raises(ValueError, match="at most one split of each kind"):
    record(var, splits=splits + (Split(MODEL_SPLIT, 1, ffn),))
  with pytest.raises(ValueError, match="split kind must be one of"):
    Split("context", 1, ffn)
  with pytest.raises(ValueError, match="'fsdp' split has no layout"):
    Split(FSDP_SPLIT, 1, ffn)
