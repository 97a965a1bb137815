"""flax_tp.params: layers and models pickle back onto their mesh."""

import pickle

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_tp
from models.config import TransformerConfig
from models.transformer import Transformer


def test_layers_and_models_pickle_onto_their_mesh(meshes):
  mesh = meshes["2x4"]
  model = Transformer(TransformerConfig.tiny(), mesh=mesh, rngs=nnx.Rngs(0))
  layer = flax_tp.RowParallelDense(6, 5, mesh=meshes["1x3"], rngs=nnx.Rngs(1))
  ids = jnp.ones((2, 8), jnp.int32)
  forward = nnx.jit(lambda m, x: m(x))
  again = pickle.loads(pickle.dumps(model))
  np.testing.assert_array_equal(forward(again, ids), forward(model, ids))
  for (_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(again)),
                            nnx.to_flat_state(nnx.state(model)), strict=True):
    assert a[...].sharding.is_equivalent_to(b[...].sharding, a[...].ndim)
  layer2 = pickle.loads(pickle.dumps(layer))
  x = jnp.ones((3, 6))
  np.testing.assert_array_equal(forward(layer2, x), forward(layer, x))
  assert layer2.kernel[...].sharding == layer.kernel[...].sharding
  from flax_tp.mesh import _rebuild_mesh
  with pytest.raises(ValueError, match=r"devices \[999\].*Checkpointer"):
    _rebuild_mesh(("data", "model"), [0, 999], (1, 2), tuple(mesh.axis_types))
