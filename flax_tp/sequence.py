"""Sequence parallelism's split of the sequence over the model axis (Megatron-SP)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax_tp.collectives import gather_to_parallel, shard_index
from flax_tp.context import ContextSplit
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


@dataclasses.dataclass(frozen=True)
class ActivationLayout:
  """How a step's activations are split along the sequence, in one object the blocks
  are given: over ``"context"`` first (``context``: this device's two chunks of the
  sequence, context parallelism), then over ``"model"`` between blocks (``sequence``:
  Megatron-SP's split of the device's tokens). Either may be None.

  Between blocks a device holds ``[b, n, d]``: ``n`` is the sequence (neither split),
  its context slots (``context.local_len``), or its SP block of those
  (``sequence.layout.padded_size``).
  """

  context: ContextSplit | None = None
  sequence: SequenceSplit | None = None

  @classmethod
  def here(cls, seq_len: int, *, sequence_parallel: bool, model_size: int,
           context_parallel: str = "all_gather") -> ActivationLayout:
    """The layout inside the step's map for a sequence of ``seq_len`` tokens: split over
    context whenever the context axis has more than one device, its attention by the
    ``context_parallel`` strategy (``flax_tp.context.STRATEGIES``)."""
    context = ContextSplit.here(seq_len, context_parallel)
    local = context.local_len if context is not None else seq_len
    sequence = SequenceSplit.of(local, model_size) if sequence_parallel else None
    return cls(context, sequence)

  @property
  def is_split(self) -> bool:
    return self.context is not None or self.sequence is not None

  def tokens(self, tokens_bs: jax.Array) -> jax.Array:
    """The tokens a device embeds: its context slots, padded for SP's split (the
    embedding then reduce-scatters to the SP block)."""
    if self.context is not None:
      tokens_bs = self.context.local(tokens_bs)
    return tokens_bs if self.sequence is None else self.sequence.layout.pad(tokens_bs, 1)

  def positions(self) -> jax.Array | None:
    """``[1, n]`` global positions of the tokens a block's attention works on (the
    device's context slots), or None for ``0 .. s-1``."""
    return None if self.context is None else self.context.positions()[None, :]

  def gather(self, x: jax.Array) -> jax.Array:
    """SP's block ``[b, s_pad, ...]`` -> the device's tokens (identity without SP)."""
    return x if self.sequence is None else self.sequence.gather(x)

  def for_scatter(self, y: jax.Array) -> jax.Array:
    return y if self.sequence is None else self.sequence.for_scatter(y)

  def zero_padding(self, x: jax.Array) -> jax.Array:
    return x if self.sequence is None else self.sequence.zero_padding(x)

  def of_whole(self, whole: jax.Array) -> jax.Array:
    """This device's between-blocks slots of a whole-sequence ``[b, S, ...]`` (a
    dropout mask drawn for the logical sequence, so no split changes it); padding
    slots read a real entry, which their zero weight leaves unused."""
    if self.context is not None:
      at = jnp.minimum(self.context.positions(), self.context.seq_len - 1)
      whole = jnp.take(whole, at, axis=1)
    return whole if self.sequence is None else self.sequence.block(whole)

  @property
  def logical_len(self) -> int | None:
    """The sequence's length when split (what a dropout mask is drawn for)."""
    if self.context is not None:
      return self.context.seq_len
    return None if self.sequence is None else self.sequence.layout.size
