"""flax_tp.remat: the block runner (loop or scan, each recomputation) and the recomputing
VJP give the plain loop's values and gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_tp
from flax_tp.remat import recompute_in_backward, remat_policy, run_blocks


def _blocks(mesh, scanned):
  blocks = [nnx.Linear(6, 6, rngs=nnx.Rngs(i)) for i in range(3)]
  for b in blocks:
    flax_tp.replicate_on_mesh(b, mesh)
  return flax_tp.stack_layers(blocks) if scanned else nnx.List(blocks)


def _loss_and_grads(blocks, x, scanned, remat):
  graphdef, state = nnx.split(blocks)

  def loss(state, x):
    out = run_blocks(nnx.merge(graphdef, state), x,
                     lambda block, x, layer, scale: jnp.tanh(block(x)) * scale, 1.5,
                     num_layers=3, scanned=scanned, remat=remat)
    return jnp.sum(out ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)


@pytest.mark.parametrize("scanned,remat", [(False, "block"), (False, "dots_saveable"),
                                           (True, "none"), (True, "block"),
                                           (True, "nothing_saveable")])
def test_every_way_of_running_the_blocks_gives_the_loops_values(scanned, remat):
  mesh = flax_tp.make_mesh("1x1")
  x = jax.random.normal(jax.random.key(0), (4, 6))
  want_loss, (want_state, want_x) = _loss_and_grads(_blocks(mesh, False), x, False, "none")
  loss, (state, grad_x) = _loss_and_grads(_blocks(mesh, scanned), x, scanned, remat)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(grad_x, want_x, rtol=1e-5, atol=1e-7)
  got = flax_tp.unshard(state) if scanned else state
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want_state), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_recompute_in_backward_is_the_functions_vjp_and_extra_gets_none():
  f = lambda w, x, k: jnp.sin(x @ w) * k
  w, x = jnp.arange(6.0).reshape(3, 2) / 7, jnp.ones((4, 3))
  want = jax.grad(lambda w, x: jnp.sum(f(w, x, 2.0)), argnums=(0, 1))(w, x)
  got = jax.grad(lambda w, x: jnp.sum(recompute_in_backward(f, w, x, 2.0)), argnums=(0, 1))(w, x)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  assert remat_policy("none") is None
  assert remat_policy("block") is jax.checkpoint_policies.nothing_saveable
  with pytest.raises(ValueError, match="remat must be one of"):
    remat_policy("often")


@pytest.mark.parametrize("kernel", ["xla", "splash"])
def test_named_policies_keep_what_they_name_and_save_attention_runs_no_kernel_twice(kernel):
  """What a block keeps for its backward under each named policy (jax's list of saved
  residuals: q, k and v; and attention's output, or splash's residuals); under
  "save_attention" a step runs the forward attention kernel once, under "save_qkv_proj"
  twice (its backward recomputes it). (Exactness under them: test_splash's 1x3 case,
  test_context's ring case.)"""
  from jax._src.ad_checkpoint import saved_residuals

  from models.config import TransformerConfig
  from models.execution import Execution
  from models.transformer import Transformer

  cfg = TransformerConfig.preset("llama-tiny", num_kv_heads=2)  # 6 query heads of 4 dims
  mesh = flax_tp.make_mesh("1x1")
  model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0), execution=Execution(attention=kernel))
  graphdef, state = nnx.split(model.blocks[0])
  x = jax.random.normal(jax.random.key(0), (2, 16, cfg.d_model))
  block = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x, None, 0, jnp.arange(2)),
                        mesh=mesh, in_specs=(P(), P()), out_specs=P())

  def kept(remat):
    step = jax.checkpoint(lambda s, x: jnp.sum(block(s, x)), policy=remat_policy(remat))
    return sorted(tuple(a.shape) for a, source in saved_residuals(step, state, x)
                  if "argument" not in source and "constant" not in source)

  q, kv, merged = (2, 16, 6, 4), (2, 16, 2, 4), (2, 16, 24)
  assert kept("save_qkv_proj") == sorted([q, kv, kv])
  assert kept("save_out_proj") == [merged]
  if kernel == "xla":  # attention's output [b, s, h, d] and the projection's
    assert kept("save_attention") == sorted([q, kv, kv, q, merged])
  else:  # the kernel's output [b, groups, h / groups, s padded to a block, d] and its lse
    # (kept once: not again as [b, s, h, d])
    kept_all = kept("save_attention")
    assert {(2, 2, 3, 128, 4), (2, 2, 3, 128), merged} <= set(kept_all)
    assert kept_all.count(q) == 1 and kept_all.count(kv) == 2

  def forward_kernels(remat):
    step = jax.checkpoint(lambda s, x: jnp.sum(block(s, x)), policy=remat_policy(remat))
    text = jax.jit(jax.value_and_grad(step, argnums=1)).lower(state, x).as_text()
    return len(re.findall(r"call @_forward(_\d+)?\b", text))

  if kernel == "splash":
    assert (forward_kernels("save_qkv_proj"), forward_kernels("save_attention")) == (2, 1)
