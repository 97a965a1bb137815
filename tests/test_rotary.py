"""Rotary positions (``models.ops.rotary``): the cos/sin table a step holds as constants
gives the values the step would compute itself, and the step computes no sines.

The model's rotary against transformers' is in tests/test_families.py (every family's
logits); here the table's own contract: the same numbers, to float32's last place,
whichever way they are reached (positions 0 .. s-1 from the table, a cached step's traced
positions, a sequence past the table's limit), the rotation itself right to float32, and
none of it left in the compiled step.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ops
from models.config import RopeScaling, TransformerConfig
from models.transformer import Transformer
from train.step import Trainer, make_optimizer

SCALINGS = {
    "plain": dict(),
    "partial": dict(rotary_dim=6),
    "linear": dict(scaling=RopeScaling(kind="linear", factor=4.0)),
    "llama3": dict(scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_len=32)),
    "yarn": dict(scaling=RopeScaling(kind="yarn", factor=4.0, original_max_len=32,
                                     attention_factor=1.2)),
}


@pytest.mark.parametrize("kind", SCALINGS)
def test_the_table_gives_what_the_step_computes(kind, monkeypatch):
  """Positions 0 .. s-1 read from the table, traced positions (a cached step) and a
  sequence past the table's limit (angles in the step) rotate alike: the same float32
  angles, the table's cos/sin rounded from float64 and XLA's within an ulp of them."""
  kw = SCALINGS[kind]
  x = jax.random.normal(jax.random.key(0), (2, 37, 3, 10))
  rotate = jax.jit(lambda x, positions: ops.rotary(x, 500.0, positions, **kw))
  from_table = rotate(x, None)
  traced = rotate(x, jnp.broadcast_to(jnp.arange(37), (2, 37)))
  monkeypatch.setattr(ops, "ROTARY_TABLE_LIMIT", 0)
  in_step = jax.jit(lambda x: ops.rotary(x, 500.0, **kw))(x)
  ulps = 4 * np.finfo(np.float32).eps * float(jnp.abs(x).max())  # |x| ~ 4: 2e-6
  np.testing.assert_allclose(traced, from_table, rtol=0, atol=ulps)
  np.testing.assert_array_equal(in_step, traced)  # both XLA's, of the same angles
  # a cached step's later positions are the table's later rows
  later = rotate(x[:, 30:], jnp.broadcast_to(jnp.arange(30, 37), (2, 7)))
  np.testing.assert_allclose(later, from_table[:, 30:], rtol=0, atol=ulps)


@pytest.mark.parametrize("kind", ["plain", "partial", "yarn"])
def test_the_rotation_is_rotary_to_float32(kind):
  """Half-split rotary as transformers computes it (``rotate_half``), in float64 from
  the same inverse frequencies: the table is cos and sin of the right angles, the
  passed-through dims untouched."""
  kw = SCALINGS[kind]
  x = np.asarray(jax.random.normal(jax.random.key(1), (1, 300, 2, 10)), np.float64)
  dim = kw.get("rotary_dim", 10)
  inv_freq, factor = ops.inverse_frequencies(dim, 500.0, kw.get("scaling"))
  angles = np.arange(300)[:, None] * np.asarray(inv_freq, np.float64)
  cos = np.concatenate([np.cos(angles)] * 2, -1)[None, :, None] * factor
  sin = np.concatenate([np.sin(angles)] * 2, -1)[None, :, None] * factor
  rotated = x[..., :dim]
  half = np.concatenate([-rotated[..., dim // 2:], rotated[..., :dim // 2]], -1)
  want = np.concatenate([rotated * cos + half * sin, x[..., dim:]], -1)
  got = jax.jit(lambda x: ops.rotary(x, 500.0, **kw))(jnp.asarray(x, jnp.float32))
  # angles up to 300 rad: float32's rounding of them is ~1e-5
  np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)
  np.testing.assert_array_equal(got[..., dim:], np.asarray(x[..., dim:], np.float32))


def test_the_compiled_step_computes_no_sines(meshes):
  """The train step's rotary tables are constants: its compiled program evaluates no
  sine; the cosines left are the learning-rate schedule's, one scalar per optimizer
  update."""
  cfg = TransformerConfig.preset("tiny", num_layers=1, rope_scaling=SCALINGS["yarn"]["scaling"])
  trainer = Trainer(Transformer(cfg, mesh=meshes["2x4"], rngs=nnx.Rngs(0)),
                    make_optimizer(lr=1e-3, steps=10))
  tokens = jax.device_put(np.zeros((4, cfg.max_seq_len + 1), np.int32), trainer.batch_sharding)
  hlo = trainer.train_step.lower(trainer.params, trainer.init_opt_state(trainer.params),
                                 tokens, None).compile().as_text()
  assert " sine(" not in hlo
  cosines = [line for line in hlo.splitlines() if " cosine(" in line]
  assert cosines and all(re.search(r"= f32\[\] cosine\(", line) for line in cosines)
