"""FSDP over "data" beside tensor parallelism over "model" (flax_tp.data_parallel, --fsdp):
the same training as without it, 1 / (D * M) of the state per device, and the
collectives FSDP means."""

import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_tp
from flax_tp.checkpoint import Checkpointer
from flax_tp.data_parallel import FSDP_DIM
from flax_tp.hlo import arrays_sent, collectives
from models.config import TransformerConfig
from models.execution import Execution
from models.transformer import Transformer
from train.step import Trainer, make_optimizer

# Every size divides 2 and 4: stored == logical, so the bytes per device are exact.
EVEN = dict(vocab_size=256, d_model=32, num_heads=8, num_kv_heads=4, head_dim=4, d_ff=64,
            num_layers=2, max_seq_len=16)


def trainer(mesh, cfg, seed=0, **execution):
  return Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed),
                             execution=Execution(**execution)),
                 make_optimizer(lr=1e-2, steps=4, warmup_steps=1))


def train(mesh, cfg, steps=2, **execution):
  t = trainer(mesh, cfg, **execution)
  params, opt_state = t.params, t.init_opt_state(t.params)
  tokens = jax.random.randint(jax.random.key(1), (8, cfg.max_seq_len + 1), 0, cfg.vocab_size)
  tokens = jax.device_put(tokens, t.batch_sharding)
  out = []
  for _ in range(steps):
    params, opt_state, metrics = t.train_step(params, opt_state, tokens, None)
    out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  return t, params, opt_state, tokens, out


@pytest.mark.parametrize("preset,mesh_spec,options", [
    # (the fast lane: 4x2 with the memory options, tiny's biases, and data x context)
    pytest.param("llama-tiny", "2x4", {}, marks=pytest.mark.slow),
    pytest.param("llama-tiny", "2x4", dict(remat="block"), marks=pytest.mark.slow),
    ("llama-tiny", "4x2", dict(sequence_parallel=True, remat="block", scan_layers=True)),
    pytest.param("llama-tiny", "1x8", {}, marks=pytest.mark.slow),
    ("tiny", "2x4", {}),  # biases: q/k/v's model shards split over "data" too
    # over data x context (d_ff 90's shards of 45 over data alone: 4 divides no dim)
    ("llama-tiny", "2x2x2", dict(sequence_parallel=True)),
    pytest.param("tiny", "2x3x1", dict(context_parallel="ring", scan_layers=True),
                 marks=pytest.mark.slow),
    # data 1: over the context devices alone
    pytest.param("llama-tiny", "1x4x2", dict(scan_layers=True), marks=pytest.mark.slow),
])
def test_fsdp_trains_exactly_as_without_it(preset, mesh_spec, options):
  """llama-tiny (6 query / 2 kv heads, d_ff 90, vocab 259: padded, kv heads replicated
  over 4 and 8) and tiny (GPT-style, biases) with AdamW and clipping: the losses,
  gradient norms and params after two steps are those of the run without FSDP (up to
  the order of float sums)."""
  cfg = TransformerConfig.preset(preset)
  mesh = flax_tp.make_mesh(mesh_spec)
  _, plain, _, _, plain_out = train(mesh, cfg, **options)
  t, fsdp, _, _, fsdp_out = train(mesh, cfg, fsdp=True, **options)
  np.testing.assert_allclose(fsdp_out, plain_out, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(flax_tp.unshard(fsdp)), jax.tree.leaves(flax_tp.unshard(plain)),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  split = [v for _, v in nnx.to_flat_state(t.params) if FSDP_DIM in v.get_metadata()]
  # tiny's mlp.up.bias on 4 model devices: shards of 23, which 2 cannot split
  whole = 2 if preset == "tiny" and mesh.shape["model"] == 4 else 0
  axes = flax_tp.MeshAxes.of(mesh)
  assert len(split) == (len(nnx.to_flat_state(t.params)) - whole
                        if axes.data * axes.context > 1 else 0)


@pytest.mark.parametrize("mesh_spec", ["2x4", "4x2", "2x2x2", "1x4x2"])
def test_fsdp_state_per_device_and_collectives(mesh_spec):
  """Params and both Adam moments take exactly 1 / (D * C * M) of their logical bytes
  per device (on a mesh with a context axis FSDP splits over data and context
  together); the step reduce-scatters every param's gradient over those axes (no
  tensor is all-reduced over them any more) and all-gathers the params over them,
  forward and again in backward."""
  mesh = flax_tp.make_mesh(mesh_spec)
  devices = flax_tp.MeshAxes.of(mesh).devices
  # (the audit names the axes whose devices a collective spans: data 1 spans none)
  over = tuple(a for a in ("data", "context") if mesh.shape.get(a, 1) > 1)
  cfg = TransformerConfig.preset("llama-tiny", **EVEN)
  t, params, opt_state, tokens, _ = train(mesh, cfg, steps=1, fsdp=True)
  logical = sum(x.nbytes for x in jax.tree.leaves(flax_tp.unshard(params)))
  per_device = lambda tree: sum(x.addressable_shards[0].data.nbytes
                                for x in jax.tree.leaves(tree) if x.ndim)
  assert per_device(params) * devices == logical
  assert per_device(opt_state) * devices == 2 * logical  # mu and nu
  compiled = t.train_step.lower(params, opt_state, tokens, None).compile()
  sent = arrays_sent(collectives(compiled.as_text(), mesh))
  over_data = {key: n for key, n in sent.items() if key[1] == over}
  count = lambda kind: sum(n for key, n in over_data.items() if key[0] == kind)
  params_flat = nnx.to_flat_state(params)
  # With data 1 the attention's k/v reduce-scatters (backward of its gathers over
  # "context", 2 per layer) span the same devices as FSDP's.
  kv = 2 * cfg.num_layers if over == ("context",) else 0
  assert count("reduce-scatter") == len(params_flat) + kv
  assert count("all-gather") >= len(params_flat)  # forward, and again where backward needs
  assert all(math.prod(key[3]) == 1 for key in over_data if key[0] == "all-reduce")


def test_fsdp_checkpoints_move_to_runs_without_it_and_back(tmp_path):
  """Checkpoints hold logical values: an FSDP run's restores into a plain run on another
  mesh (uneven there), and a plain run's into an FSDP one."""
  cfg = TransformerConfig.preset("llama-tiny")
  for source, target, source_fsdp in (("2x4", "1x3", True), ("1x3", "4x2", False)):
    folder = tmp_path / f"{source}-{source_fsdp}"
    saved = trainer(flax_tp.make_mesh(source), cfg, fsdp=source_fsdp)
    state = {"params": saved.params, "opt_state": saved.init_opt_state(saved.params)}
    Checkpointer(folder).save(1, state, {})
    into = trainer(flax_tp.make_mesh(target), cfg, seed=9, fsdp=not source_fsdp)
    restored, _ = Checkpointer(folder).restore(
        {"params": into.params, "opt_state": into.init_opt_state(into.params)})
    for a, b in zip(jax.tree.leaves(flax_tp.unshard(restored["params"])),
                    jax.tree.leaves(flax_tp.unshard(state["params"])), strict=True):
      np.testing.assert_array_equal(a, b)
    # FSDP is no field of the architecture: the run identity cannot depend on it.
    assert "fsdp" not in cfg.identity()


@pytest.mark.parametrize("spec", [pytest.param("2x4", marks=pytest.mark.slow), "4x2"])
def test_an_fsdp_model_runs_outside_the_step(spec):
  """An FSDP model called as any model (eagerly, under nnx.jit, generate; on 2x4 also its
  gradients and one loaded with load_hf(fsdp=True)) gives the plain model's values: its
  map gathers what the step gathers, and generation takes the params whole once. The
  model's params stay split over "data" throughout (on main, ln_f failed to reshape its
  shard); unshard_over_data still puts a model back in place."""
  from pathlib import Path

  from flax_tp.data_parallel import unshard_over_data
  from models.generate import generate
  from models.hf import load_hf
  mesh = flax_tp.make_mesh(spec)
  plain = Transformer(TransformerConfig.preset("llama-tiny"), mesh=mesh, rngs=nnx.Rngs(0))
  fsdp = Transformer(TransformerConfig.preset("llama-tiny"), mesh=mesh, rngs=nnx.Rngs(0),
                     execution=Execution(fsdp=True))
  split = {k: v.sharding for k, v in nnx.to_flat_state(nnx.state(fsdp, nnx.Param))}
  ids = jnp.arange(32).reshape(4, 8) % 259
  call = nnx.jit(lambda m, x: m(x))
  np.testing.assert_array_equal(call(fsdp, ids), call(plain, ids))
  np.testing.assert_array_equal(fsdp(ids), plain(ids))
  np.testing.assert_array_equal(generate(fsdp, [[1, 2, 3], [4]], max_new_tokens=6),
                                generate(plain, [[1, 2, 3], [4]], max_new_tokens=6))
  assert {k: v.sharding for k, v in nnx.to_flat_state(nnx.state(fsdp, nnx.Param))} == split
  assert any(FSDP_DIM in v.get_metadata() for _, v in nnx.to_flat_state(nnx.state(fsdp)))

  if spec != "2x4":
    return
  grad = nnx.jit(nnx.grad(lambda m, x: jnp.mean(jnp.sin(m(x)))))
  for a, b in zip(jax.tree.leaves(flax_tp.unshard(grad(fsdp, ids))),
                  jax.tree.leaves(flax_tp.unshard(grad(plain, ids))), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  folder = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama"
  loaded, whole = load_hf(folder, mesh, execution=Execution(fsdp=True)), load_hf(folder, mesh)
  ids = jnp.arange(16).reshape(4, 4) * 3
  np.testing.assert_array_equal(call(loaded, ids), call(whole, ids))
  unshard_over_data(fsdp)
  np.testing.assert_array_equal(call(fsdp, jnp.arange(32).reshape(4, 8) % 259),
                                call(plain, jnp.arange(32).reshape(4, 8) % 259))


@pytest.mark.slow
def test_the_cli_says_what_fsdp_leaves_whole_and_resumes_without_it(tmp_path, capsys):
  """--fsdp is an execution option: a run resumes without it (another mesh too) with the
  losses of a run that never used it. Params the data axis cannot split are named (a
  column layer's bias, split over "model" on its only dimension into shards of 23)."""
  import json

  from helpers import TINY_RUN_FLAGS, write_small_corpus

  from train.run import main
  corpus = write_small_corpus(tmp_path / "corpus.py")
  base = [*TINY_RUN_FLAGS, "--data", corpus, "--steps", "4"]
  ck, first, second, plain = (tmp_path / n for n in ("ck", "a.jsonl", "b.jsonl", "c.jsonl"))
  assert main([*base, "--mesh", "2x4", "--fsdp", "--checkpoint-dir", str(ck),
               "--checkpoint-every", "2", "--metrics-file", str(first)]) == 0
  out = capsys.readouterr().out
  assert "FSDP over data" in out
  # d_ff 90 over 4 devices: shards of 23 (padded), which 2 does not divide.
  assert ("note: --fsdp leaves 2 param(s) replicated over the 2-way data axis, which divides "
          "none of their dimensions: blocks.0.mlp.up.bias, blocks.1.mlp.up.bias") in out
  shutil.rmtree(ck / "4")  # the run's end: resume from step 2
  assert main([*base, "--mesh", "4x2", "--resume", "--checkpoint-dir", str(ck),
               "--metrics-file", str(second)]) == 0
  assert main([*base, "--mesh", "4x2", "--metrics-file", str(plain)]) == 0
  losses = lambda path: [r["loss"] for r in map(json.loads, path.read_text().splitlines())
                         if "loss" in r]
  np.testing.assert_allclose(losses(first)[:2] + losses(second), losses(plain), rtol=1e-5)


def test_an_fsdp_block_not_gathered_is_an_error_saying_what_to_call():
  """The step leaves a block's FSDP-split params split for the block runner to gather
  (what the params record, FSDP_PER_BLOCK); a block called on them without gathering
  fails naming the param and what to call, and gather_block outside a map over "data"
  refuses split params instead of passing them through."""
  from jax.sharding import PartitionSpec as P

  from flax_tp.data_parallel import FSDP_PER_BLOCK, gather_block, gather_for_step
  mesh = flax_tp.make_mesh("2x4")
  model = Transformer(TransformerConfig.preset("llama-tiny", **EVEN), mesh=mesh,
                      rngs=nnx.Rngs(0), execution=Execution(fsdp=True))
  per_block = {".".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
               if v.get_metadata().get(FSDP_PER_BLOCK)}
  assert per_block and all(p.startswith("blocks.") for p in per_block)
  graphdef, state = nnx.split(model)
  block_def = nnx.graphdef(model.blocks[0])
  x = jnp.zeros((4, 16, EVEN["d_model"]))

  def ungathered(state, x):
    params = gather_for_step(state)
    block = nnx.merge(block_def, nnx.state(nnx.merge(graphdef, params).blocks[0]))
    return block.mlp(x)  # (an nnx norm on a split scale fails in JAX's own words first)

  run = jax.shard_map(ungathered, mesh=mesh, in_specs=(nnx.get_partition_spec(state),
                                                       P("data")), out_specs=P("data"))
  with pytest.raises(ValueError, match=r"ColumnParallelDense\.kernel is \(16, 16\) on this "
                     r"device, expected \(32, 16\); it is split over 'data' \(FSDP\).*"
                     r"gather_block"):
    jax.eval_shape(run, state, x)
  with pytest.raises(ValueError, match=r"split over 'data' \(FSDP\).*not inside a shard_map"):
    gather_block(nnx.state(model.blocks[0]))
