"""VocabParallelEmbedding / ParallelEmbedding against nnx.Embed built from the same seed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import F32, adamw_step, assert_padding_zero, assert_state_close, inside_shard_map
from jax.sharding import PartitionSpec as P

import flax_tp

# 1x2: an even split, as 2x4's; one device and 1x8 in the slow lane.
MESHES = [pytest.param("1x1", marks=pytest.mark.slow), "2x4",
          pytest.param("1x8", marks=pytest.mark.slow), "1x3"]
SIZES = [(16, 8), (257, 6), (3, 3)]  # even, vocab 257 uneven everywhere, smaller than the axis
LAYERS = [flax_tp.VocabParallelEmbedding, flax_tp.ParallelEmbedding]


def ids_for(vocab):
  """Ids covering every shard, the ends, negative ids and out-of-range ids."""
  return jnp.array([[0, 1, vocab - 1, vocab // 2, -1, -vocab, vocab, -vocab - 1]])


def loss_fn(layer, q):
  # NaN rows (out-of-range ids) are dropped so the gradients stay finite.
  rows = jnp.nan_to_num(layer(ids_for(layer.num_embeddings)))
  return jnp.sum(jnp.sin(rows)) + jnp.sum(jnp.cos(layer.attend(q)))


@nnx.jit
def lookup_attend_grads(layer, q):
  ids = ids_for(layer.num_embeddings)
  return layer(ids), layer.attend(q), nnx.grad(loss_fn, argnums=(0, 1))(layer, q)


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_standalone_matches_embed(meshes, mesh_spec, cls):
  for vocab, features in SIZES:
    layer = cls(vocab, features, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0))
    ref = nnx.Embed(vocab, features, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(flax_tp.unshard(layer)["embedding"][...], ref.embedding[...])
    q = jax.random.normal(jax.random.key(1), (2, 3, features))
    rows, logits, (grads, g_q) = lookup_attend_grads(layer, q)
    rows_ref, logits_ref, (grads_ref, g_qref) = lookup_attend_grads(ref, q)
    # Lookups are exact, NaN rows included (negative ids wrap, too large give NaN).
    np.testing.assert_array_equal(rows, rows_ref)
    assert np.isnan(rows[0, -2:]).all() and not np.isnan(rows[0, :-2]).any()
    np.testing.assert_allclose(logits, logits_ref, **F32)
    assert_state_close(grads, grads_ref)
    np.testing.assert_allclose(g_q, g_qref, **F32)
    adamw_step(layer, grads)
    adamw_step(ref, grads_ref)
    assert_state_close(layer, ref)
    assert_padding_zero(layer)


def test_vocab_parallel_inside_shard_map_with_loss(meshes):
  """Embed -> tied head -> vocab-parallel loss, all on local shards, as in the model."""
  mesh = meshes["2x4"]
  vocab, features = 257, 6
  layer = flax_tp.VocabParallelEmbedding(vocab, features, mesh=mesh, rngs=nnx.Rngs(0))
  ref = nnx.Embed(vocab, features, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(2), (4, 5), 0, vocab)
  labels = jnp.roll(ids, -1, axis=1)

  def loss(embed, ids, labels):
    h = jnp.tanh(embed(ids))
    logits = embed.attend(h)
    per_token = flax_tp.vocab_parallel_cross_entropy(logits, labels, vocab_size=vocab)
    local = per_token.sum() / labels.size / (jax.lax.axis_size("data") if
                                               flax_tp.axis_is_bound("data") else 1)
    return jax.lax.psum(local, "data") if flax_tp.axis_is_bound("data") else local

  def ref_loss(embed, ids, labels):
    logits = embed.attend(jnp.tanh(embed(ids)))
    return jnp.mean(
        -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))

  value, grads = inside_shard_map(layer, loss, mesh, ids, labels,
                                  in_specs=[P("data"), P("data")])
  ref_value, ref_grads = nnx.value_and_grad(ref_loss)(ref, ids, labels)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  assert_state_close(grads, ref_grads)
  assert_padding_zero(grads)


@pytest.mark.parametrize("mesh_spec", ["2x4", "1x3"])
def test_scattered_lookup_fills_bad_ids(meshes, mesh_spec):
  """``sequence_parallel``: the summed rows scattered over the tokens, each device's
  block equal to nnx.Embed's rows there, NaN rows for out-of-range ids included (every
  shard puts the NaN in, so the reduce-scatter carries it), on an even and an uneven
  vocabulary split."""
  mesh = meshes[mesh_spec]
  parts = mesh.shape["model"]
  for vocab, features in SIZES:
    layer = flax_tp.VocabParallelEmbedding(vocab, features, mesh=mesh, sequence_parallel=True,
                                           rngs=nnx.Rngs(0))
    ref = nnx.Embed(vocab, features, rngs=nnx.Rngs(0))
    ids = jnp.tile(ids_for(vocab), (2, parts))  # [2, 8 * parts]: splits evenly
    graphdef, state = nnx.split(layer)
    rows = jax.jit(jax.shard_map(lambda s, i, g=graphdef: nnx.merge(g, s)(i), mesh=mesh,
                                 in_specs=(nnx.get_partition_spec(state), P()),
                                 out_specs=P(None, "model")))(state, ids)
    np.testing.assert_array_equal(rows, ref(ids))
    assert np.isnan(rows[:, 6:8]).all() and not np.isnan(rows[:, :6]).any()


def test_parallel_embedding_local_shard(meshes):
  mesh = meshes["1x3"]
  layer = flax_tp.ParallelEmbedding(10, 7, mesh=mesh, gather_output=False, rngs=nnx.Rngs(0))
  ref = nnx.Embed(10, 7, rngs=nnx.Rngs(0))
  ids = jnp.array([[1, 9, 3]])
  graphdef, state = nnx.split(layer)
  local = jax.jit(jax.shard_map(lambda s, i: nnx.merge(graphdef, s)(i), mesh=mesh,
                                in_specs=(nnx.get_partition_spec(state), P()),
                                out_specs=P(None, None, "model")))(state, ids)
  np.testing.assert_array_equal(local, layer.layout.pad(ref(ids), -1))
  np.testing.assert_array_equal(layer(ids), ref(ids))


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_bfloat16_and_custom_init(meshes, cls):
  kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
            embedding_init=nnx.initializers.normal(0.5))
  layer = cls(11, 6, mesh=meshes["2x4"], rngs=nnx.Rngs(4), **kw)
  ref = nnx.Embed(11, 6, rngs=nnx.Rngs(4), **kw)
  assert_state_close(layer, ref, rtol=0, atol=0)
  ids = jnp.arange(11)[None]
  out = layer(ids)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref(ids), np.float32))
  q = jnp.ones((2, 6), jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(layer.attend(q), np.float32),
                             np.asarray(ref.attend(q), np.float32), rtol=2e-2, atol=2e-2)


def test_float_ids_rejected(meshes):
  layer = flax_tp.VocabParallelEmbedding(8, 4, mesh=meshes["1x2"], rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="integer"):
    layer(jnp.zeros((2,), jnp.float32))
