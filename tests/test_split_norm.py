"""flax_tp.SplitRMSNorm (OLMo 2/3's q/k norms over the whole projection) against
``nnx.RMSNorm`` over the same width: outputs, the input's and the scale's gradients,
with heads split unevenly and kv heads copied to several devices; and its one
``[..., 1]`` all-reduce each way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_tp

HEAD_DIM = 4


def _norms(mesh, heads, kv_heads, keys):
  """The split norm over q's (``keys=False``: heads over "model" in whole heads) or k's
  width (a ``KVHeadLayout``), and ``nnx.RMSNorm`` over it, with the same scale drawn
  away from one."""
  model = mesh.shape["model"]
  width = (kv_heads if keys else heads) * HEAD_DIM
  layout = (flax_tp.KVHeadLayout(width, model, HEAD_DIM, num_heads=heads) if keys else
            flax_tp.ShardLayout(width, model, HEAD_DIM))
  norm = flax_tp.SplitRMSNorm(width, mesh=mesh, layout=layout, epsilon=1e-5,
                              rngs=nnx.Rngs(0))
  scale = 1.0 + jax.random.normal(jax.random.key(3), (width,))
  norm.scale.set_value(jax.device_put(layout.pad(scale, 0), norm.scale[...].sharding))
  plain = nnx.RMSNorm(width, epsilon=1e-5, rngs=nnx.Rngs(0))
  plain.scale.set_value(scale)
  return norm, plain


@pytest.mark.parametrize("mesh_spec,heads,kv_heads,keys", [
    ("2x4", 6, 2, False),  # 6 heads over 4: 2, 2, 1, 1 (padded)
    ("2x4", 6, 2, True),  # kv heads 0, 0-1, 1, 1: copies counted once
    ("1x8", 6, 3, True),
    ("1x3", 6, 6, True),
    ("1x1", 6, 2, False)])
def test_split_rmsnorm_equals_nnx_rmsnorm(meshes, mesh_spec, heads, kv_heads, keys):
  norm, plain = _norms(meshes[mesh_spec], heads, kv_heads, keys)
  assert norm.layout.replicated == (keys and mesh_spec in ("2x4", "1x8"))
  x = jax.random.normal(jax.random.key(1), (2, 5, plain.scale[...].shape[0]))
  np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(norm, x), plain(x), rtol=1e-5,
                             atol=1e-6)
  loss = lambda m, x: jnp.sum(jnp.sin(3 * m(x)))
  grads, dx = jax.jit(nnx.grad(loss, argnums=(0, 1)))(norm, x)
  want, want_dx = nnx.grad(loss, argnums=(0, 1))(plain, x)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(flax_tp.unshard(grads)["scale"][...], want["scale"][...],
                             rtol=1e-5, atol=1e-5)
  stored = np.asarray(grads["scale"][...])
  # the padding's gradient is zero; a copied kv head's copies get the same (summed) one
  assert np.all(stored[np.asarray(norm.layout.stored_positions()).ravel()
                       == norm.layout.size] == 0)


def test_one_small_all_reduce_each_way(meshes):
  """Inside a map on 2x4: the forward sums each row's squares over "model" ([b, s, 1]),
  and the backward sums the mean's cotangent the same way; nothing else is sent."""
  from jax.sharding import PartitionSpec as P

  from flax_tp.hlo import collectives
  mesh = meshes["2x4"]
  norm, _ = _norms(mesh, 6, 2, keys=False)
  graphdef, state = nnx.split(norm)
  x = jax.random.normal(jax.random.key(1), (2, 5, 4 * norm.layout.padded_size))

  def local(state, x):
    return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x)))

  step = jax.jit(jax.grad(jax.shard_map(
      lambda s, x: jax.lax.psum(local(s, x), "model"), mesh=mesh,
      in_specs=(nnx.get_partition_spec(state), P(None, None, "model")), out_specs=P()),
      argnums=1))
  found = collectives(step.lower(state, x).compile().as_text(), mesh)
  sums = [c for c in found if c.kind == "all-reduce" and c.axes == ("model",)]
  assert sorted(shape for c in sums for _, shape in c.operands) == [(2, 5, 1)] * 2
  assert len(found) == len(sums)
