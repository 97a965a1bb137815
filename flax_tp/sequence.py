"""Sequence parallelism's split of the sequence over the model axis (Megatron-SP)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax_tp.collectives import gather_to_parallel, shard_index
from flax_tp.partition import ShardLayout


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
  """How the sequence is split between the blocks under sequence parallelism.

  ``layout`` is a ``ShardLayout`` of the sequence: ``array_split`` blocks, each stored
  padded to the largest, so a length the axis does not divide works. Between blocks
  each device holds ``[b, padded_size, d]``; the padding rows are zero after the
  embedding and never reach a result (they are dropped before attention, the MLP and
  the head).
  """

  layout: ShardLayout

  @classmethod
  def of(cls, seq_len: int, parts: int) -> SequenceSplit:
    return cls(ShardLayout(seq_len, parts))

  def gather(self, x):
    """This device's block ``[b, s_pad, ...]`` -> the whole sequence ``[b, s, ...]``
    (varying: it feeds per-device work; backward reduce-scatters)."""
    return self.layout.unpad(gather_to_parallel(x, axis=1), 1)

  def for_scatter(self, y):
    """Per-device partial sums ``[b, s, ...]`` -> their stored form ``[b, parts *
    s_pad, ...]``, ready for a row layer's reduce-scatter."""
    return self.layout.pad(y, 1)

  def block(self, whole):
    """This device's block ``[b, s_pad, ...]`` of a whole-sequence ``[b, s, ...]``."""
    size = self.layout.padded_size
    return jax.lax.dynamic_slice_in_dim(self.layout.pad(whole, 1),
                                        shard_index() * size, size, axis=1)

  def zero_padding(self, x):
    """``x [b, s_pad, ...]`` with this device's padding rows set to zero."""
    return jnp.where(self.layout.local_mask(shard_index())[:, None], x,
                     jnp.zeros((), x.dtype))
