"""flax_tp.parallelize / explain_plan on models written without flax_tp in mind."""

import math
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import F32, assert_state_close

import flax_tp
from flax_tp import ColumnParallelDense, RowParallelDense
from flax_tp.hlo import arrays_sent, collectives


class Classifier(nnx.Module):
  """Token embedding -> MLP -> class logits, as anyone would write it."""

  def __init__(self, vocab, d, hidden, classes, *, rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.up = nnx.Linear(d, hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, d, rngs=rngs)
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.out = nnx.Linear(d, classes, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    x = x + self.down(jax.nn.gelu(self.up(x)))
    return self.out(self.norm(x).mean(axis=1))


class Block(nnx.Module):
  """A pre-norm transformer block: separate or fused q/k/v, heads from a reshape."""

  def __init__(self, d, heads, *, fused, rngs):
    self.heads, self.fused = heads, fused
    self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
    if fused:
      self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
    else:
      self.q, self.k, self.v = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))
    self.o = nnx.Linear(d, d, rngs=rngs)
    self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    b, s, d = x.shape
    h = self.norm1(x)
    if self.fused == "reshape":  # [..., 3, heads, head_dim], picked from the 3
      t = self.qkv(h).reshape(b, s, 3, self.heads, -1)
      q, k, v = t[:, :, 0], t[:, :, 1], t[:, :, 2]
    elif self.fused == "per_head":  # [..., heads, 3, head_dim]: each head's q, k, v together
      q, k, v = jnp.unstack(self.qkv(h).reshape(b, s, self.heads, 3, -1), axis=3)
    elif self.fused == "einsum":  # the parts used without being picked apart first
      t = self.qkv(h).reshape(b, s, 3, self.heads, -1)
      q, k, v = (jnp.einsum("bspht,p->bsht", t, jnp.eye(3)[i]) for i in range(3))
    elif self.fused:
      q, k, v = jnp.split(self.qkv(h), 3, axis=-1)
    else:
      q, k, v = self.q(h), self.k(h), self.v(h)
    q, k, v = (t.reshape(b, s, self.heads, -1) for t in (q, k, v))
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
    x = x + self.o(attn)
    return x + self.fc2(jax.nn.gelu(self.fc1(self.norm2(x))))


CLASSIFIER_PLAN = {"embed": "vocab", "up": "colwise", "down": "rowwise"}
BLOCK_PLAN = {"q": "column", "k": "column", "v": "column", "qkv": "column", "o": "row",
              "fc1": "column", "fc2": "row"}


def loss_fn(model, x):
  return jnp.sum(jnp.sin(model(x)))


grad_of = nnx.jit(nnx.value_and_grad(loss_fn))
apply = nnx.jit(lambda model, x: model(x))


@pytest.mark.parametrize("kind,given,mesh_spec", [
    ("classifier", True, "2x4"), ("block", True, "1x3"), ("fused_block", True, "2x4"),
    ("classifier", False, "1x3"), ("block", False, "2x4"), ("fused_block", False, "1x3")])
def test_parallelized_model_equals_the_original(meshes, mesh_spec, kind, given):
  """Same values (no re-init), equal outputs and gradients, and an nnx.Optimizer step
  that gives the same params, with a given plan and an inferred one (plan=None); 1x3
  splits nothing evenly (8 heads, vocab 50)."""
  def build():
    if kind == "classifier":
      return Classifier(50, 8, 20, 5, rngs=nnx.Rngs(0)), CLASSIFIER_PLAN
    model = Block(16, 8, fused=kind == "fused_block", rngs=nnx.Rngs(0))
    return model, {k: v for k, v in BLOCK_PLAN.items() if hasattr(model, k)}

  ref, plan = build()
  model, _ = build()
  x = (jax.random.randint(jax.random.key(1), (4, 6), 0, 50) if kind == "classifier"
       else jax.random.normal(jax.random.key(1), (4, 6, 16)))
  if given:
    flax_tp.parallelize(model, meshes[mesh_spec], plan)
  else:
    flax_tp.parallelize(model, meshes[mesh_spec], inputs=(x,))
    # The inference finds what the hand-written plan says (and the embedding).
    styles = {"column": ColumnParallelDense, "row": RowParallelDense}
    for path, style in plan.items():
      if style in ("colwise", "rowwise"):
        style = {"colwise": "column", "rowwise": "row"}[style]
      if style in styles:
        assert type(getattr(model, path)) is styles[style], path
  assert_state_close(model, ref, rtol=0, atol=0)
  np.testing.assert_allclose(apply(model, x), apply(ref, x), **F32)
  value, grads = grad_of(model, x)
  ref_value, ref_grads = grad_of(ref, x)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  # Gradients up to ~5 in size, summed over 96 positions in another order: 1e-5.
  assert_state_close(grads, ref_grads, rtol=1e-5, atol=1e-5)

  # SGD, not Adam: the key bias's true gradient is zero (softmax ignores it), and Adam
  # would blow its rounding noise up to a full step in either direction.
  tx = optax.sgd(0.1)
  opt, ref_opt = nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.Optimizer(ref, tx, wrt=nnx.Param)
  opt.update(model, grads)
  ref_opt.update(ref, ref_grads)
  assert_state_close(model, ref, rtol=1e-5, atol=1e-6)


class ReadsItsKernels(nnx.Module):
  """Uses layers' params directly as well as through their calls: a tied head read as
  ``embed.embedding``, and the up projection's kernel in a feature of its own."""

  def __init__(self, *, rngs):
    self.embed = nnx.Embed(37, 12, rngs=rngs)
    self.up, self.down = nnx.Linear(12, 30, rngs=rngs), nnx.Linear(30, 12, rngs=rngs)
    self.gate, self.proj = nnx.Linear(12, 30, rngs=rngs), nnx.Linear(30, 12, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    x = x + self.down(jax.nn.gelu(self.up(x)))
    x = x + jnp.mean(jnp.cos(x @ self.up.kernel[...]), axis=-1, keepdims=True)
    x = x + self.proj(jax.nn.gelu(self.gate(x)))  # an ordinary pair: still split
    return x @ self.embed.embedding[...].T


def test_layers_whose_params_are_read_directly_stay_whole(meshes):
  """plan=None keeps a layer whole when the model reads its params outside its call (12
  -> 30 over 4 devices pads them to 32): exact outputs and gradients, and explain_plan
  says why; the other pair is still split."""
  ref, model = ReadsItsKernels(rngs=nnx.Rngs(0)), ReadsItsKernels(rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(3), (4, 5), 0, 37)
  mesh = meshes["2x4"]
  table = flax_tp.explain_plan(model, mesh, inputs=(ids,))
  lines = {line.split()[0]: line for line in table.splitlines()[2:-1]}
  for path in ("up", "embed"):
    assert "replicate" in lines[path] and "reads its params outside its call" in lines[path]
  assert "replicate" in lines["down"]  # its only partner stays whole
  flax_tp.parallelize(model, mesh, inputs=(ids,))
  assert type(model.up) is nnx.Linear and type(model.embed) is nnx.Embed
  assert type(model.gate) is ColumnParallelDense and type(model.proj) is RowParallelDense
  out = apply(model, ids)
  assert out.shape == (4, 5, 37)
  np.testing.assert_allclose(out, apply(ref, ids), **F32)
  value, grads = grad_of(model, ids)
  ref_value, ref_grads = grad_of(ref, ids)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_state_close(grads, ref_grads, rtol=1e-5, atol=1e-5)
  # A given plan that splits it is refused when inputs let the trace see the read.
  with pytest.raises(ValueError, match="pattern 'up': the model reads the params of 'up' "
                     "outside its call"):
    flax_tp.parallelize(ReadsItsKernels(rngs=nnx.Rngs(0)), mesh,
                        {"up": "column", "down": "row"}, inputs=(ids,))


def test_a_column_row_pair_costs_one_all_reduce(meshes):
  """Even sizes under jit: the split activation between up and down stays split (the
  partitioner carries it through gelu), so the forward's only communication over the
  model axis is the row layer's all-reduce and the embedding's; each data replica
  computes its own rows."""
  mesh = meshes["2x4"]
  model = flax_tp.parallelize(Classifier(64, 8, 32, 4, rngs=nnx.Rngs(0)), mesh,
                              CLASSIFIER_PLAN)
  ids = jax.device_put(jnp.zeros((8, 4), jnp.int32),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  hlo = nnx.jit(lambda m, x: m(x)).lower(model, ids).compile().as_text()
  found = collectives(hlo, mesh)
  model_ops = [c for c in found if "model" in c.axes]
  assert sorted(c.kind for c in model_ops) == ["all-reduce", "all-reduce"], found
  # The batch stays split over "data" throughout: no communication over it forward.
  assert not [c for c in found if "data" in c.axes], found


def test_a_fused_qkv_is_split_in_whole_heads_of_each_part(meshes, tmp_path):
  """One nnx.Linear making [q | k | v], split by the model's code: each device holds whole
  heads of q, of k and of v (SegmentedLayout), so the compiled gradient step moves exactly
  what separate q/k/v layers move (a plain split of the fused kernel re-sent most of its
  output between devices). Its checkpoint restores on another mesh (uneven there)."""
  from flax_tp import SegmentedLayout
  from flax_tp.checkpoint import Checkpointer
  mesh = meshes["2x4"]
  x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 6, 16)),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  sent = {}
  given = {"qkv": "column", "o": "row", "fc1": "column", "fc2": "row"}
  for fused, plan in ((False, None), (True, None), (True, given)):
    model = flax_tp.parallelize(Block(16, 8, fused=fused, rngs=nnx.Rngs(0)), mesh, plan,
                                inputs=(x,))
    if fused:
      assert model.qkv.layout == SegmentedLayout(48, 4, 2, (16, 16, 16))
      table = flax_tp.explain_plan(Block(16, 8, fused=True, rngs=nnx.Rngs(0)), mesh, plan,
                                   inputs=(x,))
      assert "out (3 parts, each split)" in table and "kernel [16, 12]" in table
    compiled = grad_of.lower(model, x).compile()
    sent[fused, plan is None] = arrays_sent(collectives(compiled.as_text(), mesh))
  # Over "model": the same arrays. Over "data": the same elements (the fused kernel's
  # gradient is summed as one [16, 12] array instead of three [16, 4]).
  over = lambda counts, axis: Counter({k: n for k, n in counts.items() if k[1] == (axis,)})
  elements = lambda counts: sum(math.prod(shape) * n for (*_, shape), n in counts.items())
  for key in ((True, True), (True, False)):
    assert over(sent[key], "model") == over(sent[False, True], "model")
    assert elements(over(sent[key], "data")) == elements(over(sent[False, True], "data"))
    assert not sent[key] - over(sent[key], "model") - over(sent[key], "data")

  model = flax_tp.parallelize(Block(16, 8, fused=True, rngs=nnx.Rngs(0)), mesh, inputs=(x,))
  Checkpointer(tmp_path).save(1, {"params": nnx.state(model, nnx.Param)}, {})
  ref = Block(16, 8, fused=True, rngs=nnx.Rngs(0))
  other = flax_tp.parallelize(Block(16, 8, fused=True, rngs=nnx.Rngs(5)), meshes["1x3"],
                              inputs=(x,))
  restored, _ = Checkpointer(tmp_path).restore({"params": nnx.state(other, nnx.Param)})
  nnx.update(other, restored["params"])
  assert_state_close(other, ref, rtol=0, atol=0)
  plain = jnp.asarray(np.asarray(x))  # off the 2x4 mesh
  np.testing.assert_allclose(apply(other, plain), apply(ref, plain), **F32)


@pytest.mark.parametrize("form", ["reshape", "per_head"])
def test_a_fused_qkv_read_through_a_reshape_is_split_in_whole_heads(meshes, form):
  """``qkv(x).reshape(b, s, 3, h, hd)`` picked from the 3 is a [q | k | v] (each part
  split on its own, as the jnp.split form); ``reshape(b, s, h, 3, hd)`` keeps each head's
  q, k and v together (whole blocks of 3 * hd). Either way the compiled step sends over
  "model" exactly what separate q/k/v layers send (a contiguous split added an
  all-gather), and the outputs and gradients are the model's."""
  from flax_tp import SegmentedLayout
  mesh = meshes["2x4"]
  x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 6, 16)),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  separate = flax_tp.parallelize(Block(16, 8, fused=False, rngs=nnx.Rngs(0)), mesh, inputs=(x,))
  model = flax_tp.parallelize(Block(16, 8, fused=form, rngs=nnx.Rngs(0)), mesh, inputs=(x,))
  expected = (SegmentedLayout(48, 4, 2, (16, 16, 16)) if form == "reshape"
              else flax_tp.ShardLayout(48, 4, 6))
  assert model.qkv.layout == expected and model.o.layout == flax_tp.ShardLayout(16, 4, 2)
  over_model = lambda m: Counter({k: n for k, n in arrays_sent(collectives(
      grad_of.lower(m, x).compile().as_text(), mesh)).items() if k[1] == ("model",)})
  assert over_model(model) == over_model(separate)
  ref = Block(16, 8, fused=form, rngs=nnx.Rngs(0))
  value, grads = grad_of(model, x)
  ref_value, ref_grads = grad_of(ref, x)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_state_close(grads, ref_grads, rtol=1e-5, atol=1e-5)


def test_explain_plan_says_when_it_cannot_follow_a_regrouped_output(meshes):
  """A fused output reshaped to [..., 3, heads, head_dim] and used without being picked
  apart (an einsum over the 3): the split stays contiguous, and explain_plan says it may
  be resharded there instead of promising no communication; the results stay exact."""
  mesh = meshes["2x4"]
  x = jax.random.normal(jax.random.key(1), (8, 6, 16))
  table = flax_tp.explain_plan(Block(16, 8, fused="einsum", rngs=nnx.Rngs(0)), mesh,
                               inputs=(x,))
  (line,) = [row for row in table.splitlines() if row.startswith("qkv ")]
  assert "reshapes its output to [..., 3, 8, 2] in a way the trace could not follow" in line
  model = flax_tp.parallelize(Block(16, 8, fused="einsum", rngs=nnx.Rngs(0)), mesh,
                              inputs=(x,))
  np.testing.assert_allclose(apply(model, x), apply(Block(16, 8, fused="einsum",
                                                          rngs=nnx.Rngs(0)), x), **F32)


def test_plan_errors_name_the_pattern_and_the_module(meshes):
  mesh = meshes["1x2"]
  model = Classifier(50, 8, 20, 5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"match no module: \['blocks\.\*\.q'\]"):
    flax_tp.parallelize(model, mesh, {"blocks.*.q": "column"})
  with pytest.raises(ValueError, match=r"style 'row' \(pattern 'embed'\) does not fit module "
                                       r"'embed', a Embed: it needs an nnx.Linear"):
    flax_tp.parallelize(model, mesh, {"embed": "row"})
  with pytest.raises(ValueError, match=r"unknown style 'sideways'"):
    flax_tp.parallelize(model, mesh, {"up": "sideways"})
  with pytest.raises(ValueError, match=r"different styles"):
    flax_tp.parallelize(model, mesh, {"up": "column", "u*": "row"})
  with pytest.raises(ValueError, match="plan=None infers the plan by tracing.*inputs="):
    flax_tp.parallelize(model, mesh)
  # Nothing was swapped by the refused calls.
  assert type(model.up) is nnx.Linear and type(model.embed) is nnx.Embed


def test_explain_plan_shows_shapes_padding_and_collectives(meshes):
  model = Classifier(50, 8, 20, 5, rngs=nnx.Rngs(0))
  table = flax_tp.explain_plan(model, meshes["1x3"], CLASSIFIER_PLAN)
  lines = {line.split()[0]: line for line in table.splitlines()[2:-1]}
  assert "vocab" in lines["embed"] and "table [17 (up to 1 padding), 8]" in lines["embed"]
  assert "column" in lines["up"] and "kernel [8, 7 (up to 1 padding)]" in lines["up"]
  assert "all-reduce of the output forward" in lines["down"]
  assert "replicate" in lines["out"] and "none (replicated)" in lines["out"]
  assert type(model.up) is nnx.Linear  # explaining changes nothing
  inferred = flax_tp.explain_plan(model, meshes["1x3"],
                                  inputs=(jax.ShapeDtypeStruct((4, 6), jnp.int32),))
  lines = {line.split()[0]: line for line in inferred.splitlines()[2:-1]}
  assert "column" in lines["up"] and "feeds only down" in lines["up"]
  assert "row" in lines["down"] and "reads only up" in lines["down"]
  assert "replicate" in lines["out"] and "its output leaves the model" in lines["out"]


# 2x4 with sizes that divide (8 heads, 4 kv heads, d_ff 96, vocab 256, tied), then 1x3 where
# nothing does (llama-tiny: 6 heads, 2 kv heads, vocab 259; untied).
EVEN = dict(num_heads=8, num_kv_heads=4, d_ff=96, vocab_size=256, tie_embeddings=True)


@pytest.mark.parametrize("mesh_spec,sizes", [
    pytest.param("2x4", EVEN, marks=pytest.mark.slow),
    pytest.param("1x3", dict(tie_embeddings=False), marks=pytest.mark.slow),
    ("1x3", "gemma3_text")])
def test_the_reference_transformer_parallelized_equals_flax_tps(meshes, mesh_spec, sizes):
  """models/reference.py (Llama-style: GQA, SwiGLU, RMSNorm; or Gemma 3's: q/k norms,
  sliding and full layers, four (1 + w) norms per block, GeGLU) parallelized with
  plan=None: q/k/v -> o and gate/up -> down are paired, whole heads; its logits and
  gradients equal the plain model's, and its logits equal models/transformer.py's from
  the same seed.
  With even sizes its compiled gradient step moves what models/transformer.py's does:
  the same collectives, plus the one [b, s] sum the plain loss's backward needs (and the
  loss's two sums apart, which flax_tp packs)."""
  from models.config import TransformerConfig
  from models.reference import ReferenceTransformer, reference_loss
  from models.transformer import Transformer
  from train.step import Trainer
  if isinstance(sizes, str):  # a family's config (tests/fixtures/hf), not its weights
    from models.hf import read_config
    cfg = read_config(Path(__file__).resolve().parent / "fixtures" / "hf" / sizes)
  else:
    cfg = TransformerConfig.preset("llama-tiny", **sizes)
  mesh = meshes[mesh_spec]
  tokens = jax.random.randint(jax.random.key(2), (4, 9), 0, cfg.vocab_size)
  tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      "data" if mesh.shape["data"] > 1 else None)))
  ref = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  model = flax_tp.parallelize(ReferenceTransformer(cfg, rngs=nnx.Rngs(0)), mesh,
                              inputs=(tokens[:, :-1],))
  attn, mlp = model.blocks[1].attn, model.blocks[1].mlp
  assert all(type(layer) is ColumnParallelDense
             for layer in (attn.q, attn.k, attn.v, mlp.gate, mlp.up))
  assert type(attn.o) is RowParallelDense and type(mlp.down) is RowParallelDense
  assert attn.q.layout.unit == cfg.head_dim  # heads stay whole
  assert type(model.embed) is flax_tp.VocabParallelEmbedding
  logits = apply(model, tokens[:, :-1])
  np.testing.assert_allclose(logits, apply(ref, tokens[:, :-1]), rtol=1e-5, atol=1e-5)
  mine = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(logits, apply(mine, tokens[:, :-1]), rtol=1e-5, atol=1e-5)

  graphdef, params = nnx.split(model, nnx.Param)
  step = jax.jit(jax.value_and_grad(lambda p, t: reference_loss(nnx.merge(graphdef, p), t)))
  compiled = step.lower(params, tokens).compile()
  value, grads = compiled(params, tokens)
  ref_value, ref_grads = nnx.jit(nnx.value_and_grad(lambda m, t: reference_loss(m, t)))(
      ref, tokens)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  assert_state_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
  if sizes is not EVEN:
    return
  trainer = Trainer(mine, optax.sgd(0.1))
  hand_written = jax.jit(trainer.loss_and_grads).lower(trainer.params, tokens).compile()
  ours, theirs = (arrays_sent(collectives(c.as_text(), mesh), by_elements=(("data",),))
                  for c in (compiled, hand_written))
  # Column layers reading one input share their backward all-reduce, the tied embedding's
  # gradient is summed over "data" once (flax_tp's step packs those sums: compared by
  # elements), and the tied head's logits stay split. One extra all-reduce is the plain
  # loss's: log_softmax's backward sums its cotangent over the vocabulary, which flax_tp's
  # vocab-parallel cross-entropy knows to be 1. The loss's sum of exps and target logit
  # go apart in the plain loss, packed as one [2, b, s] in flax_tp's.
  local_batch = tokens.shape[0] // mesh.shape["data"]
  assert ours - theirs == Counter({("all-reduce", ("model",), "f32", (local_batch, 8)): 3})
  assert theirs - ours == Counter({("all-reduce", ("model",), "f32", (2, local_batch, 8)): 1})
