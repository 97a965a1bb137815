"""vocab_parallel_sample: the same ids from vocab-sharded logits as from whole ones, and
the distribution HF's temperature / top-k / top-p warpers define."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flax_tp
from flax_tp.sampling import vocab_parallel_sample

VOCAB = 10  # over 3 and 4 devices: padded shards


def sharded_sample(mesh, logits, keys, **kw):
  """Runs the sampler on vocab shards of ``logits [rows, VOCAB]`` inside shard_map."""
  layout = flax_tp.ShardLayout(VOCAB, mesh.shape["model"])
  fn = jax.shard_map(lambda x, k: vocab_parallel_sample(x, vocab_size=VOCAB, keys=k, **kw),
                     mesh=mesh, in_specs=(P(None, "model"), P()), out_specs=P())
  return np.asarray(jax.jit(fn)(layout.pad(logits, -1), keys))


def nucleus(probs, top_p):
  """HF's TopPLogitsWarper on one row: the kept ids."""
  order = np.argsort(probs, kind="stable")
  removed = np.cumsum(probs[order]) <= 1 - top_p
  removed[-1] = False
  return set(order[~removed].tolist())


@pytest.mark.parametrize("mesh_spec,kw", [
    ("1x3", {}), ("1x3", dict(temperature=0.7)), ("1x3", dict(temperature=1.3, top_k=3)),
    ("1x3", dict(temperature=1.0, top_p=0.6)), ("1x8", {}),
    ("1x8", dict(temperature=0.9, top_k=4, top_p=0.8))])  # 2, 2, then 1 id per device
def test_vocab_shards_give_the_same_ids(meshes, mesh_spec, kw):
  logits = jax.random.normal(jax.random.key(1), (64, VOCAB)) * 2
  logits = logits.at[0].set(jnp.array([0, 1, 2, 5, 1, 0, 2, 5, 1, 0.0]))  # a tie: id 3 wins
  keys = jax.random.split(jax.random.key(2), 64)
  whole = np.asarray(jax.jit(lambda x, k: vocab_parallel_sample(
      x, vocab_size=VOCAB, keys=k, **kw))(logits, keys))
  np.testing.assert_array_equal(sharded_sample(meshes[mesh_spec], logits, keys, **kw), whole)
  assert ((whole >= 0) & (whole < VOCAB)).all()
  if not kw:
    np.testing.assert_array_equal(whole, np.argmax(logits, axis=-1))
    assert whole[0] == 3


@pytest.mark.parametrize("kw", [
    dict(temperature=0.8), dict(temperature=1.5, top_k=4), dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.0, top_k=6, top_p=0.75)])
def test_samples_follow_the_filtered_softmax(meshes, kw):
  rows = 20_000
  logits = np.array([2.0, 1.5, 1.5, 0.3, -1.0, 0.9, 0.0, -0.5, 1.1, -2.0], np.float32)
  keys = jax.random.split(jax.random.key(3), rows)
  ids = sharded_sample(meshes["1x3"], jnp.broadcast_to(logits, (rows, VOCAB)), keys, **kw)
  scaled = logits / kw["temperature"]
  kept = set(range(VOCAB))
  if "top_k" in kw:
    kept = {i for i in kept if scaled[i] >= np.sort(scaled)[-kw["top_k"]]}
  probs = np.where([i in kept for i in range(VOCAB)], np.exp(scaled - scaled.max()), 0)
  probs /= probs.sum()
  if "top_p" in kw:
    kept &= nucleus(probs, kw["top_p"])
    probs = np.where([i in kept for i in range(VOCAB)], probs, 0)
    probs /= probs.sum()
  assert set(np.unique(ids).tolist()) == kept
  frequencies = np.bincount(ids, minlength=VOCAB) / rows
  # 4 standard errors of a frequency from 20k draws: at most 0.0142.
  np.testing.assert_allclose(frequencies, probs, atol=0.0142)


def test_sampling_without_keys_is_refused():
  with pytest.raises(ValueError, match="needs keys"):
    vocab_parallel_sample(jnp.zeros((2, VOCAB)), vocab_size=VOCAB, temperature=1.0)
