"""The splash attention core (``models.splash``, ``attention.Splash``): jax's Pallas kernel,
run here in Pallas interpret mode, gives the plain-Flax reference's logits, loss and every
gradient (the reference attends with XLA's einsums) on 1x1, 1x3 and 2x4, with grouped
kv heads (shared by a group, and copied across model devices), sliding windows (static,
and traced under scanned layers), GPT-OSS's sinks and Gemma 2's soft cap. Where it
cannot run (a context axis, dropout on the probabilities) asking for it is an error and
"auto" says why it runs XLA's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_state_close

import flax_tp
from models import attention, splash
from models.config import TransformerConfig
from models.execution import Execution
from models.reference import ReferenceTransformer, reference_loss
from models.transformer import Transformer
from train.step import Trainer, make_optimizer

# Every mechanism the kernel takes at once: 6 query heads over 2 kv heads, a window of 3
# on the first layer (16 tokens), a sink per head, soft-capped scores.
MECHANISMS = dict(num_kv_heads=2, layer_types=("sliding_attention", "full_attention"),
                  sliding_window=3, attn_sinks=True, attn_softcap=3.0, qkv_bias=True)
CFG = TransformerConfig.preset("llama-tiny", **MECHANISMS)
TOKENS = jax.random.randint(jax.random.key(1), (4, CFG.max_seq_len + 1), 0, CFG.vocab_size)


@pytest.fixture(scope="module")
def reference():
  model = ReferenceTransformer(CFG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  loss, grads = jax.jit(jax.value_and_grad(
      lambda p: reference_loss(nnx.merge(graphdef, p), TOKENS)))(params)
  logits = nnx.jit(lambda m, t: m(t))(model, TOKENS[:, :-1])
  return logits, loss, grads


@pytest.mark.parametrize("mesh_spec,options", [
    pytest.param("1x1", {}, marks=pytest.mark.slow),
    # 2 kv heads over 3 devices: copies that straddle the groups (the kernel per query
    # head); scanned layers: the window a traced index (the kernel chosen by lax.cond);
    # recomputing all but attention (its residuals named inside the kernel's rule)
    ("1x3", dict(scan_layers=True, remat="save_attention")),
    # the sinks the same on both data shards: their cotangents summed over "data"
    ("2x4", dict(sequence_parallel=True)),
])
def test_splash_model_is_the_reference(meshes, reference, mesh_spec, options):
  ref_logits, ref_loss, ref_grads = reference
  model = Transformer(CFG, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0),
                      execution=Execution(attention="splash", **options))
  assert model.attention_kernel[0] == "splash"
  np.testing.assert_allclose(jax.jit(lambda t: model(t))(TOKENS[:, :-1]), ref_logits,
                             rtol=1e-5, atol=1e-5)
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
  tokens = jax.device_put(TOKENS, trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  if not options.get("scan_layers"):
    assert_state_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
  else:  # stacked [layers, ...]: against the same layout with XLA's attention
    xla = Trainer(Transformer(CFG, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0),
                              execution=Execution(attention="xla", **options)),
                  make_optimizer(lr=1e-3, steps=1))
    _, xla_grads = jax.jit(xla.loss_and_grads)(xla.params, tokens)
    assert_state_close(grads, flax_tp.unshard(xla_grads), rtol=1e-4, atol=1e-6)
  sinks = np.asarray(ref_grads["blocks"][0]["attn"]["sinks"][...])
  assert np.abs(sinks).min() > 0  # every head's sink is in play


def test_the_kernel_tells_its_mechanisms_apart():
  """Each of the window, the sinks and the soft cap changes the kernel's output (so the
  test above can fail), and the padded keys past the sequence are hidden."""
  b, s, h, d = 2, 16, 4, 8
  q, k, v = (jax.random.normal(jax.random.key(i), (b, s, h, d)) for i in range(3))
  core = attention.Splash(interpret=True)
  run = lambda spec: np.asarray(jax.jit(lambda q, k, v: core(q, k, v, spec, None, None,
                                                             None, None))(q, k, v))
  plain = run(attention.AttentionSpec())
  np.testing.assert_allclose(plain, attention.local(q, k, v, attention.AttentionSpec(), None,
                                                    None, None, None), rtol=1e-5, atol=1e-6)
  for spec in (attention.AttentionSpec(window=3), attention.AttentionSpec(softcap=0.5),
               attention.AttentionSpec(sinks=jnp.ones((h,)))):
    changed = run(spec)
    assert np.abs(changed - plain).max() > 1e-2, spec
    expected = attention.local(q, k, v, spec, None, None, None, None)
    np.testing.assert_allclose(changed, expected, rtol=1e-5, atol=1e-6, err_msg=str(spec))


def test_blocks_follow_the_length():
  assert [splash.block_for(s) for s in (16, 128, 200, 512, 1024, 4096)] == [
      128, 128, 256, 512, 512, 512]


@pytest.mark.parametrize("asked,platform,context,dropout,expected", [
    ("auto", "cpu", 1, 0.0, ("xla", "auto: the kernel is for a TPU, this is cpu")),
    ("auto", "tpu", 1, 0.0, ("splash", "auto: on a TPU")),
    ("auto", "tpu", 2, 0.0, ("xla", "auto: the mesh splits the sequence over 2 context "
                                    "devices, whose blocks the kernel does not compute yet")),
    ("auto", "tpu", 1, 0.1, ("xla", "auto: dropout 0.1 on the attention probabilities, "
                                    "which the kernel has not")),
    ("xla", "tpu", 1, 0.0, ("xla", "asked for")),
    ("splash", "cpu", 1, 0.0, ("splash", "asked for, in Pallas interpret mode on cpu (slow)")),
])
def test_the_kernel_each_choice_runs_and_why(asked, platform, context, dropout, expected):
  cfg = TransformerConfig.preset("llama-tiny", dropout=dropout)
  assert splash.choose_kernel(asked, cfg, platform=platform, context=context) == expected


@pytest.mark.parametrize("mesh_spec,dropout,named", [
    ("1x2x1", 0.0, "splits the sequence over 2 context devices"),
    ("1x2", 0.1, "dropout 0.1 on the attention probabilities")])
def test_splash_asked_where_it_cannot_run_is_refused(mesh_spec, dropout, named):
  cfg = TransformerConfig.preset("llama-tiny", dropout=dropout)
  with pytest.raises(ValueError, match=f"attention 'splash' cannot run here: .*{named}"):
    Transformer(cfg, mesh=flax_tp.make_mesh(mesh_spec), rngs=nnx.Rngs(0),
                execution=Execution(attention="splash"))
  with pytest.raises(ValueError, match="attention must be one of"):
    Execution(attention="flash")


def test_the_cli_says_which_kernel_and_refuses_one_that_cannot_run(capsys):
  from helpers import TINY_RUN_FLAGS

  from train.run import main
  flags = [*TINY_RUN_FLAGS, "--steps", "1", "--sample-length", "0"]
  assert main([*flags, "--mesh", "1x2x1", "--attention", "splash"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "attention 'splash' cannot run here" in err
  assert main([*flags, "--mesh", "1x2", "--attention", "xla"]) == 0
  assert "attention: xla (einsums, the scores in HBM) on every layer in training (asked " \
         "for)" in capsys.readouterr().out
