"""Collectives against the same computation on the unsharded array, gradients included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flax_tp


@pytest.fixture(scope="module")
def mesh():
  return flax_tp.make_mesh("2x4")


X = jax.random.normal(jax.random.key(0), (8, 6))  # 4 blocks of 2 rows, one per device
WEIGHT = jax.random.normal(jax.random.key(1), (2, 6))


def sharded(fn, mesh, out_specs=P()):
  """``fn`` on row blocks of ``x`` (one per model device), replicated over data."""
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("model"), out_specs=out_specs))


@pytest.mark.parametrize("op,ref", [("sum", jnp.sum), ("mean", jnp.mean), ("max", jnp.max),
                                    ("min", jnp.min)])
def test_all_reduce(mesh, op, ref):
  blocks = X.reshape(4, 2, 6)

  def par(x):
    return sharded(lambda b: flax_tp.all_reduce(b, op), mesh)(x)

  def dense(x):
    return ref(x.reshape(4, 2, 6), axis=0)

  np.testing.assert_allclose(par(X), dense(X), rtol=1e-6)
  # A weighted sum makes every element's cotangent different.
  g_par = jax.grad(lambda x: jnp.sum(par(x) * WEIGHT))(X)
  g_ref = jax.grad(lambda x: jnp.sum(dense(x) * WEIGHT))(X)
  np.testing.assert_allclose(g_par, g_ref, rtol=1e-6)
  assert blocks.shape == (4, 2, 6)


def test_all_reduce_max_ties_split_gradient(mesh):
  x = jnp.ones((4, 1))
  g = jax.grad(lambda x: sharded(lambda b: flax_tp.all_reduce(b, "max"), mesh)(x).sum())(x)
  np.testing.assert_allclose(g, jnp.full((4, 1), 0.25))


def test_all_gather(mesh):
  def par(x):
    return sharded(lambda b: flax_tp.all_gather(b * 2.0, axis=0), mesh)(x)

  np.testing.assert_allclose(par(X), X * 2.0)
  w = jax.random.normal(jax.random.key(2), X.shape)
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(par(x) * w))(X), 2.0 * w, rtol=1e-6)


def test_all_gather_inner_axis(mesh):
  f = jax.jit(jax.shard_map(lambda b: flax_tp.all_gather(b, axis=-1), mesh=mesh,
                            in_specs=P(None, "model"), out_specs=P()))
  y = jnp.arange(16.0).reshape(2, 8)
  np.testing.assert_array_equal(f(y), y)


def test_reduce_scatter(mesh):
  # Every device holds an [8, 6] array; the sum is scattered in row blocks.
  stack = jax.random.normal(jax.random.key(3), (4, 8, 6))

  def par(s):
    f = jax.jit(jax.shard_map(lambda b: flax_tp.reduce_scatter(b[0], axis=0), mesh=mesh,
                              in_specs=P("model"), out_specs=P("model")))
    return f(s)

  np.testing.assert_allclose(par(stack), stack.sum(0), rtol=1e-5)
  w = jax.random.normal(jax.random.key(4), (8, 6))
  g = jax.grad(lambda s: jnp.sum(par(s) * w))(stack)
  np.testing.assert_allclose(g, jnp.broadcast_to(w, stack.shape), rtol=1e-6)


def test_reduce_scatter_indivisible(mesh):
  f = jax.shard_map(lambda b: flax_tp.reduce_scatter(b, axis=0), mesh=mesh, in_specs=P(),
                    out_specs=P("model"))
  with pytest.raises(ValueError, match="not divisible"):
    f(jnp.ones((6, 2)))


def test_unknown_op(mesh):
  with pytest.raises(ValueError, match="unknown all_reduce op 'prod'"):
    sharded(lambda b: flax_tp.all_reduce(b, "prod"), mesh)(X)


@pytest.mark.parametrize("call", [
    lambda: flax_tp.all_reduce(X), lambda: flax_tp.all_gather(X), lambda: flax_tp.reduce_scatter(X),
    lambda: flax_tp.copy_all_to_parallel([X], ("model",)),
])
def test_outside_mapped_context(call):
  with pytest.raises(ValueError, match="'model' is not bound here.*shard_map"):
    call()


def test_wrong_axis_name_inside_map(mesh):
  with pytest.raises(ValueError, match="'tensor' is not bound"):
    sharded(lambda b: flax_tp.all_reduce(b, axis_name="tensor"), mesh)(X)


# -- copy_all_to_parallel: data parallelism's gradient sums, packed ------------------------

A = jax.random.normal(jax.random.key(3), (3, 5))  # replicated
B = jax.random.normal(jax.random.key(4), (5,))  # replicated
C = jax.random.normal(jax.random.key(5), (8, 5))  # split over model
FROZEN = jax.random.normal(jax.random.key(6), (5,))  # replicated, never differentiated
TOKENS = jax.random.normal(jax.random.key(7), (8, 3))  # split over data


def _loss(mesh, packed: bool):
  """The summed squares of a two-layer map of TOKENS, data x model parallel; A, B and C
  marked per-replica over "data" together (packed) or one by one."""
  from flax_tp.collectives import copy_all_to_parallel, copy_to_parallel

  def local(a, b, c, frozen, x):
    if packed:
      a, b, c = copy_all_to_parallel([a, b, c], ("data",))
    else:
      a, b, c = (copy_to_parallel(v, ("data",)) for v in (a, b, c))
    frozen = copy_to_parallel(frozen, ("data",))
    hidden = jnp.tanh(x @ a + b + frozen)  # [4, 5]
    out = hidden @ flax_tp.copy_to_parallel(c, "model").T  # [4, 2]: this device's columns
    return flax_tp.all_reduce(jnp.sum(out ** 2), "sum", ("data", "model"))

  mapped = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("model"), P(), P("data")),
                         out_specs=P())
  return lambda a, b, c: mapped(a, b, c, FROZEN, TOKENS)


def _dense_loss(a, b, c):
  return jnp.sum((jnp.tanh(TOKENS @ a + b + FROZEN) @ c.T) ** 2)


def _data_operands(fn, mesh):
  from flax_tp.hlo import collectives
  text = jax.jit(jax.grad(fn, argnums=(0, 1, 2))).lower(A, B, C).compile().as_text()
  return sorted(shape for c in collectives(text, mesh) if c.axes == ("data",)
                for _, shape in c.operands)


def test_packed_gradient_sums_equal_one_all_reduce_per_array(mesh):
  """The same gradients bit for bit (and the one-device ones), sent as one array per
  set of axes the cotangents vary over instead of one per param; the frozen param, left
  out of the pack, has no cotangent sent."""
  grads = {packed: jax.jit(jax.grad(_loss(mesh, packed), argnums=(0, 1, 2)))(A, B, C)
           for packed in (False, True)}
  for plain, packed in zip(grads[False], grads[True], strict=True):
    np.testing.assert_array_equal(packed, plain)
  for packed, dense in zip(grads[True], jax.grad(_dense_loss, argnums=(0, 1, 2))(A, B, C),
                           strict=True):
    np.testing.assert_allclose(packed, dense, rtol=1e-5, atol=1e-6 * np.abs(dense).max())
  assert _data_operands(_loss(mesh, False), mesh) == sorted([(3, 5), (5,), (2, 5)])
  # A and B (the same on every model device) in one array, C's shard in another
  assert _data_operands(_loss(mesh, True), mesh) == sorted([(15 + 5,), (2 * 5,)])


def test_packed_gradient_sums_are_cut_into_buckets(mesh, monkeypatch):
  import flax_tp.collectives as collectives_module
  monkeypatch.setattr(collectives_module, "BUCKET_ELEMENTS", 16)
  assert _data_operands(_loss(mesh, True), mesh) == sorted([(15,), (5,), (10,)])
