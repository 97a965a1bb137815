"""vocab_parallel_cross_entropy against optax on the full logits, gradients included."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import flax_tp

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
