"""Ring attention (``flax_tp.ring_attention``) against one device's attention.

The ring's forward (an online softmax merged block by block) and its backward (a second
ring carrying the k/v gradients home) are written by hand, so they are checked on
their own here, before the model tests use them: the output and the gradients of q, k
and v against ``models.attention.attend`` over the whole sequence on one device, at
lengths ``2C`` does not divide, with grouped-query heads, windows, soft-capping,
dropout and attention sinks (whose gradient the ring's backward gives too), and on meshes where the ring's devices also split data and model.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flax_tp
from flax_tp.context import ContextSplit
from flax_tp.hlo import collectives
from flax_tp.ring_attention import ring_attention
from models import attention, ops

B, H, G, D = 2, 4, 2, 8


def _inputs(seq_len):
  keys = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(keys[0], (B, seq_len, H, D))
  k = jax.random.normal(keys[1], (B, seq_len, G, D))
  v = jax.random.normal(keys[2], (B, seq_len, G, D))
  weights = jax.random.normal(keys[3], (B, seq_len, H, D))
  return q, k, v, weights


SINKS = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)  # one per head, of the scores' size


def _one_device(q, k, v, sinks, *, window, softcap, rate, key):
  seq_len = q.shape[1]
  pos = jnp.arange(seq_len)
  dropout = attention.Dropout(key, jnp.arange(B), jnp.arange(H), seq_len) if rate else None
  spec = attention.AttentionSpec(window, softcap=softcap, dropout=rate, sinks=sinks)
  return attention.attend(q, k, v, spec, pos, pos, dropout=dropout)


def _ring(mesh, q, k, v, sinks, *, window, softcap, rate, key):
  seq_len = q.shape[1]

  def local(q, k, v, sinks):
    split = ContextSplit.here(seq_len)
    q, k, v = (split.local(t) for t in (q, k, v))
    keep_rows = None
    if rate > 0.0:
      keep = ops.keep_mask(key, rate, jnp.arange(B), (seq_len, seq_len), jnp.arange(H))
      keep_rows = jnp.take(keep, jnp.minimum(split.positions(), seq_len - 1), axis=2)
    out = ring_attention(q, k, v, jnp.arange(H) // (H // G), split=split, window=window,
                         softcap=softcap, keep_rows=keep_rows, rate=rate, sinks=sinks)
    return split.whole(out)

  return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P()),
                       out_specs=P())(q, k, v, sinks)


def _value_and_grads(attend, q, k, v, sinks, weights):
  loss = lambda q, k, v, sinks: jnp.sum(attend(q, k, v, sinks) * weights)
  argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
  return (jax.value_and_grad(loss, argnums=argnums)(q, k, v, sinks),
          attend(q, k, v, sinks))


CASES = {
    "plain": dict(window=None, softcap=None, rate=0.0),
    "window": dict(window=3, softcap=None, rate=0.0),
    "softcap": dict(window=None, softcap=5.0, rate=0.0),
    "sinks": dict(window=3, softcap=None, rate=0.0, sinks=True),
    "all": dict(window=4, softcap=2.0, rate=0.2, sinks=True),
}


FAST = {("1x4x1", 13, "all")}


# Each case alone on two meshes; on 1x8x1 (7 tokens over 8 devices: a device holding
# padding alone) every mechanism at once ("all": window, soft cap, dropout, sinks): each
# mechanism alone on two meshes, and all of them on the third.
@pytest.mark.parametrize("mesh_spec,seq_len,case", [
    pytest.param(mesh, n, case, marks=() if (mesh, n, case) in FAST else pytest.mark.slow)
    for mesh, n in [("1x4x1", 13), ("2x2x2", 8), ("1x8x1", 7)] for case in CASES
    if mesh != "1x8x1" or case == "all"])
def test_ring_gives_one_devices_attention_and_gradients(mesh_spec, seq_len, case):
  mesh = flax_tp.make_mesh(mesh_spec)
  q, k, v, weights = _inputs(seq_len)
  options = dict(CASES[case], key=jax.random.key(7))
  sinks = SINKS if options.pop("sinks", False) else None
  (want_loss, want_grads), want = jax.jit(lambda *a: _value_and_grads(
      functools.partial(_one_device, **options), *a))(q, k, v, sinks, weights)
  (got_loss, got_grads), got = jax.jit(lambda *a: _value_and_grads(
      functools.partial(_ring, mesh, **options), *a))(q, k, v, sinks, weights)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for name, g, w in zip(("q", "k", "v", "sinks")[:len(want_grads)], got_grads, want_grads,
                        strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_a_sink_is_one_more_column_of_the_softmax_that_takes_no_value():
  """The local core's sinks against the definition written out (transformers' GPT-OSS
  eager attention): the scaled scores, masked, with each head's sink appended as a last
  column, through one softmax; that column dropped before the values."""
  seq_len = 5
  q, k, v, _ = _inputs(seq_len)
  got = _one_device(q, k, v, SINKS, window=3, softcap=None, rate=0.0, key=None)
  kr, vr = (jnp.repeat(t, H // G, axis=2) for t in (k, v))
  scores = jnp.einsum("bqhd,bthd->bhqt", q, kr) / jnp.sqrt(D)
  pos = jnp.arange(seq_len)
  seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 3)
  scores = jnp.where(seen, scores, -jnp.inf)
  column = jnp.broadcast_to(SINKS[None, :, None, None], (B, H, seq_len, 1))
  probs = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
  want = jnp.einsum("bhqt,bthd->bqhd", probs, vr)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # and a sink takes weight: without it the rows sum their values with weights adding to 1
  plain = _one_device(q, k, v, None, window=3, softcap=None, rate=0.0, key=None)
  assert float(jnp.max(jnp.abs(plain - got))) > 1e-2


def test_ring_moves_each_block_around_once_each_way():
  """Forward: C-1 shifts of the stacked k/v block; backward (the ring turning the other
  way, so that XLA cannot reuse the forward's blocks and keep all C alive): C-1 more of
  k/v and C of its gradient; each one block's bytes, over "context" only."""
  mesh = flax_tp.make_mesh("1x4x1")
  q, k, v, weights = _inputs(13)
  step = jax.jit(lambda *a: _value_and_grads(functools.partial(
      _ring, mesh, window=None, softcap=None, rate=0.0, key=None), *a)[0])
  found = collectives(step.lower(q, k, v, None, weights).compile().as_text(), mesh)
  permutes = [c for c in found if c.kind == "collective-permute"]
  block = 2 * B * ContextSplit(13, 4).local_len * G * D * 4  # k and v stacked, float32
  assert len(permutes) == 3 + 3 + 4, found
  assert {(c.axes, c.bytes) for c in permutes} == {(("context",), block)}, permutes
