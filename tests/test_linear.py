"""ColumnParallelDense / RowParallelDense against nnx.Linear built from the same seed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
  F32,
  adamw_step,
  assert_padding_zero,
  assert_state_close,
  forward_and_grads,
  inside_shard_map,
  random,
)
from jax.sharding import PartitionSpec as P

import flax_tp

MESHES = ["1x1", "2x4", "1x8", "1x3"]  # 1x2: an even split, as 2x4's
# (in, out): even over every axis; 10 and 7 uneven; 3 smaller than the axis.
SIZES = [(8, 8), (10, 7), (7, 10), (3, 3)]
LAYERS = [flax_tp.ColumnParallelDense, flax_tp.RowParallelDense]


def loss_fn(layer, x):
  return jnp.sum(jnp.sin(layer(x)))


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_init_parity(meshes, mesh_spec, cls):
  for din, dout in SIZES:
    layer = cls(din, dout, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0))
    ref = nnx.Linear(din, dout, rngs=nnx.Rngs(0))
    for name in ("kernel", "bias"):
      np.testing.assert_array_equal(flax_tp.unshard(layer)[name][...], getattr(ref, name)[...])


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_params_are_sharded(meshes, mesh_spec, cls):
  mesh = meshes[mesh_spec]
  layer = cls(10, 7, mesh=mesh, rngs=nnx.Rngs(0))
  model = mesh.shape["model"]
  split = 1 if cls is flax_tp.ColumnParallelDense else 0
  kernel = layer.kernel[...]
  assert kernel.shape[split] == -(-(10, 7)[split] // model) * model
  names = ("model" if model > 1 else None,)  # one device: a split is the whole tensor
  expected = P(None, *names) if split else P(*names, None)
  assert kernel.sharding.spec == expected and kernel.sharding.mesh == mesh
  assert nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value() == expected
  assert nnx.get_named_sharding(nnx.state(layer), mesh)["kernel"].get_value().is_equivalent_to(
      kernel.sharding, 2)
  # Each device holds only its shard.
  assert {s.data.shape[split] for s in kernel.addressable_shards} == {kernel.shape[split] // model}


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_standalone_matches_linear(meshes, mesh_spec, cls):
  """Outputs, gradients (params and input) and one adamw step, at every size."""
  for din, dout in SIZES:
    layer = cls(din, dout, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0))
    ref = nnx.Linear(din, dout, rngs=nnx.Rngs(0))
    x = random((2, 3, din))
    _, y, (g_layer, g_x) = forward_and_grads(loss_fn, layer, x)
    _, y_ref, (g_ref, g_xref) = forward_and_grads(loss_fn, ref, x)
    np.testing.assert_allclose(y, y_ref, **F32)
    assert_state_close(g_layer, g_ref)
    np.testing.assert_allclose(g_x, g_xref, **F32)

    adamw_step(layer, g_layer)
    adamw_step(ref, g_ref)
    assert_state_close(layer, ref)
    assert_padding_zero(layer)


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_column_gather_output_false_standalone(meshes, mesh_spec):
  layer = flax_tp.ColumnParallelDense(5, 10, mesh=meshes[mesh_spec], gather_output=False,
                                      rngs=nnx.Rngs(0))
  ref = nnx.Linear(5, 10, rngs=nnx.Rngs(0))
  x = random((4, 5))
  np.testing.assert_allclose(layer(x), ref(x), **F32)


class MLP(nnx.Module):
  """Megatron's MLP: column (no gather) -> GELU -> row (parallel input)."""

  def __init__(self, d, f, *, mesh=None, rngs):
    if mesh is None:
      self.up, self.down = nnx.Linear(d, f, rngs=rngs), nnx.Linear(f, d, rngs=rngs)
    else:
      self.up = flax_tp.ColumnParallelDense(d, f, mesh=mesh, gather_output=False, rngs=rngs)
      self.down = flax_tp.RowParallelDense(f, d, mesh=mesh, input_is_parallel=True, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


def mlp_loss(mlp, x):
  """Mean over the global batch: each data shard's share, summed over "data"."""
  local = jnp.sum(jnp.sin(mlp(x))) / 8
  return jax.lax.psum(local, "data") if flax_tp.axis_is_bound("data") else local


mlp_value_and_grad = nnx.jit(nnx.value_and_grad(mlp_loss))  # the plain Flax side


@pytest.mark.parametrize("mesh_spec,d,f", [
    ("1x1", 6, 10), ("2x4", 8, 16), ("2x4", 6, 10), ("1x8", 5, 3), ("1x8", 6, 10),
    ("1x3", 6, 10), ("1x3", 5, 3)])  # even, uneven, and fewer features than devices
def test_mlp_inside_shard_map(meshes, mesh_spec, d, f):
  mesh = meshes[mesh_spec]
  mlp, ref = MLP(d, f, mesh=mesh, rngs=nnx.Rngs(0)), MLP(d, f, rngs=nnx.Rngs(0))
  x = random((8, d))
  loss, grads = inside_shard_map(mlp, mlp_loss, mesh, x, in_specs=[P("data")])
  ref_loss, ref_grads = mlp_value_and_grad(ref, x)
  np.testing.assert_allclose(loss, ref_loss, **F32)
  assert_state_close(grads, ref_grads)
  for _ in range(2):
    adamw_step(mlp, grads)
    adamw_step(ref, ref_grads)
    _, grads = inside_shard_map(mlp, mlp_loss, mesh, x, in_specs=[P("data")])
    _, ref_grads = mlp_value_and_grad(ref, x)
  assert_state_close(mlp, ref, rtol=1e-5, atol=1e-6)
  if mesh.shape["model"] > 1 and (f % mesh.shape["model"]):
    assert assert_padding_zero(mlp) == 3  # up.kernel, up.bias, down.kernel


@pytest.mark.parametrize("gather", [True, False])
def test_column_inside_shard_map(meshes, gather):
  mesh = meshes["2x4"]
  layer = flax_tp.ColumnParallelDense(6, 10, mesh=mesh, gather_output=gather, rngs=nnx.Rngs(0))
  ref = nnx.Linear(6, 10, rngs=nnx.Rngs(0))
  x = random((4, 6))
  graphdef, state = nnx.split(layer)
  out_spec = P() if gather else P(None, "model")
  y = jax.jit(jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh,
                            in_specs=(nnx.get_partition_spec(state), P()),
                            out_specs=out_spec))(state, x)
  expected = ref(x) if gather else layer.layout.pad(ref(x), -1)  # local padded shards
  np.testing.assert_allclose(y, expected, **F32)


def test_row_replicated_input_inside_shard_map(meshes):
  mesh = meshes["1x3"]
  layer = flax_tp.RowParallelDense(7, 4, mesh=mesh, rngs=nnx.Rngs(0))
  ref = nnx.Linear(7, 4, rngs=nnx.Rngs(0))
  x = random((3, 7))

  def fn(layer, x):
    return jnp.sum(jnp.sin(layer(x)))

  graphdef, state = nnx.split(layer)
  specs = nnx.get_partition_spec(state)
  grad_fn = jax.jit(jax.shard_map(
      lambda s, x: jax.grad(lambda s, x: fn(nnx.merge(graphdef, s), x), argnums=(0, 1))(s, x),
      mesh=mesh, in_specs=(specs, P()), out_specs=(specs, P())))
  g_state, g_x = grad_fn(state, x)
  g_ref, g_xref = nnx.grad(fn, argnums=(0, 1))(ref, x)
  assert_state_close(g_state, g_ref)
  np.testing.assert_allclose(g_x, g_xref, **F32)


def test_row_parallel_input_wrong_width(meshes):
  mesh = meshes["1x2"]
  layer = flax_tp.RowParallelDense(7, 4, mesh=mesh, input_is_parallel=True, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  f = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh,
                    in_specs=(nnx.get_partition_spec(state), P()), out_specs=P())
  with pytest.raises(ValueError, match="input shard of 4 features"):
    f(state, random((2, 7)))


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_bfloat16(meshes, cls):
  kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  layer = cls(10, 7, mesh=meshes["2x4"], rngs=nnx.Rngs(0), **kw)
  ref = nnx.Linear(10, 7, rngs=nnx.Rngs(0), **kw)
  assert layer.kernel[...].dtype == jnp.bfloat16
  assert_state_close(layer, ref, rtol=0, atol=0)
  x = random((4, 10), dtype=jnp.bfloat16)
  _, y, (g, _) = forward_and_grads(loss_fn, layer, x)
  _, y_ref, (g_ref, _) = forward_and_grads(loss_fn, ref, x)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                             rtol=2e-2, atol=2e-2)
  assert_state_close(g, g_ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_no_bias_and_custom_init(meshes, cls):
  init = nnx.initializers.orthogonal()
  kw = dict(use_bias=False, kernel_init=init)
  layer = cls(10, 7, mesh=meshes["1x3"], rngs=nnx.Rngs(3), **kw)
  ref = nnx.Linear(10, 7, rngs=nnx.Rngs(3), **kw)
  assert layer.bias is None and "bias" not in nnx.state(layer)
  assert_state_close(layer, ref, rtol=0, atol=0)
  x = random((4, 10))
  np.testing.assert_allclose(layer(x), ref(x), **F32)


def test_nnx_optimizer_and_jit(meshes):
  """nnx.Optimizer + nnx.jit work unchanged on a parallel layer (standalone)."""
  mesh = meshes["2x4"]
  layer = flax_tp.ColumnParallelDense(10, 7, mesh=mesh, rngs=nnx.Rngs(0))
  ref = nnx.Linear(10, 7, rngs=nnx.Rngs(0))
  x = random((4, 10))

  @nnx.jit
  def step(model, optimizer, x):
    grads = nnx.grad(loss_fn)(model, x)
    optimizer.update(model, grads)

  for model in (layer, ref):
    optimizer = nnx.Optimizer(model, optax.adamw(0.1), wrt=nnx.Param)
    for _ in range(3):
      step(model, optimizer, x)
  assert_state_close(layer, ref, rtol=1e-5, atol=1e-6)
  assert layer.kernel[...].sharding.spec == P(None, "model")
  assert_padding_zero(layer)


def test_bad_mesh_arguments(meshes):
  with pytest.raises(TypeError, match="jax.sharding.Mesh"):
    flax_tp.ColumnParallelDense(4, 4, mesh="2x4", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="'tensor' is not an axis"):
    flax_tp.RowParallelDense(4, 4, mesh=meshes["2x4"], axis_name="tensor", rngs=nnx.Rngs(0))


def test_inside_nnx_shard_map(meshes):
  """nnx.shard_map takes the layers' own specs through nnx.StateSharding."""
  mesh = meshes["2x4"]
  mlp, ref = MLP(6, 10, mesh=mesh, rngs=nnx.Rngs(0)), MLP(6, 10, rngs=nnx.Rngs(0))
  specs = nnx.StateSharding(nnx.get_partition_spec(nnx.state(mlp)))

  @nnx.shard_map(mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data"))
  def forward(model, x):
    return model(x)

  x = random((8, 6))
  np.testing.assert_allclose(forward(mlp, x), ref(x), **F32)


class SequenceParallelPair(nnx.Module):
  """Column (gathers the sequence) -> GELU -> row (reduce-scatters it), Megatron-SP."""

  def __init__(self, *, mesh=None):
    if mesh is None:
      self.up, self.down = nnx.Linear(6, 10, rngs=nnx.Rngs(0)), nnx.Linear(10, 6, rngs=nnx.Rngs(1))
    else:
      self.up = flax_tp.ColumnParallelDense(6, 10, mesh=mesh, gather_output=False,
                                            sequence_parallel=True, rngs=nnx.Rngs(0))
      self.down = flax_tp.RowParallelDense(10, 6, mesh=mesh, input_is_parallel=True,
                                           sequence_parallel=True, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


@pytest.mark.parametrize("mesh_spec", ["1x3", "2x4"])
def test_sequence_parallel_pair_inside_shard_map(meshes, mesh_spec):
  """x [b, 7, d] split over the sequence (7 positions: uneven over 3 and 4 devices):
  each device's output block and the gradients equal two nnx.Linear's."""
  mesh = meshes[mesh_spec]
  seq = flax_tp.ShardLayout(7, mesh.shape["model"])
  pair, ref = SequenceParallelPair(mesh=mesh), SequenceParallelPair()
  x = random((4, 7, 6))

  def loss(module, x_block):  # sum over this device's real positions, then everywhere
    out = module(x_block)
    real = seq.local_mask(flax_tp.shard_index("model"))[:, None]
    total = jnp.sum(jnp.where(real, jnp.sin(out), 0.0))
    return flax_tp.all_reduce(flax_tp.all_reduce(total, "sum", "model"), "sum", "data")

  value, grads = inside_shard_map(pair, loss, mesh, seq.pad(x, 1),
                                  in_specs=[P("data", "model")])
  ref_value, ref_grads = nnx.value_and_grad(lambda m, x: jnp.sum(jnp.sin(m(x))))(ref, x)
  np.testing.assert_allclose(value, ref_value, **F32)
  assert_state_close(grads, ref_grads)
  blocks = jax.jit(jax.shard_map(
      lambda s, x: nnx.merge(nnx.graphdef(pair), s)(x), mesh=mesh,
      in_specs=(nnx.get_partition_spec(nnx.state(pair)), P("data", "model")),
      out_specs=P("data", "model")))(nnx.state(pair), seq.pad(x, 1))
  np.testing.assert_allclose(seq.unpad(blocks, 1), ref(x), **F32)


class FusedProjections(nnx.Module):
  """Three column layers on one input (one uneven, one with replicated kv heads) into a
  row layer: with ``fused`` the three run as one matmul (flax_tp.fused_column_parallel)."""

  def __init__(self, *, mesh=None, fused=False, rngs):
    self.fused = fused
    if mesh is None:
      self.a, self.b = nnx.Linear(6, 8, rngs=rngs), nnx.Linear(6, 2, rngs=rngs)
      self.c, self.out = nnx.Linear(6, 5, rngs=rngs), nnx.Linear(15, 3, rngs=rngs)
      return
    kv = flax_tp.KVHeadLayout(2, mesh.shape["model"], 1, num_heads=8)
    column = dict(mesh=mesh, gather_output=False, rngs=rngs)
    self.a = flax_tp.ColumnParallelDense(6, 8, **column)
    self.b = flax_tp.ColumnParallelDense(6, 2, layout=kv, **column)
    self.c = flax_tp.ColumnParallelDense(6, 5, **column)
    self.out = flax_tp.RowParallelDense(15, 3, mesh=mesh, rngs=rngs)

  def __call__(self, x):
    if flax_tp.axis_is_bound("model"):
      layers = (self.a, self.b, self.c)
      outs = (flax_tp.fused_column_parallel(layers, x) if self.fused
              else [layer(x) for layer in layers])
      # Back to logical features for the row layer: this test is about the projections.
      outs = [layer.layout.unpad(flax_tp.all_gather(y, axis=-1), -1)
              for layer, y in zip(layers, outs, strict=True)]
      return self.out(jnp.tanh(jnp.concatenate(outs, axis=-1)))
    return self.out(jnp.tanh(jnp.concatenate([self.a(x), self.b(x), self.c(x)], axis=-1)))


@pytest.mark.parametrize("mesh_spec", ["2x4", "1x3"])
def test_fused_column_parallel_equals_the_separate_layers(meshes, mesh_spec):
  """One matmul for several column layers: loss and every gradient (the replicated kv
  copies' summed ones included) equal separate layers' and plain Flax's."""
  mesh = meshes[mesh_spec]
  x = random((8, 6))

  def loss(module, x):
    return flax_tp.all_reduce(jnp.sum(jnp.sin(module(x))) / 8, "sum", "data")

  fused = FusedProjections(mesh=mesh, fused=True, rngs=nnx.Rngs(0))
  separate = FusedProjections(mesh=mesh, rngs=nnx.Rngs(0))
  ref = FusedProjections(rngs=nnx.Rngs(0))
  value, grads = inside_shard_map(fused, loss, mesh, x, in_specs=[P("data")])
  sep_value, sep_grads = inside_shard_map(separate, loss, mesh, x, in_specs=[P("data")])
  ref_value, ref_grads = nnx.jit(nnx.value_and_grad(
      lambda m, x: jnp.sum(jnp.sin(m(x))) / 8))(ref, x)
  np.testing.assert_allclose(value, sep_value, rtol=1e-6)
  np.testing.assert_allclose(value, ref_value, **F32)
  # Stored forms, padding and kv copies included, equal the separate layers'.
  for (path, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(sep_grads),
                               strict=True):
    np.testing.assert_allclose(a[...], b[...], rtol=1e-6, atol=1e-7, err_msg=str(path))
  assert_state_close(grads, ref_grads)


def test_fused_column_parallel_refuses_what_it_cannot_fuse(meshes):
  mesh = meshes["1x2"]
  gathered = flax_tp.ColumnParallelDense(6, 4, mesh=mesh, rngs=nnx.Rngs(0))
  local = flax_tp.ColumnParallelDense(6, 4, mesh=mesh, gather_output=False, rngs=nnx.Rngs(1))
  wider = flax_tp.ColumnParallelDense(7, 4, mesh=mesh, gather_output=False, rngs=nnx.Rngs(2))
  with pytest.raises(ValueError, match="one axis, input width"):
    flax_tp.fused_column_parallel((local, wider), random((2, 6)))
  x = random((2, 6))
  with pytest.raises(ValueError, match="gather_output=False"):
    jax.jit(jax.shard_map(lambda x: flax_tp.fused_column_parallel((gathered, local), x)[0],
                          mesh=mesh, in_specs=P(), out_specs=P(None, "model")))(x)
  # Standalone (outside shard_map) each layer runs on its own: logical outputs.
  a, b = flax_tp.fused_column_parallel((gathered, local), x)
  np.testing.assert_allclose(b, local(x), **F32)
  assert a.shape == b.shape == (2, 4)


@pytest.mark.parametrize("shape,dtype", [((2, 5, 6), jnp.float32), ((7, 6), jnp.bfloat16)])
def test_dense_matmul_cpu_gradient_is_the_same_function(shape, dtype):
  """The CPU form of the kernel gradient changes how it is written, not what it is:
  forward, reverse and forward-mode derivatives against lax.dot_general."""
  from flax_tp.matmul import dense_matmul
  x, kernel = random(shape, seed=0).astype(dtype), random((6, 4), seed=1).astype(dtype)
  plain = lambda x, k: jax.lax.dot_general(x, k, (((x.ndim - 1,), (0,)), ((), ())))
  fast = lambda x, k: dense_matmul(x, k, cpu_gradient=True)
  loss = lambda f: lambda x, k: jnp.sum(jnp.sin(f(x, k).astype(jnp.float32)))
  tol = F32 if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_array_equal(jax.jit(fast)(x, kernel), jax.jit(plain)(x, kernel))
  for got, want in zip(jax.jit(jax.grad(loss(fast), (0, 1)))(x, kernel),
                       jax.jit(jax.grad(loss(plain), (0, 1)))(x, kernel), strict=True):
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
  tangents = (random(shape, seed=2).astype(dtype), random((6, 4), seed=3).astype(dtype))
  _, got = jax.jvp(fast, (x, kernel), tangents)
  _, want = jax.jvp(plain, (x, kernel), tangents)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
  # Remat policies see the same dots: as many are saved (none recomputed) or recomputed.
  for policy in (jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.nothing_saveable):
    counts = [str(jax.make_jaxpr(jax.grad(jax.checkpoint(loss(f), policy=policy), (0, 1)))(
        x, kernel)).count("dot_general[") for f in (fast, plain)]
    assert counts[0] == counts[1], (policy, counts)


def test_kernel_gradients_compile_to_canonical_dots(meshes):
  """On CPU no dot of an MLP's compiled gradient step contracts its left operand's first
  dimension: all are [M, K] x [K, N] or [M, K] x [N, K], the forms XLA:CPU hands to
  XNNPACK. With a user's own dot_general (the plain path) both kernel gradients
  contract dimension 0 of both operands and run as slower Eigen dots."""
  mesh = meshes["2x4"]

  def dots(**kwargs):
    up = flax_tp.ColumnParallelDense(8, 16, mesh=mesh, gather_output=False,
                                     rngs=nnx.Rngs(0), **kwargs)
    down = flax_tp.RowParallelDense(16, 8, mesh=mesh, input_is_parallel=True,
                                    rngs=nnx.Rngs(1), **kwargs)
    graphdef, state = nnx.split((up, down), nnx.Param)

    def local(state, x):
      def loss(state):
        up, down = nnx.merge(graphdef, state)
        return jax.lax.psum(jnp.sum(jnp.sin(down(jax.nn.gelu(up(x))))), "data")
      return jax.grad(loss)(state)

    specs = nnx.get_partition_spec(state)
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs))
    text = step.lower(state, random((8, 32, 8))).compile().as_text()
    return [line for line in text.splitlines() if " dot(" in line]

  fast = dots()
  assert len(fast) >= 5 and not any("lhs_contracting_dims={0}" in line for line in fast), fast
  plain = dots(dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k))
  assert sum("lhs_contracting_dims={0}" in line for line in plain) == 2, plain
