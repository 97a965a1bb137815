"""LoRA adapters on the parallel dense layers against the plain formula on logical weights,
``y = x @ kernel + bias + scaling * (x @ A) @ B``: outputs, every gradient (the input's
too), padding, and the compiled collectives (the adapter adds none of its own)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_tp
from flax_tp.collectives import all_gather, all_reduce
from flax_tp.hlo import collectives
from flax_tp.lora import add_lora, lora_scaling
from tests.helpers import logical_arrays

IN, OUT, RANK, ALPHA = 12, 10, 3, 6.0  # 10 over 3, 4 or 8 is uneven; 12 over 8 too


def build(kind, mesh, lora=True, rslora=False):
  cls = flax_tp.ColumnParallelDense if kind == "column" else flax_tp.RowParallelDense
  extra = {"gather_output": False} if kind == "column" else {}
  layer = cls(IN, OUT, mesh=mesh, rngs=nnx.Rngs(0), **extra)
  if lora:  # B drawn nonzero, so the adapter changes the output and every gradient
    add_lora(layer, RANK, ALPHA, rslora=rslora, rngs=nnx.Rngs(1),
             b_init=nnx.initializers.normal(0.5))
  return layer


def logical(layer):
  return {k: jnp.asarray(v) for k, v in logical_arrays(layer).items()}


def plain(p, x, scaling):
  return x @ p["kernel"] + p["bias"] + scaling * (x @ p["lora_a"]) @ p["lora_b"]


def local_value_and_grads(layer, mesh, x, kind):
  """Inside one shard_map, as in a model: ``layer(x)`` of a replicated ``x`` (a column
  layer's local outputs gathered for the loss), the loss and its gradients with respect
  to the params and ``x``."""
  graphdef, state = nnx.split(layer, nnx.Param)
  specs = nnx.get_partition_spec(state)

  def local(state, x):
    def loss(state, x):
      y = nnx.merge(graphdef, state)(x)
      if kind == "column":
        y = layer.layout.unpad(all_gather(y, axis=-1, axis_name="model"), -1)
      return jnp.sum(jnp.sin(y) * y), y
    (value, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
    return value, y, grads

  mapped = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P()),
                                 out_specs=(P(), P(), (specs, P()))))
  return mapped, state


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("mesh_spec", ["1x1", "1x3", "2x4", "1x8"])
def test_adapter_equals_the_plain_formula(meshes, kind, mesh_spec):
  mesh = meshes[mesh_spec]
  layer = build(kind, mesh)
  p = logical(layer)
  assert p["lora_a"].shape == (IN, RANK) and p["lora_b"].shape == (RANK, OUT)
  # Drawn whole, then placed: the same adapter whatever the mesh.
  np.testing.assert_array_equal(p["lora_a"], logical(build(kind, meshes["1x1"]))["lora_a"])
  scaling = lora_scaling(RANK, ALPHA)
  assert scaling == 2.0
  x = jax.random.normal(jax.random.key(2), (4, 5, IN))
  np.testing.assert_allclose(layer(x), plain(p, x, scaling), rtol=1e-5, atol=1e-5)

  mapped, state = local_value_and_grads(layer, mesh, x, kind)
  value, y, (grads, dx) = mapped(state, x)

  def ref_loss(p, x):
    y = plain(p, x, scaling)
    return jnp.sum(jnp.sin(y) * y)
  ref_value, (ref_grads, ref_dx) = jax.value_and_grad(ref_loss, argnums=(0, 1))(p, x)
  np.testing.assert_allclose(y, plain(p, x, scaling), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
  grads = logical_arrays(grads)
  assert set(grads) == set(ref_grads)
  for name, g in ref_grads.items():
    np.testing.assert_allclose(grads[name], g, rtol=1e-4, atol=1e-5 * np.abs(g).max(),
                               err_msg=name)
    assert np.abs(g).max() > 1e-3, name


@pytest.mark.parametrize("kind", ["column", "row"])
def test_padding_is_zero_and_the_split_follows_the_base(meshes, kind):
  """10 outputs (column) or 12 inputs (row: 12 over 8 is 2,2,2,2,1,1,1,1) split as the
  kernel; the adapter's padding is zero and gets a zero gradient."""
  mesh = meshes["1x8"]
  layer = build(kind, mesh)
  split, whole = (layer.lora_b, layer.lora_a) if kind == "column" else (layer.lora_a,
                                                                         layer.lora_b)
  dim = 1 if kind == "column" else 0
  spec = [None, None]
  spec[dim] = "model"
  assert tuple(nnx.get_partition_spec(nnx.state(layer))[
      "lora_b" if kind == "column" else "lora_a"].get_value()) == tuple(spec)
  assert split[...].shape[dim] == 8 * layer.layout.padded_size
  assert tuple(whole[...].sharding.spec) in ((), (None, None), (None,))
  assert isinstance(split, nnx.LoRAParam) and isinstance(whole, nnx.LoRAParam)
  x = jax.random.normal(jax.random.key(2), (3, IN))
  mapped, state = local_value_and_grads(layer, mesh, x, kind)
  _, _, (grads, _) = mapped(state, x)
  name = "lora_b" if kind == "column" else "lora_a"
  valid = np.asarray(layer.layout.valid_mask())
  stored, grad = np.asarray(split[...]), np.asarray(grads[name][...])
  pad = ~valid if dim == 0 else ~valid[None, :].repeat(RANK, 0)
  if dim == 0:
    pad = pad[:, None].repeat(RANK, 1)
  assert pad.any() and np.all(stored[pad] == 0) and np.all(grad[pad] == 0)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_adapter_adds_no_collective(meshes, kind):
  """The compiled forward and backward (params and input) on 2x4 have the same
  collectives, by kind, axes and count, with the adapter as without it; one of them
  carries the adapter's r columns more ([4, 5, in + r] in a column layer's backward,
  [4, 5, out + r] in a row layer's forward)."""
  mesh = meshes["2x4"]
  x = jax.random.normal(jax.random.key(2), (4, 5, IN))
  found, sent = {}, {}
  for lora in (False, True):
    layer = build(kind, mesh, lora=lora)
    mapped, state = local_value_and_grads(layer, mesh, x, kind)
    compiled = collectives(mapped.lower(state, x).compile().as_text(), mesh)
    found[lora] = sorted((c.kind, c.axes) for c in compiled)
    sent[lora] = sorted(s for c in compiled for _, s in c.operands)
  assert found[True] == found[False]
  assert ("all-reduce", ("model",)) in found[False]
  width = IN if kind == "column" else OUT
  wider = list(sent[True])
  wider[wider.index((4, 5, width + RANK))] = (4, 5, width)
  assert sorted(wider) == sent[False]


def test_fused_projections_with_adapters_on_some(meshes):
  """q, k, v fused into one matmul, adapters on q and v only (rsLoRA scaling on v):
  the same outputs and gradients as the three layers called one by one."""
  mesh = meshes["1x3"]
  make = lambda seed: flax_tp.ColumnParallelDense(IN, OUT, gather_output=False, mesh=mesh,
                                                  rngs=nnx.Rngs(seed))
  layers = [make(0), make(1), make(2)]
  add_lora(layers[0], RANK, ALPHA, rngs=nnx.Rngs(3), b_init=nnx.initializers.normal(0.5))
  add_lora(layers[2], 2, ALPHA, rslora=True, rngs=nnx.Rngs(4),
           b_init=nnx.initializers.normal(0.5))
  assert layers[2].lora_scaling == ALPHA / np.sqrt(2)
  group = nnx.List(layers)
  graphdef, state = nnx.split(group, nnx.Param)
  specs = nnx.get_partition_spec(state)
  x = jax.random.normal(jax.random.key(5), (6, IN))

  def run(fused):
    def local(state, x):
      def loss(state, x):
        q, k, v = (flax_tp.fused_column_parallel(tuple(nnx.merge(graphdef, state)), x) if fused
                   else tuple(layer(x) for layer in nnx.merge(graphdef, state)))
        return all_reduce(sum(jnp.sum(jnp.cos(t) * t) for t in (q, k, v)), "sum", "model")
      return jax.value_and_grad(loss, argnums=(0, 1))(state, x)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P()),
                                 out_specs=(P(), (specs, P()))))(state, x)

  (fused_value, (fused_grads, fused_dx)), (value, (grads, dx)) = run(True), run(False)
  np.testing.assert_allclose(fused_value, value, rtol=1e-5)
  np.testing.assert_allclose(fused_dx, dx, rtol=1e-5, atol=1e-6)
  for (path, a), (_, b) in zip(nnx.to_flat_state(fused_grads), nnx.to_flat_state(grads),
                               strict=True):
    # The fused matmul sums in another order: within float32 rounding of the gradient's
    # own scale (lora_b's entries reach 10, so an entry of 0.04 may differ by 3e-6).
    scale = max(1.0, float(np.abs(b[...]).max()))
    np.testing.assert_allclose(a[...], b[...], rtol=1e-5, atol=1e-6 * scale, err_msg=str(path))


def test_bad_adapters_are_refused_by_name(meshes):
  layer = build("column", meshes["1x1"], lora=False)
  with pytest.raises(ValueError, match="LoRA rank must be a positive integer, got 0"):
    add_lora(layer, 0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="LoRA alpha must be a positive number, got -1"):
    add_lora(layer, 2, -1, rngs=nnx.Rngs(0))
  # True is an int to Python, but no rank or alpha; numpy's numbers are numbers.
  with pytest.raises(ValueError, match="LoRA rank must be a positive integer, got True"):
    add_lora(layer, True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="LoRA rank must be a positive integer, got True"):
    flax_tp.LoRAConfig(rank=True)
  with pytest.raises(ValueError, match="LoRA alpha must be a positive number, got True"):
    flax_tp.LoRAConfig(rank=2, alpha=True)
  config = flax_tp.LoRAConfig(rank=np.int64(2), alpha=np.float32(4.0))
  assert type(config.rank) is int and type(config.alpha) is float and config.scaling == 2.0
  with pytest.raises(TypeError, match="got Linear"):
    add_lora(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 2, rngs=nnx.Rngs(0))
  add_lora(layer, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="already has a LoRA adapter"):
    add_lora(layer, 2, rngs=nnx.Rngs(0))


# -- the transformer with adapters, trained alone --------------------------------------

TARGETS = ("blocks.*.attn.[qkvo]", "blocks.*.mlp.*")


def merged_reference_run(cfg, model, tokens):
  """The plain-Flax reference with each adapted kernel merged (K + s A B, from the
  parallel model's logical values): its loss, and the adapters' gradients by the chain
  rule from its kernels' gradients (dA = s dK B^T, dB = s A^T dK)."""
  from models.reference import ReferenceTransformer, reference_loss
  ref = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  logical = logical_arrays(nnx.state(model, nnx.Param))
  scaling = model.lora.scaling
  flat = dict(nnx.to_flat_state(nnx.state(ref, nnx.Param)))
  for path in model.lora_targets:
    key = tuple(int(p) if p.isdigit() else p for p in path.split(".")) + ("kernel",)
    a, b = logical[path + ".lora_a"], logical[path + ".lora_b"]
    flat[key].set_value(jnp.asarray(logical[path + ".kernel"] + scaling * a @ b))
  loss, grads = jax.jit(nnx.value_and_grad(lambda m: reference_loss(m, tokens)))(ref)
  kernel_grads = {".".join(map(str, k)): np.asarray(v[...])
                  for k, v in nnx.to_flat_state(nnx.state(grads, nnx.Param))}
  adapters = {}
  for path in model.lora_targets:
    a, b, dk = (logical[path + ".lora_a"], logical[path + ".lora_b"],
                kernel_grads[path + ".kernel"])
    adapters[path + ".lora_a"] = scaling * dk @ b.T
    adapters[path + ".lora_b"] = scaling * a.T @ dk
  return float(loss), adapters


@pytest.mark.parametrize("mesh_spec,options", [
    pytest.param("2x4", {}, marks=pytest.mark.slow),
    ("4x2", {"scan_layers": True, "fsdp": True, "remat": "block", "sequence_parallel": True}),
    pytest.param("1x3", {}, marks=pytest.mark.slow),
    pytest.param("1x8", {"scan_layers": True}, marks=pytest.mark.slow)])
def test_transformer_trains_its_adapters_alone(meshes, mesh_spec, options):
  """Adapters of rank 3 (B drawn nonzero, PEFT's init_lora_weights=False) on every
  projection of llama-tiny (kv heads replicated on 2x4, d_ff and heads uneven): the loss
  and every adapter's gradient equal the merged plain-Flax reference's; the gradients,
  the optimizer and its state hold the adapters alone; two AdamW steps leave every base
  param bit for bit as it was and move every adapter."""
  from models.config import TransformerConfig
  from models.execution import Execution
  from models.transformer import Transformer
  from train.step import Trainer, make_optimizer
  cfg = TransformerConfig.preset("llama-tiny")
  lora = flax_tp.LoRAConfig(rank=3, alpha=6.0, targets=TARGETS, init_weights=False)
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0),
                      execution=Execution(**options), lora=lora)
  assert len(model.lora_targets) == 7 * cfg.num_layers
  tokens = jax.random.randint(jax.random.key(1), (8, cfg.max_seq_len + 1), 0, cfg.vocab_size)
  ref_loss, ref_grads = merged_reference_run(cfg, model, tokens)

  trainer = Trainer(model, make_optimizer(lr=1e-2, steps=2, warmup_steps=0))
  assert trainer.adapters_only
  placed = jax.device_put(tokens, trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, placed)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  grads = logical_arrays(grads)
  assert set(grads) == set(ref_grads)
  for name, g in ref_grads.items():
    np.testing.assert_allclose(grads[name], g, rtol=1e-3, atol=2e-5 * np.abs(g).max(),
                               err_msg=name)

  params = trainer.params
  base = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(params)
          if not isinstance(v, nnx.LoRAParam)}
  adapters = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(params)
              if isinstance(v, nnx.LoRAParam)}
  opt_state = trainer.init_opt_state(params)
  sized = [x for x in jax.tree.leaves(opt_state) if np.ndim(x) > 0]
  assert sum(x.size for x in sized) == 2 * sum(v.size for v in adapters.values())  # Adam
  for _ in range(2):
    params, opt_state, out = trainer.train_step(params, opt_state, placed, None)
  assert np.isfinite(float(out["loss"]))
  after = dict(nnx.to_flat_state(params))
  for k, v in base.items():
    np.testing.assert_array_equal(np.asarray(after[k][...]), v, err_msg=str(k))
  for k, v in adapters.items():
    assert not np.array_equal(np.asarray(after[k][...]), v), k


def test_the_step_sends_the_base_models_collectives_and_the_adapters_gradients(meshes):
  """The compiled LoRA train step on 2x4 holds the full fine-tune's collectives over
  "model", the same kinds and arrays (the adapters ride the base's all-reduces; how XLA
  combines them into ops may differ), and over
  "data" one gradient all-reduce whose operands are the adapters' local shards (and the
  loss): no base param's gradient is computed or sent. (On XLA:CPU the adapters'
  gradients travel packed, flax_tp.copy_all_to_parallel: their elements are counted.)"""
  import collections

  from models.config import TransformerConfig
  from models.transformer import Transformer
  from train.step import Trainer, make_optimizer
  cfg = TransformerConfig.preset("llama-tiny")
  mesh = meshes["2x4"]
  tokens = jax.random.randint(jax.random.key(1), (8, cfg.max_seq_len + 1), 0, cfg.vocab_size)
  found, data_operands, adapters = {}, {}, None
  for lora in (None, flax_tp.LoRAConfig(rank=3, targets=TARGETS)):
    model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0), lora=lora)
    trainer = Trainer(model, make_optimizer(lr=1e-2, steps=2))
    placed = jax.device_put(tokens, trainer.batch_sharding)
    step = trainer.train_step.lower(trainer.params, trainer.init_opt_state(trainer.params),
                                    placed, None)
    compiled = collectives(step.compile().as_text(), mesh)
    found[lora is not None] = collections.Counter((c.kind, c.axes) for c in compiled
                                                  for _ in c.operands)
    data_operands[lora is not None] = sorted(s for c in compiled if c.axes == ("data",)
                                             for _, s in c.operands)
    if lora is not None:
      adapters = sorted(tuple(v[...].sharding.shard_shape(v[...].shape))
                        for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
  assert found[True] == found[False]
  assert {axes for _, axes in found[True]} == {("model",), ("data",)}
  assert all(kind == "all-reduce" for kind, axes in found[True] if axes == ("data",))
  assert () in data_operands[True]  # the loss
  sent = sum(math.prod(shape) for shape in data_operands[True])
  assert sent == 1 + sum(math.prod(shape) for shape in adapters)


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(IN, OUT, rngs=rngs)
    self.down = nnx.Linear(OUT, IN, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


@pytest.mark.parametrize("mesh_spec", ["1x3", "2x4"])
def test_a_parallelized_model_takes_adapters_and_trains_them_alone(meshes, mesh_spec):
  """A plain nnx model parallelized (up column, down row; 10 over 3 or 4), adapters added
  by glob: its output and adapter gradients, called standalone, equal the plain formula's;
  ``nnx.Optimizer(wrt=nnx.LoRAParam)`` moves the adapters and nothing else."""
  import optax
  model = flax_tp.parallelize(_MLP(nnx.Rngs(0)), meshes[mesh_spec],
                              {"up": "column", "down": "row"})
  targets = flax_tp.add_adapters(model, flax_tp.LoRAConfig(rank=RANK, alpha=ALPHA,
                                                           targets=("*",), init_weights=False))
  assert targets == ["down", "up"]
  p = {f"{name}.{k}": v for name in ("up", "down") for k, v in logical(getattr(model, name)).items()}
  s = lora_scaling(RANK, ALPHA)

  def plain_mlp(p, x):
    h = jax.nn.gelu(plain({k[3:]: v for k, v in p.items() if k.startswith("up.")}, x, s))
    return plain({k[5:]: v for k, v in p.items() if k.startswith("down.")}, h, s)

  x = jax.random.normal(jax.random.key(3), (5, IN))
  loss = lambda y: jnp.sum(jnp.sin(y) * y)
  np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(model, x), plain_mlp(p, x), rtol=1e-5,
                             atol=1e-5)
  grads = jax.jit(nnx.grad(lambda m: loss(m(x)), argnums=nnx.DiffState(0, nnx.LoRAParam)))(model)
  ref = jax.grad(lambda p: loss(plain_mlp(p, x)))(p)
  flat = logical_arrays(grads)
  assert set(flat) == {k for k in ref if "lora" in k}
  for name, g in flat.items():
    np.testing.assert_allclose(g, ref[name], rtol=1e-4, atol=1e-5 * np.abs(ref[name]).max(),
                               err_msg=name)
  base = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
          if not isinstance(v, nnx.LoRAParam)}
  adapters = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
  optimizer.update(model, grads)
  for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if isinstance(v, nnx.LoRAParam):
      assert not np.array_equal(np.asarray(v[...]), adapters[k]), k
    else:
      np.testing.assert_array_equal(np.asarray(v[...]), base[k], err_msg=str(k))
