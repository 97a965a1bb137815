"""vocab_parallel_cross_entropy against optax on the full logits, gradients included."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_tp
from models.config import TransformerConfig
from models.transformer import Transformer
from train.step import LossOptions, Trainer, make_optimizer

VOCAB = 257  # uneven over 2, 3, 4 and 8
LOGITS = 3.0 * jax.random.normal(jax.random.key(0), (4, 5, VOCAB))
LABELS = jax.random.randint(jax.random.key(1), (4, 5), 0, VOCAB).at[0, :3].set(
    jnp.array([0, VOCAB - 1, 128]))  # first and last ids, on the first and last shard
WEIGHTS = jax.random.uniform(jax.random.key(2), (4, 5))
OPTIONS = [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.2, 1e-2)]


def optax_loss(logits, smoothing, z_loss):
  targets = optax.smooth_labels(jax.nn.one_hot(LABELS, VOCAB), smoothing)
  loss = optax.softmax_cross_entropy(logits, targets)
  return loss + z_loss * jax.nn.logsumexp(logits, axis=-1) ** 2


def sharded_loss(mesh, smoothing, z_loss):
  layout = flax_tp.ShardLayout(VOCAB, mesh.shape["model"])
  per_device = jax.jit(jax.shard_map(
      lambda lg, lb: flax_tp.vocab_parallel_cross_entropy(
          lg, lb, vocab_size=VOCAB, label_smoothing=smoothing, z_loss=z_loss),
      mesh=mesh, in_specs=(P("data", None, "model"), P("data")), out_specs=P("data")))
  return lambda logits: per_device(layout.pad(logits, -1), LABELS)


@pytest.mark.parametrize("mesh_spec", ["1x1", "1x3", "2x4", "1x8"])
def test_matches_optax(meshes, mesh_spec):
  def all_options(loss_fns):
    """Per-token losses and gradients of a weighted sum, for every option, in one jit."""
    return [(fn(LOGITS), jax.grad(lambda lg, fn=fn: jnp.sum(fn(lg) * WEIGHTS))(LOGITS))
            for fn in loss_fns]

  mine = jax.jit(lambda: all_options(
      [sharded_loss(meshes[mesh_spec], s, z) for s, z in OPTIONS]))()
  ref = all_options([lambda lg, s=s, z=z: optax_loss(lg, s, z) for s, z in OPTIONS])
  for (loss, grad), (ref_loss, ref_grad) in zip(mine, ref, strict=True):
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_padded_columns_never_enter_softmax(meshes):
  """Huge values in the padding must change nothing: the padding is masked, not trusted."""
  mesh = meshes["2x4"]
  layout = flax_tp.ShardLayout(VOCAB, 4)
  padded = jnp.where(jnp.asarray(layout.valid_mask()), layout.pad(LOGITS, -1), 1e4)
  loss = jax.jit(jax.shard_map(
      lambda lg, lb: flax_tp.vocab_parallel_cross_entropy(lg, lb, vocab_size=VOCAB,
                                                          label_smoothing=0.1),
      mesh=mesh, in_specs=(P(None, None, "model"), P()), out_specs=P()))(padded, LABELS)
  np.testing.assert_allclose(loss, optax_loss(LOGITS, 0.1, 0.0), rtol=1e-6)


def test_unsharded_context_is_the_plain_formula():
  np.testing.assert_allclose(
      flax_tp.vocab_parallel_cross_entropy(LOGITS, LABELS, label_smoothing=0.1, z_loss=1e-3),
      optax_loss(LOGITS, 0.1, 1e-3), rtol=1e-6)


def test_bad_shapes_and_options(meshes):
  with pytest.raises(ValueError, match="64 vocabulary columns, expected 33"):
    jax.shard_map(lambda lg, lb: flax_tp.vocab_parallel_cross_entropy(lg, lb, vocab_size=VOCAB),
                  mesh=meshes["1x8"], in_specs=(P(None, None, "model"), P()),
                  out_specs=P())(jnp.zeros((4, 5, 8 * 64)), LABELS)
  with pytest.raises(ValueError, match="label_smoothing"):
    flax_tp.vocab_parallel_cross_entropy(LOGITS, LABELS, label_smoothing=1.5)


def test_labels_outside_the_vocabulary_give_nan_like_optax():
  logits = jax.random.normal(jax.random.key(0), (2, 4, 10))
  labels = jnp.array([[0, 10, 3, -1], [9, 2, 11, -100]])
  mine = flax_tp.vocab_parallel_cross_entropy(logits, labels)
  ref = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.clip(labels, 0, 9))
  bad = (labels < 0) | (labels >= 10)
  assert np.isnan(np.asarray(mine)[np.asarray(bad)]).all()
  np.testing.assert_allclose(np.asarray(mine)[~np.asarray(bad)],
                             np.asarray(ref)[~np.asarray(bad)], rtol=1e-6)
  assert np.isnan(optax.softmax_cross_entropy_with_integer_labels(logits, labels)[0, 1])


@pytest.mark.parametrize("spec", ["1x1", "2x4"])
def test_ignore_index_mean_over_global_kept_tokens(spec):
  """-100 labels, all in the first data shard's rows: the mean is over the kept tokens
  of the whole batch (a per-shard mean would weigh the shards' tokens differently)."""
  cfg = TransformerConfig.tiny()
  tokens = jax.random.randint(jax.random.key(1), (4, cfg.max_seq_len + 1), 0, cfg.vocab_size)
  labels = tokens[:, 1:].at[:2, :-3].set(-100)  # rows 0-1: only the last 3 tokens kept
  trainer = Trainer(Transformer(cfg, mesh=flax_tp.make_mesh(spec), rngs=nnx.Rngs(0)),
                    make_optimizer(lr=1e-2, steps=10), LossOptions(ignore_index=-100))
  sharding = trainer.batch_sharding
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, jax.device_put(tokens, sharding), None,
                                       jax.device_put(labels, sharding))

  def reference(params):
    logits = nnx.merge(trainer.graphdef, params)(tokens[:, :-1])
    kept = labels != -100
    per = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(kept, labels, 0))
    return jnp.sum(jnp.where(kept, per, 0.0)) / jnp.sum(kept)

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(trainer.params)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(flax_tp.unshard(grads)),
                  jax.tree.leaves(flax_tp.unshard(ref_grads)), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_loss_by_pieces_is_the_whole_loss_and_holds_a_piece_of_the_logits():
  """``chunked_token_loss``: the summed loss and its gradients (to the hidden states and
  the head) are the whole head's at any piece count, a count that leaves the last piece
  padded and labels shorter than the hidden states (a MoE's extra token) included; the
  compiled step's temporaries shrink with the pieces (the float32 logits never whole)."""
  b, n, d, vocab = 2, 64, 16, 512
  x = jax.random.normal(jax.random.key(0), (b, n, d))
  w = jax.random.normal(jax.random.key(1), (d, vocab)) / 4
  labels = jax.random.randint(jax.random.key(2), (b, n - 1), 0, vocab)
  per_token = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels)

  def loss(chunks):
    return jax.jit(jax.value_and_grad(lambda x, w: flax_tp.chunked_token_loss(
        x, lambda x: x @ w, per_token, (labels,), chunks=chunks), argnums=(0, 1)))

  want = per_token((x @ w)[:, :n - 1], labels).sum()
  (whole, (gx, gw)) = loss(1)(x, w)
  np.testing.assert_allclose(whole, want, rtol=1e-6)
  assert np.all(np.asarray(gx[:, -1]) == 0)  # the unscored token
  for chunks in (2, 5, 8):  # 63 tokens: pieces of 32, 13 (2 padded), 8 (1 padded)
    value, (cx, cw) = loss(chunks)(x, w)
    np.testing.assert_allclose(value, whole, rtol=1e-6)
    np.testing.assert_allclose(cx, gx, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(cw, gw, rtol=1e-5, atol=1e-6)

  # without per-token arrays every token is scored
  lse = lambda logits: jax.nn.logsumexp(logits, axis=-1)
  np.testing.assert_allclose(
      flax_tp.chunked_token_loss(x, lambda x: x @ w, lse, chunks=5),
      flax_tp.chunked_token_loss(x, lambda x: x @ w, lse), rtol=1e-6)
  np.testing.assert_allclose(flax_tp.chunked_token_loss(x, lambda x: x @ w, lse),
                             lse(x @ w).sum(), rtol=1e-6)

  def temporaries(chunks):
    return loss(chunks).lower(x, w).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = b * n * vocab * 4
  assert temporaries(1) >= logits_bytes
  assert temporaries(8) < temporaries(1) - logits_bytes // 2
  with pytest.raises(ValueError, match="chunks must be a positive integer, got 0"):
    flax_tp.chunked_token_loss(x, lambda x: x @ w, per_token, (labels,), chunks=0)
