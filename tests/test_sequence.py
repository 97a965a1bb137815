"""flax_tp.sequence: sequence parallelism's split of an uneven sequence over the model axis."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import flax_tp
from flax_tp.sequence import SequenceSplit


def test_blocks_gather_back_to_the_sequence_and_padding_is_zero():
  """7 positions over 4 devices (blocks of 2, 2, 2, 1, stored padded to 2): each device's
  block of the whole sequence, gathered, is the sequence again; zero_padding zeroes the
  last device's padding row; for_scatter's stored form reduce-scatters to each block."""
  mesh = flax_tp.make_mesh("1x4")
  seq = SequenceSplit.of(7, 4)
  whole = jnp.arange(2 * 7 * 3, dtype=jnp.float32).reshape(2, 7, 3) + 1

  def local(x):
    block = seq.zero_padding(seq.block(x) + 100.0)  # padding rows become 0, not 100
    scattered = flax_tp.reduce_scatter(seq.for_scatter(x), axis=1)  # sum of 4 equal copies
    return seq.gather(block - 100.0 * (block != 0)), block, scattered

  gathered, blocks, scattered = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=P(), out_specs=(P(), P(None, "model"), P(None, "model")),
      check_vma=False))(whole)
  np.testing.assert_array_equal(gathered, whole)
  stored = np.asarray(seq.layout.pad(whole, 1))
  np.testing.assert_array_equal(np.asarray(blocks) - 100.0 * (np.asarray(blocks) != 0), stored)
  assert np.all(np.asarray(blocks)[:, 7] == 0)  # the last device's padding row
  np.testing.assert_array_equal(scattered, 4 * stored)
