"""Embedding layers split over the vocabulary or over the features.

Both take ``nnx.Embed``'s arguments plus ``mesh`` and ``axis_name``, draw their
table from ``rngs`` as ``nnx.Embed`` does, and look ids up exactly as it does:
negative ids count from the end, ids outside ``[-num_embeddings,
num_embeddings)`` give rows of ``jnp.take``'s fill value for the compute dtype (NaN
for floats, the most negative value of a signed integer type, the largest of an
unsigned one). ``embedding_metadata`` and partitioned initializers are accepted as
``flax_tp.params.sharded_param`` describes.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_embed_init
from jax.sharding import Mesh, PartitionSpec as P

from flax_tp.collectives import (
  all_gather,
  all_reduce,
  copy_to_parallel,
  reduce_scatter,
  shard_index,
)
from flax_tp.layer import ParallelModule
from flax_tp.linear import split_local
from flax_tp.mesh import MODEL_AXIS
from flax_tp.padding import masked
from flax_tp.params import sharded_param
from flax_tp.partition import ShardLayout

Array = jax.Array


class _ParallelEmbed(ParallelModule):
  split_dim: int  # 0: vocabulary, 1: features

  def __init__(
      self,
      num_embeddings: int,
      features: int,
      *,
      mesh: Mesh,
      axis_name: str = MODEL_AXIS,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      embedding_init: Any = default_embed_init,
      promote_dtype: Any = dtypes.promote_dtype,
      rngs: nnx.Rngs,
      embedding_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    self._init_mesh(mesh, axis_name)
    self.layout = ShardLayout((num_embeddings, features)[self.split_dim], self.parallel_size)
    self.embedding = sharded_param(embedding_init, rngs.params(), (num_embeddings, features),
                                   param_dtype, mesh=mesh, axis_name=axis_name,
                                   dim=self.split_dim, metadata=embedding_metadata,
                                   name="embedding")
    self.num_embeddings = num_embeddings
    self.features = features
    self.dtype = dtype or self.embedding.dtype
    self.param_dtype = param_dtype
    self.promote_dtype = promote_dtype

  def _local_table(self) -> Array:
    """This device's block of the table inside a map, shape-checked (``_checked_local``)."""
    shape = [self.num_embeddings, self.features]
    shape[self.split_dim] = self.layout.padded_size
    return self._checked_local("embedding", self.embedding[...], tuple(shape))

  def _table(self, table: Array) -> Array:
    """This device's table with padding zeroed, in the compute dtype."""
    table = masked(table, self.layout, self.split_dim, self.axis_name)
    (table,) = self.promote_dtype((table,), dtype=self.dtype, inexact=False)
    return table

  def _check_ids(self, ids: Array) -> None:
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"Input type must be an integer or unsigned integer, got {ids.dtype}")


class VocabParallelEmbedding(_ParallelEmbed):
  """``nnx.Embed`` with the table ``[num_embeddings, features]`` split over its rows.

  Param (global, padded): ``embedding [parts * vocab_pad, features]`` sharded
  over the model axis on the vocabulary.

  ``__call__(ids [...])`` -> ``[..., features]`` replicated: each device looks up
  the ids in its own range (others give zero) and one all-reduce sums them.
  ``attend(x [..., features])`` -> logits: standalone ``[..., num_embeddings]``
  like ``nnx.Embed.attend``, left sharded over the vocabulary; inside
  ``shard_map`` this device's padded shard ``[..., vocab_pad]`` of the logits
  (padded columns are zero), for ``vocab_parallel_cross_entropy``, which never
  gathers the full logits.

  ``sequence_parallel``: inside ``shard_map`` the looked-up rows ``[..., s,
  features]`` are reduce-scattered over the sequence (the ids' last axis, which
  the axis size must divide) instead of all-reduced: this device gets its block
  ``[..., s / parts, features]``. Standalone, the result is the same either way.
  """

  split_dim = 0

  def __init__(self, num_embeddings: int, features: int, *, mesh: Mesh,
               sequence_parallel: bool = False, padding_idx: int | None = None, **kwargs):
    super().__init__(num_embeddings, features, mesh=mesh, **kwargs)
    self.sequence_parallel = sequence_parallel
    if padding_idx is not None and not (isinstance(padding_idx, int) and not isinstance(
        padding_idx, bool) and -num_embeddings <= padding_idx < num_embeddings):
      raise ValueError(f"padding_idx must be None or an integer in [-{num_embeddings}, "
                       f"{num_embeddings}), got {padding_idx!r}")
    # torch.nn.Embedding's padding_idx: the lookups of this id pass no gradient to its row
    # (the forward is unchanged; a tied head's use of the row still has one).
    self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings

  def __call__(self, inputs: Array, out_sharding: Any = None) -> Array:
    """``out_sharding``: Flax's argument, for a standalone call (see ``_standalone``)."""
    self._check_ids(inputs)
    if self._is_local():
      self._out_sharding(out_sharding)  # refuses a non-None one here
      return self._lookup(self._local_table(), inputs, scatter=self.sequence_parallel)
    return self._standalone(
        lambda ids: self._run_standalone(self._lookup, (self.embedding[...], ids),
                                         (self._spec(2, 0), P()), P(), batch=1, min_ndim=1),
        inputs, inputs.ndim, out_sharding)

  def _lookup(self, table: Array, ids: Array, scatter: bool = False) -> Array:
    layout, vocab = self.layout, self.num_embeddings
    table = self._table(table)
    if vocab == 1:  # nnx.Embed broadcasts a one-row table whatever the id
      ids = jnp.zeros_like(ids)
    ids = jnp.where(ids < 0, ids + vocab, ids)  # negative ids wrap, as in jnp.take
    valid = (ids >= 0) & (ids < vocab)
    index = shard_index(self.axis_name)
    local = ids - jnp.asarray(layout.offsets)[index]
    mine = (local >= 0) & (local < jnp.asarray(layout.sizes)[index])
    rows = jnp.take(table, jnp.where(mine, local, 0), axis=0)
    if self.padding_idx is not None:
      rows = jnp.where((ids == self.padding_idx)[..., None], jax.lax.stop_gradient(rows), rows)
    # jnp.take (hence nnx.Embed) fills the rows of out-of-range ids. A float fill (NaN)
    # is put in by every shard, so the sum carries it and no pass over the summed rows
    # is needed; an integer fill is set after the sum, where it cannot overflow.
    float_fill = jnp.issubdtype(rows.dtype, jnp.inexact)
    elsewhere = (jnp.where(valid, jnp.zeros((), rows.dtype), _take_fill_value(rows.dtype))
                 [..., None] if float_fill else jnp.zeros((), rows.dtype))
    rows = jnp.where(mine[..., None], rows, elsewhere)
    if not scatter:
      rows = all_reduce(rows, "sum", self.axis_name)
    else:
      if rows.ndim < 2 or rows.shape[-2] % self.parallel_size:
        raise ValueError(
            f"VocabParallelEmbedding(sequence_parallel=True) scatters the last axis of ids "
            f"{tuple(ids.shape)} over {self.parallel_size} devices; pad it to a multiple of "
            f"{self.parallel_size}")
      rows = reduce_scatter(rows, axis=rows.ndim - 2, axis_name=self.axis_name)
    if float_fill:
      return rows
    if scatter:  # this device's block of the tokens
      block = rows.shape[-2]
      valid = jax.lax.dynamic_slice_in_dim(valid, index * block, block, axis=-1)
    return jnp.where(valid[..., None], rows, _take_fill_value(rows.dtype))

  def attend(self, query: Array, out_sharding: Any = None) -> Array:
    """``out_sharding``: Flax's argument, for a standalone call (see ``_standalone``).

    On an Auto mesh with ``out_sharding=None`` the standalone logits stay split over
    the vocabulary (a global array sharded on its last axis): a loss over them then
    reduces ``[...]``-sized maxima and sums across devices instead of gathering
    ``[..., num_embeddings]``. On an Explicit mesh they are typed as ``nnx.Embed``'s.
    """
    if self._is_local():
      self._out_sharding(out_sharding)  # refuses a non-None one here
      return self._attend(self._local_table(), query)

    def logits(query):
      split = self._run_standalone(self._attend, (self.embedding[...], query),
                                   (self._spec(2, 0), P()), self._spec(query.ndim, -1),
                                   batch=1, share_input=True)
      return self.layout.unpad(split, -1)
    return self._standalone(logits, query, query.ndim - 1, out_sharding)

  def _attend(self, table: Array, query: Array) -> Array:
    table = masked(table, self.layout, 0, self.axis_name)
    query, table = self.promote_dtype((query, table), dtype=self.dtype)
    return jnp.dot(copy_to_parallel(query, self.axis_name), table.T)


class ParallelEmbedding(_ParallelEmbed):
  """``nnx.Embed`` with the table ``[num_embeddings, features]`` split over its columns.

  Param (global, padded): ``embedding [num_embeddings, parts * features_pad]``
  sharded over the model axis on the features.

  ``__call__(ids [...])``: standalone ``[..., features]``; inside ``shard_map``
  ``[..., features]`` replicated when ``gather_output``, else this device's
  padded feature shard ``[..., features_pad]``.
  ``attend(x [..., features])`` -> ``[..., num_embeddings]`` replicated (each
  device contracts its feature slice, then one all-reduce).
  """

  split_dim = 1

  def __init__(self, num_embeddings: int, features: int, *, mesh: Mesh,
               gather_output: bool = True, **kwargs):
    super().__init__(num_embeddings, features, mesh=mesh, **kwargs)
    self.gather_output = gather_output

  def __call__(self, inputs: Array, out_sharding: Any = None) -> Array:
    """``out_sharding``: Flax's argument, for a standalone call (see ``_standalone``)."""
    self._check_ids(inputs)
    if self._is_local():
      self._out_sharding(out_sharding)  # refuses a non-None one here
      return self._lookup(self._local_table(), inputs, gather=self.gather_output)

    def lookup(ids):
      out_spec = P() if self.gather_output else self._spec(ids.ndim + 1, -1)
      out = self._run_standalone(lambda t, i: self._lookup(t, i, gather=self.gather_output),
                                 (self.embedding[...], ids), (self._spec(2, 1), P()),
                                 out_spec, batch=1, min_ndim=1)
      return out if self.gather_output else self.layout.unpad(out, -1)
    return self._standalone(lookup, inputs, inputs.ndim, out_sharding)

  def _lookup(self, table: Array, ids: Array, *, gather: bool) -> Array:
    table = self._table(table)
    if self.num_embeddings == 1:
      rows = jnp.broadcast_to(table, ids.shape + table.shape[1:])
    else:
      rows = jnp.take(table, ids, axis=0)  # every device holds every row
    if not gather:
      return rows
    return self.layout.unpad(all_gather(rows, axis=-1, axis_name=self.axis_name), -1)

  def attend(self, query: Array, out_sharding: Any = None) -> Array:
    """``out_sharding``: Flax's argument, for a standalone call (see ``_standalone``)."""
    if self._is_local():
      self._out_sharding(out_sharding)  # refuses a non-None one here
      return self._attend(self._local_table(), query)
    return self._standalone(
        lambda q: self._run_standalone(self._attend, (self.embedding[...], q),
                                       (self._spec(2, 1), P()), P(), batch=1),
        query, query.ndim - 1, out_sharding)

  def _attend(self, table: Array, query: Array) -> Array:
    table = masked(table, self.layout, 1, self.axis_name)
    query, table = self.promote_dtype((query, table), dtype=self.dtype)
    partial = jnp.dot(split_local(query, self.layout, self.axis_name), table.T)
    return all_reduce(partial, "sum", self.axis_name)


def _take_fill_value(dtype: Any) -> jax.Array:
  """The value ``jnp.take`` (mode "fill", as ``nnx.Embed`` uses it) gives an
  out-of-range index in ``dtype``: NaN for inexact types, the most negative value
  of a signed integer type, the largest of an unsigned one, True for booleans."""
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.full((), jnp.nan, dtype)
  if jnp.issubdtype(dtype, jnp.signedinteger):
    return jnp.full((), jnp.iinfo(dtype).min, dtype)
  if jnp.issubdtype(dtype, jnp.unsignedinteger):
    return jnp.full((), jnp.iinfo(dtype).max, dtype)
  return jnp.full((), True, dtype)
