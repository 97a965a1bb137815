"""The parallel transformer against models/reference.py from the same seed."""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    assert_adamw_steps_close,
    assert_padding_zero,
    assert_state_close,
    split_execution,
)

import flax_tp
from flax_tp.hlo import collectives, tally
from models.config import TransformerConfig
from models.execution import Execution
from models.reference import ReferenceTransformer, reference_loss
from models.transformer import Transformer
from train.step import Trainer, clip_by_logical_norm, make_optimizer

CFG = TransformerConfig.tiny()  # 6 heads, d_ff 90, vocab 259: none divide 4 or 8
TOKENS = jax.random.randint(jax.random.key(1), (8, CFG.max_seq_len + 1), 0, CFG.vocab_size)
# 1x1 (no model axis): the layer tests and test_train cover it; 1x8 in the slow lane.
MESHES = ["1x2", "2x4", pytest.param("1x8", marks=pytest.mark.slow)]
STEPS = 3


def tx():
  return make_optimizer(lr=1e-3, steps=STEPS, warmup_steps=0, weight_decay=0.1, grad_clip=1.0)


@functools.cache
def reference_run(cfg, steps=STEPS):
  """Losses, first gradients and final params of plain-Flax training (once per config)."""
  model = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  opt = tx()
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(
        lambda p: reference_loss(nnx.merge(graphdef, p), TOKENS))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return jax.tree.map(jnp.add, params, updates), opt_state, loss, grads

  losses, first_grads = [], None
  for _ in range(steps):
    params, opt_state, loss, grads = step(params, opt_state)
    losses.append(float(loss))
    first_grads = grads if first_grads is None else first_grads
  return model, losses, first_grads, params


def reference_logits(ref_model):
  """The reference's logits of ``TOKENS`` (jitted: run eagerly, op by op, the reference
  costs seconds per new shape)."""
  return nnx.jit(lambda m, t: m(t))(ref_model, TOKENS[:, :-1])


@pytest.fixture(scope="module")
def reference():
  return reference_run(CFG)


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_model_equivalence(meshes, mesh_spec, reference):
  """Init (bitwise), logits, loss, gradients and params after 3 adamw steps."""
  ref_model, ref_losses, ref_grads, ref_params = reference
  model = Transformer(CFG, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0))
  assert_state_close(model, ref_model, rtol=0, atol=0)

  logits = jax.jit(lambda t: model(t))(TOKENS[:, :-1])
  assert logits.shape == (8, CFG.max_seq_len, CFG.vocab_size)
  np.testing.assert_allclose(logits, reference_logits(ref_model), rtol=1e-5, atol=1e-5)

  trainer = Trainer(model, tx())
  tokens = jax.device_put(TOKENS, trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  np.testing.assert_allclose(loss, ref_losses[0], rtol=1e-6)
  assert_state_close(grads, ref_grads, rtol=1e-4, atol=1e-6)

  params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)
  losses = []
  for _ in range(STEPS):
    params, opt_state, out = trainer.train_step(params, opt_state, tokens, None)
    losses.append(float(out["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_state_close(params, ref_params, rtol=1e-5, atol=1e-5)
  padded = assert_padding_zero(params)
  assert padded > 0 or mesh_spec == "1x1"
  # Adam's moments stay zero in the padding too.
  assert assert_padding_zero(opt_state[1][0].mu) == padded


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_untied_head_bfloat16(meshes, dtype):
  cfg = TransformerConfig.tiny(tie_embeddings=False, dtype=dtype)
  ref_model, ref_losses, _, _ = reference_run(cfg, steps=1)
  model = Transformer(cfg, mesh=meshes["2x4"], rngs=nnx.Rngs(0))
  assert "head" in nnx.state(model)
  assert_state_close(model, ref_model, rtol=0, atol=0)
  trainer = Trainer(model, tx())
  loss, _ = jax.jit(trainer.loss_and_grads)(trainer.params,
                                            jax.device_put(TOKENS, trainer.batch_sharding))
  np.testing.assert_allclose(loss, ref_losses[0], rtol=2e-2)


def compiled_step_collectives(meshes, num_layers, listed=False, **options):
  options, execution = split_execution(options)
  cfg = TransformerConfig.tiny(num_layers=num_layers, **options)
  mesh = meshes["2x4"]
  trainer = Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0), execution=execution), tx())
  opt_state = trainer.init_opt_state(trainer.params)
  hlo = trainer.train_step.lower(trainer.params, opt_state,
                                 jax.device_put(TOKENS, trainer.batch_sharding),
                                 None).compile().as_text()
  found = collectives(hlo, mesh)
  return found if listed else tally(found)


def wire_bytes(c, parts):
  """Bytes one device sends for a collective over ``parts`` devices (ring algorithms):
  an all-reduce of N bytes 2 (M-1)/M N; an all-gather to N or a reduce-scatter from N,
  (M-1)/M N each, so a reduce-scatter + all-gather pair moves what one all-reduce does."""
  size = c.bytes * (parts if c.kind == "reduce-scatter" else 1)  # the whole array's bytes
  return (2 if c.kind == "all-reduce" else 1) * (parts - 1) * size // parts


def test_sequence_parallelism_communicates_like_megatron_sp(meshes):
  """Every [b, s, d] all-reduce over "model" becomes a reduce-scatter and an
  all-gather moving the same bytes (Megatron-SP's minimum, 1.00); what remains are the
  loss's [b, s] reductions and the [d]-sized gradient sums of the norms and row biases,
  which now see only this device's positions (Megatron-SP has the same)."""
  cfg = TransformerConfig.tiny()
  activation = ("f32", (TOKENS.shape[0] // 2, TOKENS.shape[1] - 1, cfg.d_model))
  plain = compiled_step_collectives(meshes, 2, listed=True)
  sp = compiled_step_collectives(meshes, 2, listed=True, sequence_parallel=True)
  on_model = lambda found, kind: [c for c in found if c.axes == ("model",) and c.kind == kind]
  replaced = [c for c in on_model(plain, "all-reduce") if activation in c.operands]
  assert len(replaced) == 4 * cfg.num_layers + 2  # per block 2 forward + 2 backward; embed, head
  assert not [c for c in on_model(sp, "all-reduce") if activation in c.operands]
  gathers, scatters = on_model(sp, "all-gather"), on_model(sp, "reduce-scatter")
  assert len(gathers) == len(scatters) == len(replaced)
  parts = meshes["2x4"].shape["model"]
  # (XLA packs one of them with a [b, s] reduction: count the activations alone.)
  activation_bytes = 4 * int(np.prod(activation[1]))
  replaced_bytes = len(replaced) * 2 * (parts - 1) * activation_bytes // parts
  assert sum(wire_bytes(c, parts) for c in gathers + scatters) == replaced_bytes
  assert {c.kind for c in sp if c.axes == ("model",)} == {"all-reduce", "all-gather",
                                                           "reduce-scatter"}
  leftover = [shape for c in on_model(sp, "all-reduce") for _, shape in c.operands if shape]
  loss_rows = activation[1][:2]  # the loss's max, and its sums packed [2, b, s]
  assert all(shape in (loss_rows, (2, *loss_rows), (1, 1, cfg.d_model))
             for shape in leftover), leftover


def test_collectives_per_block(meshes):
  """Megatron's count: per block 2 all-reduces forward + 2 backward, nothing gathered."""
  one, two = compiled_step_collectives(meshes, 1), compiled_step_collectives(meshes, 2)
  model_one, model_two = one["all-reduce@model"], two["all-reduce@model"]
  assert model_two["tensors"] - model_one["tensors"] == 4
  # Outside the blocks: the embedding's forward all-reduce, the LM head input's
  # backward all-reduce, and the loss's max and one packed sum (of exps and the target
  # logit).
  assert model_one["tensors"] == 4 + 4
  # The only other traffic over "model": scalars, gradient clipping's partial
  # squared norms (a few per param), which are bookkeeping-sized.
  n_params = len(jax.tree.leaves(nnx.state(Transformer(
      TransformerConfig.tiny(num_layers=1), mesh=meshes["2x4"], rngs=nnx.Rngs(0)))))
  assert 0 < model_one["scalars"] <= 2 * n_params
  # Over "data": one packed all-reduce of every gradient (and the loss).
  assert one["all-reduce@data"]["ops"] == two["all-reduce@data"]["ops"] == 1
  # Nothing else: no gathers, scatters or permutes.
  assert set(one) == {"all-reduce@model", "all-reduce@data"}, one


# -- Llama-style blocks: RMSNorm, SwiGLU, grouped-query attention at any kv-head count --

LLAMA = TransformerConfig.preset("llama-tiny", qkv_bias=True)  # 6 q / 2 kv heads, Qwen2 biases


# (kv heads, every bias on): Qwen2's q/k/v biases, and Llama's attention/MLP biases on MQA.
VARIANTS = {2: dict(qkv_bias=True), 1: dict(qkv_bias=True, attn_out_bias=True, mlp_bias=True)}


@pytest.fixture(scope="module")
def llama_references():
  return {kv: reference_run(TransformerConfig.preset("llama-tiny", num_kv_heads=kv, **extra))
          for kv, extra in VARIANTS.items()}


# 2 kv heads over 4 (with data parallelism) and over 3 (uneven), 1 over 8.
@pytest.mark.parametrize("kv_heads,mesh_spec", [(2, "2x4"),
                                                pytest.param(2, "1x3", marks=pytest.mark.slow),
                                                pytest.param(1, "1x8", marks=pytest.mark.slow)])
def test_grouped_query_attention_equivalence(meshes, llama_references, kv_heads, mesh_spec):
  """kv heads replicated where the axis does not line up (2 kv over 4 or 3 devices, 1 over
  8; devices without query heads): init, logits, grads, 3 steps; every copy stays equal."""
  cfg = TransformerConfig.preset("llama-tiny", num_kv_heads=kv_heads, **VARIANTS[kv_heads])
  ref_model, ref_losses, ref_grads, ref_params = llama_references[kv_heads]
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0))
  assert_state_close(model, ref_model, rtol=0, atol=0)
  np.testing.assert_allclose(jax.jit(lambda t: model(t))(TOKENS[:, :-1]),
                             reference_logits(ref_model), rtol=1e-5, atol=1e-5)
  trainer = Trainer(model, tx())
  tokens = jax.device_put(TOKENS, trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  np.testing.assert_allclose(loss, ref_losses[0], rtol=1e-6)
  assert_state_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
  # Clipping sees the logical gradient: a replicated kv head counts once, not once per
  # copy (the stored arrays' norm is 1.19x the true one on 1x8). Above the threshold,
  # SGD after clipping moves the params as the plain model's clipped step does.
  ref_norm = optax.tree.norm(ref_grads)
  np.testing.assert_allclose(flax_tp.logical_norm(grads), ref_norm, rtol=1e-5)
  clip = lambda clipper, g: clipper(float(ref_norm) / 2).update(g, None)[0]
  assert_state_close(clip(clip_by_logical_norm, grads),
                     clip(optax.clip_by_global_norm, ref_grads), rtol=1e-4, atol=1e-6)
  params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)
  losses = []
  for _ in range(STEPS):
    params, opt_state, out = trainer.train_step(params, opt_state, tokens, None)
    if not losses:
      np.testing.assert_allclose(out["grad_norm"], ref_norm, rtol=1e-5)
    losses.append(float(out["loss"]))
  # Adam's first steps move a param by ~lr * sign(grad): where a gradient is ~0,
  # summation order (the kv-gradient sum, 8 devices) can move it by up to 1e-4
  # (lr 1e-3); everything else agrees far more closely.
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
  assert_state_close(params, ref_params, rtol=1e-4, atol=1e-4)
  assert assert_padding_zero(params) > 0
  for block in params["blocks"].values():
    for name in ("k", "v"):
      for part in ("kernel", "bias"):
        var = block["attn"][name][part]
        layout = var.get_metadata()["tp_layout"]
        assert layout.replicated
        stored = np.moveaxis(np.asarray(var[...]), -1, 0)
        copies = layout.stored_positions().reshape(-1)
        for element in range(layout.size):
          same = stored[copies == element]
          assert len(same) >= 1 and (same == same[:1]).all(), (name, part, element)


def test_kv_head_layout_places_what_each_device_uses():
  layout = flax_tp.KVHeadLayout(2 * 4, 4, 4, num_heads=6)  # q heads split 2, 2, 1, 1
  assert layout.offsets == (0, 0, 4, 4) and layout.sizes == (4, 8, 4, 4)
  none_for_some = flax_tp.KVHeadLayout(1 * 4, 8, 4, num_heads=5)  # q heads 1,1,1,1,1,0,0,0
  assert none_for_some.sizes == (4,) * 5 + (0,) * 3
  aligned = flax_tp.KVHeadLayout(4 * 2, 4, 2, num_heads=8)
  even = flax_tp.ShardLayout(8, 4, 2)
  assert not aligned.replicated and aligned.is_even
  assert (aligned.offsets, aligned.sizes) == (even.offsets, even.sizes)
  t = np.arange(3 * 8).reshape(3, 8)
  np.testing.assert_array_equal(layout.unpad(layout.pad(t, 1), 1), t)


def test_grouped_query_checkpoint_writes_each_kv_head_once_and_moves(tmp_path, meshes):
  from flax_tp.checkpoint import Checkpointer
  model = Transformer(LLAMA, mesh=meshes["2x4"], rngs=nnx.Rngs(0))
  state = {"params": nnx.state(model, nnx.Param)}
  Checkpointer(tmp_path).save(1, state, {})
  logical = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(flax_tp.unshard(model)))
  assert (tmp_path / "1" / "shards.0.bin").stat().st_size == logical
  for spec in ("1x3", "1x1"):
    target = Transformer(LLAMA, mesh=meshes[spec], rngs=nnx.Rngs(5))
    restored, _ = Checkpointer(tmp_path).restore({"params": nnx.state(target, nnx.Param)})
    assert_state_close(restored["params"], flax_tp.unshard(model), rtol=0, atol=0)


def test_kv_gradient_sum_is_the_only_extra_collective(meshes):
  """Replicated kv heads cost one backward all-reduce per k/v param (kernel, bias) and
  block; without replication (6 kv heads: plain multi-head) the count is Megatron's."""
  def tally_of(cfg):
    trainer = Trainer(Transformer(cfg, mesh=meshes["2x4"], rngs=nnx.Rngs(0)), tx())
    hlo = trainer.train_step.lower(
        trainer.params, trainer.init_opt_state(trainer.params),
        jax.device_put(TOKENS, trainer.batch_sharding), None).compile().as_text()
    return tally(collectives(hlo, meshes["2x4"]))
  gqa, mha = tally_of(LLAMA), tally_of(TransformerConfig.preset("llama-tiny", qkv_bias=True,
                                                                num_kv_heads=6))
  per_block = 4  # k and v: kernel and bias
  assert (gqa["all-reduce@model"]["tensors"] - mha["all-reduce@model"]["tensors"]
          == per_block * LLAMA.num_layers)
  # Megatron's count (the loss's two sums packed in one)
  assert mha["all-reduce@model"]["tensors"] == 4 * LLAMA.num_layers + 4
  assert set(gqa) == set(mha) == {"all-reduce@model", "all-reduce@data"}, gqa


MEMORY_TOKENS = jax.random.randint(jax.random.key(2), (4, 16), 0, 259)


def gqa_loss_and_grads(meshes, **options):
  cfg = TransformerConfig.preset("llama-tiny", dropout=0.1)
  trainer = Trainer(Transformer(cfg, mesh=meshes["2x4"], rngs=nnx.Rngs(0),
                                execution=Execution(**options)), tx())
  return jax.jit(trainer.loss_and_grads)(trainer.params,
                                         jax.device_put(MEMORY_TOKENS, trainer.batch_sharding),
                                         jax.random.key(3))


@pytest.fixture(scope="module")
def gqa_plain(meshes):
  return gqa_loss_and_grads(meshes)


@pytest.mark.parametrize("options", [
    pytest.param(dict(sequence_parallel=True), id="sp"),
    # (each other option alone: the slow lane; the fast lane has them together below)
    pytest.param(dict(remat="block"), id="remat", marks=pytest.mark.slow),
    pytest.param(dict(scan_layers=True), id="scan", marks=pytest.mark.slow),
    pytest.param(dict(sequence_parallel=True, remat="block"), id="sp+remat",
                 marks=pytest.mark.slow),
    # (the head and loss by 4 pieces of the 15 positions: the last one padded)
    pytest.param(dict(sequence_parallel=True, remat="block", scan_layers=True, loss_chunks=4),
                 id="sp+remat+scan+loss_chunks")])
def test_memory_options_with_replicated_kv_heads(meshes, gqa_plain, options):
  """Grouped-query attention with replicated kv heads (their custom gradient sum), each
  option alone and together, with dropout: the loss and every gradient equal the plain
  run's (15 positions: uneven over 4). Unrolled recomputation is flax_tp's own VJP,
  scanned it is jax.checkpoint; scanned blocks' params (and gradients) are stored
  stacked, compared per layer."""
  plain_loss, plain_grads = gqa_plain
  loss, grads = gqa_loss_and_grads(meshes, **options)
  np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
  per_layer = dict(nnx.to_flat_state(flax_tp.unshard(grads)))
  expected = dict(nnx.to_flat_state(flax_tp.unshard(plain_grads)))
  assert per_layer.keys() == expected.keys()
  for path, grad in expected.items():
    np.testing.assert_allclose(per_layer[path][...], grad[...], rtol=1e-5, atol=1e-7,
                               err_msg=str(path))


def lowered_step_lines(meshes, **options) -> int:
  """Lines of the train step's StableHLO program (lowered, not compiled)."""
  options, execution = split_execution(options)
  cfg = TransformerConfig.preset("llama-tiny", **options)
  trainer = Trainer(Transformer(cfg, mesh=meshes["2x4"], rngs=nnx.Rngs(0),
                                execution=execution), tx())
  tokens = jax.ShapeDtypeStruct((4, 17), jnp.int32, sharding=trainer.batch_sharding)
  lowered = trainer.train_step.lower(trainer.params, trainer.init_opt_state(trainer.params),
                                     tokens, None)
  return lowered.as_text().count("\n")


def test_scanned_train_step_does_not_grow_with_depth(meshes):
  """Stacked blocks: forward, backward and the optimizer each see one array per kind
  of param, so the program XLA compiles is the same size at any depth (unrolled, it
  grows with every block)."""
  scanned = lowered_step_lines(meshes, num_layers=2, scan_layers=True)
  assert lowered_step_lines(meshes, num_layers=5, scan_layers=True) == scanned
  assert lowered_step_lines(meshes, num_layers=5) > 2 * scanned


def compiled_scalar_reductions(meshes, num_layers: int, grad_clip: float) -> int:
  """The compiled train step's top-level ops that produce one f32 scalar (sums of squares,
  the loss's sums, the clip's factor), on 2x4 with the tiny config's uneven sizes."""
  cfg = dataclasses.replace(CFG, num_layers=num_layers)
  trainer = Trainer(Transformer(cfg, mesh=meshes["2x4"], rngs=nnx.Rngs(0)),
                    make_optimizer(lr=1e-3, steps=STEPS, grad_clip=grad_clip))
  tokens = jax.ShapeDtypeStruct(TOKENS.shape, jnp.int32, sharding=trainer.batch_sharding)
  hlo = trainer.train_step.lower(trainer.params, trainer.init_opt_state(trainer.params),
                                 tokens, None).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  return len(re.findall(r"= f32\[\] (?:fusion|reduce)\(", entry))


def test_the_step_takes_its_gradient_norm_once_from_the_packed_sums(meshes):
  """The logged ``grad_norm`` is the logical norm of the step's gradients, and the step
  computes it once (clipping takes the same one), from the packed data-parallel sums:
  its scalar reductions do not grow with depth (one per param before) and clipping adds
  none. Uneven sizes on 2x4: padding in every split param."""
  model = Transformer(CFG, mesh=meshes["2x4"], rngs=nnx.Rngs(0))
  trainer = Trainer(model, tx())
  tokens = jax.device_put(TOKENS, trainer.batch_sharding)
  _, grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  expected = flax_tp.logical_norm(grads)
  params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)
  _, _, out = trainer.train_step(params, opt_state, tokens, None)
  np.testing.assert_allclose(out["grad_norm"], expected, rtol=1e-6)
  shallow = compiled_scalar_reductions(meshes, 1, grad_clip=0.0)
  assert compiled_scalar_reductions(meshes, 3, grad_clip=0.0) == shallow
  assert compiled_scalar_reductions(meshes, 3, grad_clip=1.0) == shallow


def test_a_contiguous_norm_is_taken_inside_a_map_only():
  with pytest.raises(ValueError, match="inside a shard_map"):
    flax_tp.logical_norm({"w": jnp.ones(3)}, contiguous=True)


@pytest.mark.parametrize("preset,mesh_spec,options,rows", [
    ("moe-tiny", "2x4", {}, 1),
    pytest.param("tiny", "4x2", {"fsdp": True, "scan_layers": True,
                                 "sequence_parallel": True}, 3, marks=pytest.mark.slow),
    pytest.param("moe-tiny", "8x1", {"fsdp": True}, 5, marks=pytest.mark.slow)])
def test_a_batch_the_data_axis_does_not_divide_gives_the_reference_logits(
    meshes, preset, mesh_spec, options, rows):
  """One prompt on the training mesh: the model runs a batch its data axis does not
  divide whole on every data shard (FSDP params gathered first), to the reference's
  logits; a MoE with a capacity routes those rows alone, as on one device."""
  cfg = TransformerConfig.preset(preset, **(
      {"expert_capacity_factor": 1.0} if preset == "moe-tiny" else {}))
  ids = jax.random.randint(jax.random.key(3), (rows, 9), 0, cfg.vocab_size)
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0),
                      execution=Execution(**options))
  ref = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(jax.jit(ref)(ids)), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("preset", ["moe-tiny", "tiny"])
def test_the_start_up_parameter_count_is_the_models_on_every_mesh(meshes, preset):
  """Logical params (no padding of the FFN, the vocabulary or the experts), whatever the
  mesh and FSDP: the reference's count."""
  from train.setup import param_summary
  cfg = TransformerConfig.preset(preset)
  want = sum(x.size for x in jax.tree.leaves(nnx.state(
      ReferenceTransformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
  for spec, options in (("1x1", {}), ("4x2", {"fsdp": True}), ("1x8", {"scan_layers": True})):
    model = Transformer(cfg, mesh=meshes[spec], rngs=nnx.Rngs(0), execution=Execution(**options))
    assert param_summary(nnx.state(model, nnx.Param))["params"] == want, spec


# -- DeepSeek-V3's multi-head latent attention ------------------------------------------------

# 6 heads of q/k 6 + 4 rotary dims (none divide 4 or 8), values 5 (padded to 10) or 12
# (q/k padded to 12); q through its own latent of 7, or one projection; biases on the
# down projections and o.
MLA = dict(num_kv_heads=None, head_dim=10, qk_rope_head_dim=4, kv_lora_rank=10,
           qkv_bias=True, attn_out_bias=True)


@pytest.mark.parametrize("latent,mesh_spec,options", [
    (dict(q_lora_rank=7, v_head_dim=5), "2x4", {}),
    pytest.param(dict(v_head_dim=12), "1x3", dict(sequence_parallel=True, scan_layers=True),
                 marks=pytest.mark.slow),
    pytest.param(dict(q_lora_rank=7, v_head_dim=5), "4x2",
                 dict(sequence_parallel=True, fsdp=True, remat="block"),
                 marks=pytest.mark.slow)])
def test_latent_attention_equivalence(meshes, latent, mesh_spec, options):
  """Init (bitwise), logits, loss, every gradient and 3 AdamW steps against the plain-Flax
  reference, which writes transformers' DeepseekV3Attention out."""
  cfg = TransformerConfig.preset("llama-tiny", **MLA, **latent)
  ref_model, ref_losses, ref_grads, ref_params = reference_run(cfg)
  _, execution = split_execution(options)
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0), execution=execution)
  if not options:
    assert_state_close(model, ref_model, rtol=0, atol=0)
  np.testing.assert_allclose(jax.jit(lambda t: model(t))(TOKENS[:, :-1]),
                             reference_logits(ref_model), rtol=1e-5, atol=1e-5)
  trainer = Trainer(model, tx())
  tokens = jax.device_put(TOKENS, trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  np.testing.assert_allclose(loss, ref_losses[0], rtol=1e-6)
  if not options:
    assert_state_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
  params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)
  losses = []
  for _ in range(STEPS):
    params, opt_state, out = trainer.train_step(params, opt_state, tokens, None)
    losses.append(float(out["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  if not options:
    assert_state_close(params, ref_params, rtol=1e-5, atol=1e-5)
    assert assert_padding_zero(params) > 0


# -- GPT-OSS's attention sinks and biased, clamped experts -------------------------------------

# moe-tiny (6 heads over 2 kv heads, 6 experts of 90: none divide 4 or 8) with per-head
# sinks on alternating sliding (window 3) and full layers, biases on q/k/v/o, the router
# and the experts, and a clamp low enough that it bites (|gate|, |up| ~ 1 here).
GPT_OSS = dict(attn_sinks=True, router_bias=True, expert_bias=True, swiglu_limit=0.6,
               qkv_bias=True, attn_out_bias=True,
               layer_types=("sliding_attention", "full_attention"), sliding_window=3)


@pytest.mark.parametrize("mesh_spec,options", [
    ("2x4", {}),
    pytest.param("1x3", dict(sequence_parallel=True, scan_layers=True),
                 marks=pytest.mark.slow),
    pytest.param("4x2", dict(sequence_parallel=True, fsdp=True, remat="block",
                             expert_axes=("data", "model")), marks=pytest.mark.slow),
    pytest.param("8x1", dict(expert_capacity_factor=3.0, expert_dispatcher="all_to_all"),
                 marks=pytest.mark.slow),
    # a capacity that drops: the batched experts' empty slots (biases alone) read by no one
    pytest.param("1x8", dict(expert_capacity_factor=1.0), marks=pytest.mark.slow)])
def test_sinks_and_biased_clamped_experts_equivalence(meshes, mesh_spec, options):
  """Init (bitwise), logits, loss, every gradient and 3 AdamW steps against the plain-Flax
  reference (its attention written as transformers' GPT-OSS eager attention, its experts
  as a loop). The biases start at zero (transformers' init), so the steps are what moves
  them: their gradients are compared on the first step, the moved values after."""
  model_fields, execution_fields = split_execution(options)
  cfg = TransformerConfig.preset("moe-tiny", **GPT_OSS, **{
      k: v for k, v in options.items() if k.startswith("expert_capacity")})
  ref_model, ref_losses, ref_grads, ref_params = reference_run(cfg)
  execution = Execution(**{k: v for k, v in options.items()
                           if not k.startswith("expert_capacity")})
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0), execution=execution)
  if not execution.fsdp:
    assert_state_close(model, ref_model, rtol=0, atol=0)
  np.testing.assert_allclose(jax.jit(lambda t: model(t))(TOKENS[:, :-1]),
                             reference_logits(ref_model), rtol=1e-5, atol=1e-5)
  trainer = Trainer(model, tx())
  tokens = jax.device_put(TOKENS, trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  np.testing.assert_allclose(loss, ref_losses[0], rtol=1e-6)
  if not execution.fsdp and not execution.scan_layers:
    assert_state_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
    sinks_grad = np.asarray(ref_grads["blocks"][0]["attn"]["sinks"][...])
    assert np.abs(sinks_grad).min() > 0  # every head's sink is in play
  params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)
  losses = []
  for _ in range(STEPS):
    params, opt_state, out = trainer.train_step(params, opt_state, tokens, None)
    losses.append(float(out["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  if not execution.fsdp and not execution.scan_layers:
    # (a gradient at rounding level can turn its AdamW update around: see the helper)
    assert_adamw_steps_close(params, ref_params, ref_grads, lr=1e-3, steps=STEPS)
    assert assert_padding_zero(params) > 0


def _model_collectives(meshes, layers, sequence_parallel, **latent):
  """The collectives over "model" of the compiled train step of llama-tiny (``latent``:
  its MLA fields) on 2x4."""
  cfg = TransformerConfig.preset("llama-tiny", num_layers=layers, **latent)
  mesh = meshes["2x4"]
  trainer = Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0),
                                execution=Execution(sequence_parallel=sequence_parallel)), tx())
  hlo = trainer.train_step.lower(trainer.params, trainer.init_opt_state(trainer.params),
                                 jax.device_put(TOKENS, trainer.batch_sharding),
                                 None).compile().as_text()
  return [c for c in collectives(hlo, mesh) if c.axes == ("model",)]


# q/k 6 + 4, values 5, latents 7 (q) + 6 (kv) + 4 (the rotary key)
LATENT = dict(MLA, qkv_bias=False, attn_out_bias=False, kv_lora_rank=6, q_lora_rank=7,
              v_head_dim=5)
LATENT_WIDTH = 7 + 6 + 4


def test_latent_attention_communicates_like_megatron(meshes):
  """Per block Megatron's four all-reduces over "model", the backward one of the latents'
  cotangents [b, s, q_lora + kv_lora + rope] instead of x's [b, s, d] (one
  ``copy_to_parallel`` on the latents, the rotary key's included)."""
  d = 24
  widths = lambda cs, kind: collections.Counter(
      shape[-1] for c in cs if c.kind == kind for _, shape in c.operands if len(shape) == 3)
  one = _model_collectives(meshes, 1, False, **LATENT)
  two = _model_collectives(meshes, 2, False, **LATENT)
  assert len(two) - len(one) == 4  # one block's all-reduces
  assert widths(two, "all-reduce") - widths(one, "all-reduce") == {d: 3, LATENT_WIDTH: 1}


@pytest.mark.slow
def test_sequence_parallel_latent_attention_gathers_the_latents(meshes):
  """With sequence parallelism the down projections run on the device's block and the
  latents are all-gathered for the attention, not x: per block one gather and one
  reduce-scatter of the latents' width replace x's, and nothing else changes."""
  d, layers = 24, 2
  sp = lambda **kw: collections.Counter(
      (c.kind, c.operands[0][1][-1]) for c in _model_collectives(meshes, layers, True, **kw)
      if c.kind in ("all-gather", "reduce-scatter"))
  mla, plain = sp(**LATENT), sp()
  assert mla[("all-gather", LATENT_WIDTH)] == mla[("reduce-scatter", LATENT_WIDTH)] == layers
  assert mla[("all-gather", d)] == plain[("all-gather", d)] - layers
  assert mla[("reduce-scatter", d)] == plain[("reduce-scatter", d)] - layers
  assert sum(mla.values()) == sum(plain.values())
