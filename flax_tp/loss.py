"""Cross-entropy on logits split over the vocabulary (Megatron's vocab-parallel loss)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_tp.collectives import all_reduce, axis_is_bound, shard_index
from flax_tp.mesh import MODEL_AXIS
from flax_tp.partition import ShardLayout


def vocab_parallel_cross_entropy(
    local_logits: jax.Array,
    labels: jax.Array,
    *,
    vocab_size: int | None = None,
    axis_name: str = MODEL_AXIS,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    ignore_index: int | None = None,
) -> jax.Array:
  """Per-token cross-entropy from vocab-sharded logits, never gathering them.

  local_logits: ``[..., vocab_pad]`` this device's padded shard of the logits
    (``VocabParallelEmbedding.attend`` inside ``shard_map``), varying over
    ``axis_name``. Outside ``shard_map`` (axis not bound) it is the full
    ``[..., vocab]`` and the same formula runs on one device.
  labels: ``[...]`` int ids in ``[0, vocab_size)``, replicated over ``axis_name``.
    Any other label gives a NaN loss (as optax's does for ids past the
    vocabulary), so a bad label surfaces instead of training on garbage.
  vocab_size: the logical vocabulary; needed when the shards are padded.
  ignore_index: a label that marks a token to leave out (HF's ``-100``): its
    loss and gradient are exactly 0. Average over the kept tokens with
    ``kept_token_count``.
  returns: ``[...]`` float32 loss per token, replicated over ``axis_name``.

  The loss is ``lse - (1 - a) * z_y - a * mean_j z_j + z_loss * lse**2`` with
  ``a = label_smoothing``: optax's ``smooth_labels`` target (mass ``a / V`` on
  every class) applied to the *whole* vocabulary, so it equals the unsharded
  formula on every mesh (Megatron's per-rank smoothing does not). Only two
  ``[...]``-sized all-reduces run (Megatron's three, the last two packed): the
  max, then one ``[2 or 3, ...]`` sum of the exponentials, the target logit and,
  with smoothing, the logit sum. Padded columns never enter the softmax.
  """
  if not 0.0 <= label_smoothing <= 1.0:
    raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
  sharded = axis_is_bound(axis_name)
  parts = jax.lax.axis_size(axis_name) if sharded else 1
  vocab = local_logits.shape[-1] * parts if vocab_size is None else vocab_size
  layout = ShardLayout(vocab, parts)
  if local_logits.shape[-1] != layout.padded_size:
    raise ValueError(
        f"local_logits has {local_logits.shape[-1]} vocabulary columns, expected "
        f"{layout.padded_size} (vocab_size={vocab} over {parts} devices, padded)"
    )
  index = shard_index(axis_name) if sharded else 0

  def reduce(x, op):
    return all_reduce(x, op, axis_name) if sharded else x

  logits = local_logits.astype(jnp.float32)
  # Padded columns are left out of the softmax; an even split has none to mask.
  valid = None if layout.is_even else layout.local_mask(index)
  logits_valid = logits if valid is None else jnp.where(valid, logits, -jnp.inf)
  # The max only stabilises the exponentials: lse is exact for any shift, so it
  # needs no derivative (and pmax has none).
  shift = reduce(jax.lax.stop_gradient(jnp.max(logits_valid, axis=-1)), "max")
  sums = [jnp.sum(jnp.exp(logits_valid - shift[..., None]), axis=-1)]

  local_label = labels - jnp.asarray(layout.offsets)[index]
  mine = (local_label >= 0) & (local_label < jnp.asarray(layout.sizes)[index])
  picked = jnp.take_along_axis(logits, jnp.where(mine, local_label, 0)[..., None],
                               axis=-1)[..., 0]
  sums.append(jnp.where(mine, picked, 0.0))
  if label_smoothing:
    sums.append(jnp.sum(logits_valid if valid is None else jnp.where(valid, logits, 0.0),
                        axis=-1))
  # One all-reduce carries the sum of exponentials, the target logit and (smoothing)
  # the sum of all logits: each meeting of the devices costs more than its few bytes.
  sum_exp, target, *total = reduce(jnp.stack(sums), "sum")
  lse = shift + jnp.log(sum_exp)
  if label_smoothing:
    loss = lse - (1.0 - label_smoothing) * target - label_smoothing * total[0] / vocab
  else:
    loss = lse - target
  if z_loss:
    loss = loss + z_loss * lse ** 2
  in_vocab = (labels >= 0) & (labels < vocab)
  loss = jnp.where(in_vocab, loss, jnp.nan)
  if ignore_index is not None:
    loss = jnp.where(labels == ignore_index, 0.0, loss)
  return loss


def kept_token_count(labels: jax.Array, ignore_index: int | None) -> jax.Array:
  """How many of ``labels`` count toward the mean loss (all, without ``ignore_index``)."""
  if ignore_index is None:
    return jnp.asarray(labels.size, jnp.float32)
  return jnp.sum(labels != ignore_index).astype(jnp.float32)


def chunked_token_loss(x: jax.Array, logits_of, per_token_loss, per_token: tuple = (), *,
                       chunks: int = 1) -> jax.Array:
  """The summed loss of a sequence's tokens, its logits made ``chunks`` pieces at a time.

  x: ``[b, n, d]`` the hidden states the head reads (this device's, as ``logits_of``
    takes them). logits_of: ``[b, c, d] -> [b, c, V_local]``, the head.
  per_token_loss(logits, *per_token): ``[b, c]`` each token's loss; ``per_token`` are
    arrays ``[b, m, ...]`` (the labels) cut as the tokens are (None passes through); the
    first ``m <= n`` tokens of ``x`` are scored (all ``n`` without per-token arrays).
  returns: the sum of every scored token's loss (float32 scalar).

  ``chunks=1``: the head on all of ``x`` at once (``[b, n, V_local]`` logits, float32 in the
  loss). More: the tokens cut in ``chunks`` pieces along the sequence (the last padded,
  its padding scored zero), one piece's logits made, scored and dropped before the next's
  (``jax.lax.map``), and made again in backward (``jax.checkpoint``): the logits held at
  once are ``[b, ceil(m / chunks), V_local]``, at the price of the head's matmul again
  (about a third more of its flops) and the loss's all-reduces once per piece.
  """
  if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
    raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
  scored = next((a.shape[1] for a in per_token if a is not None), x.shape[1])
  if chunks == 1:
    logits = logits_of(x)
    return per_token_loss(logits if scored == x.shape[1] else logits[:, :scored],
                          *per_token).sum()
  size = -(-scored // chunks)  # tokens per piece
  pad = size * chunks - scored

  def pieces(a):  # [b, m, ...] -> [chunks, b, size, ...], padding zero
    a = jnp.pad(a[:, :scored], [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(a.shape[0], chunks, size, *a.shape[2:]), 1, 0)

  real = pieces(jnp.ones(x.shape[:1] + (scored,), bool))

  @jax.checkpoint
  def piece_loss(args):
    x_c, real_c, *per_token_c = args
    loss = per_token_loss(logits_of(x_c), *per_token_c)
    return jnp.where(real_c, loss, jnp.zeros((), loss.dtype)).sum()

  return jnp.sum(jax.lax.map(piece_loss, (
      pieces(x), real, *(None if a is None else pieces(a) for a in per_token))))
