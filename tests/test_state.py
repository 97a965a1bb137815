"""unshard / load_unsharded: moving params between parallel and plain Flax modules."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import F32, assert_padding_zero, assert_state_close, random
from jax.sharding import PartitionSpec as P

import flax_tp


class Block(nnx.Module):
  def __init__(self, *, mesh=None, rngs):
    if mesh is None:
      self.embed = nnx.Embed(257, 6, rngs=rngs)
      self.up = nnx.Linear(6, 10, rngs=rngs)
      self.down = nnx.Linear(10, 6, rngs=rngs)
    else:
      self.embed = flax_tp.VocabParallelEmbedding(257, 6, mesh=mesh, rngs=rngs)
      self.up = flax_tp.ColumnParallelDense(6, 10, mesh=mesh, rngs=rngs)
      self.down = flax_tp.RowParallelDense(10, 6, mesh=mesh, rngs=rngs)
    self.norm = nnx.LayerNorm(6, rngs=rngs)
    if mesh is not None:
      flax_tp.replicate_on_mesh(self, mesh)

  def __call__(self, ids):
    return self.down(self.up(self.norm(self.embed(ids))))


apply = nnx.jit(lambda module, ids: module(ids))  # one program, not one per operation


@pytest.mark.parametrize("mesh_spec", ["1x3", "2x4"])
def test_unshard_update_flax_module(meshes, mesh_spec):
  parallel = Block(mesh=meshes[mesh_spec], rngs=nnx.Rngs(0))
  flax_module = Block(rngs=nnx.Rngs(7))  # different values, same structure
  dense = flax_tp.unshard(parallel)
  assert dense["up"]["kernel"][...].shape == (6, 10)
  assert "tp_layout" not in dense["up"]["kernel"].get_metadata()  # plain Params
  nnx.update(flax_module, dense)
  ids = jnp.array([[0, 5, 256]])
  np.testing.assert_allclose(apply(flax_module, ids), apply(parallel, ids), **F32)
  assert_state_close(parallel, flax_module, rtol=0, atol=0)


@pytest.mark.parametrize("mesh_spec", ["1x8", "1x3"])
def test_load_unsharded_from_flax(meshes, mesh_spec):
  parallel = Block(mesh=meshes[mesh_spec], rngs=nnx.Rngs(0))
  flax_module = Block(rngs=nnx.Rngs(7))
  flax_tp.load_unsharded(parallel, flax_module)
  assert_state_close(parallel, flax_module, rtol=0, atol=0)
  assert assert_padding_zero(parallel) >= 3
  assert parallel.norm.scale[...].sharding.mesh == meshes[mesh_spec]
  assert parallel.up.kernel[...].sharding.spec == nnx.get_partition_spec(
      nnx.state(parallel))["up"]["kernel"].get_value()
  x = jnp.array([[3, 200]])
  np.testing.assert_allclose(apply(parallel, x), apply(flax_module, x), **F32)


def test_load_unsharded_rejects_mismatch(meshes):
  layer = flax_tp.ColumnParallelDense(6, 10, mesh=meshes["1x3"], rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"param .*\(9,\), expected \(10,\)"):
    flax_tp.load_unsharded(layer, nnx.Linear(6, 9, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="missing"):
    flax_tp.load_unsharded(layer, nnx.Linear(6, 10, use_bias=False, rngs=nnx.Rngs(0)))


def test_unshard_a_state_and_random_input(meshes):
  layer = flax_tp.RowParallelDense(10, 3, mesh=meshes["2x4"], rngs=nnx.Rngs(0))
  dense = flax_tp.unshard(nnx.state(layer))
  ref = nnx.Linear(10, 3, rngs=nnx.Rngs(0))
  assert_state_close(dense, ref, rtol=0, atol=0)
  np.testing.assert_allclose(layer(random((2, 10))), ref(random((2, 10))), **F32)


class Blocks(nnx.Module):
  """Three ``Block``s in a list, or stacked on a leading axis (``flax_tp.stack_layers``)."""

  def __init__(self, *, mesh=None, stacked=False, rngs):
    blocks = [Block(mesh=mesh, rngs=rngs) for _ in range(3)]
    self.blocks = flax_tp.stack_layers(blocks) if stacked else nnx.List(blocks)


@pytest.mark.parametrize("mesh_spec", ["1x3", "2x4"])
def test_stacked_layers_are_one_param_per_layer_outside(meshes, mesh_spec, tmp_path):
  """A stacked param is ``[layers, ...]`` on the mesh, but ``unshard``,
  ``load_unsharded`` and checkpoints see each layer's param at its per-layer path,
  so stacked and unstacked modules exchange params and checkpoints (any mesh)."""
  from flax_tp.checkpoint import Checkpointer
  mesh = meshes[mesh_spec]
  stacked = Blocks(mesh=mesh, stacked=True, rngs=nnx.Rngs(0))
  listed = Blocks(mesh=mesh, rngs=nnx.Rngs(0))
  kernel = stacked.blocks.up.kernel
  assert kernel[...].shape == (3, 6, listed.blocks[0].up.kernel[...].shape[1])
  assert kernel[...].sharding.spec == P(None, None, "model")
  assert assert_padding_zero(stacked) >= 3
  # Same init, whatever the storage.
  assert_state_close(stacked, flax_tp.unshard(listed), rtol=0, atol=0)

  flax_module = Blocks(rngs=nnx.Rngs(7))
  flax_tp.load_unsharded(stacked, flax_module)
  assert_state_close(stacked, flax_module, rtol=0, atol=0)
  assert kernel[...].sharding.spec == P(None, None, "model")

  checkpoints = Checkpointer(tmp_path)
  checkpoints.save(1, {"params": nnx.state(stacked, nnx.Param)}, {})
  restored_listed = Blocks(mesh=meshes["1x8"], rngs=nnx.Rngs(3))
  trees, _ = checkpoints.restore({"params": nnx.state(restored_listed, nnx.Param)})
  nnx.update(restored_listed, trees["params"])
  assert_state_close(restored_listed, flax_module, rtol=0, atol=0)

  checkpoints.save(2, {"params": nnx.state(restored_listed, nnx.Param)}, {})
  restored_stacked = Blocks(mesh=mesh, stacked=True, rngs=nnx.Rngs(5))
  trees, _ = checkpoints.restore({"params": nnx.state(restored_stacked, nnx.Param)})
  nnx.update(restored_stacked, trees["params"])
  assert_state_close(restored_stacked, flax_module, rtol=0, atol=0)
  assert assert_padding_zero(restored_stacked) >= 3


def test_stack_layers_needs_params_on_a_mesh(meshes):
  with pytest.raises(ValueError, match=r"param \('(bias|kernel)',\) is not on a mesh"):
    flax_tp.stack_layers([nnx.Linear(2, 3, rngs=nnx.Rngs(0)) for _ in range(2)])
