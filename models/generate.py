"""Tensor-parallel text generation: a KV cache sharded like the kv heads, one prefill,
then one compiled decode step per token.

    prompts [B, P_bucket] (right-padded; row i's prompt is its first lengths[i] ids)
      -> prefill (one shard_map over ("data", "model")): the whole prompt through
         the model, writing every block's keys/values into the cache; the logits
         of each row's last prompt token only -> vocab-parallel pick -> token 0
      -> decode, once per further token: token [B] at position lengths + t - 1
         -> the cache's step (per block: one all-reduce of [b, 1, d] after
         attention, one after the MLP; one after the embedding) -> the
         vocab-parallel pick ([b]-sized reductions; the [b, vocab] logits are
         never gathered) -> token t

On a mesh with a context axis the prefill is split over it as training splits a
sequence (``Transformer.prefill``: each device its two chunks of the prompt, each
block's k/v all-gathered over "context" into the cache), and the cache is then whole on
every context device, so each decode step runs as above with no communication over
"context" (a split cache would need a gather or a ring per token for one query).

The cache of each block is ``(k, v)``, global ``[B, L, M * hkv_pad, head_dim]``
sharded ``P("data", None, "model", None)``: each device keeps exactly the kv heads
its query heads use (``KVHeadLayout``: replicated kv heads included, uneven
splits padded), and its share of the batch. ``L`` and the prompt length are
rounded up to buckets (powers of two, at least 16, at most ``max_seq_len``), so a
new prompt length compiles nothing new within its bucket, and no token does.

Rows are independent: a row's tokens are the same whatever other rows share its
batch (attention only reads the row's own cache up to its own position), and
sampling noise is drawn per (seed, token index, row index, vocabulary id), so a
seed gives the same tokens on every mesh.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import flax_tp
from flax_tp.context import ContextSplit
from flax_tp.data_parallel import global_rows, whole_over_data
from flax_tp.mesh import split_over
from flax_tp.sampling import vocab_parallel_sample
from models import execution as execution_lib
from models.config import TransformerConfig
from models.transformer import Transformer

MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen. ``temperature=0`` is greedy (top-k/top-p ignored,
  as in HF's ``do_sample=False``); top-k then top-p filter before sampling."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    t = self.temperature
    f32 = np.finfo(np.float32)
    # The logits are divided by it in float32: below the smallest normal number that
    # overflows to inf (NaN probabilities), above the largest it is inf itself.
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
        math.isfinite(t) and (t == 0 or float(f32.tiny) <= t <= float(f32.max))):
      raise ValueError(f"temperature must be 0 (greedy) or a number in [{float(f32.tiny):.4g}, "
                       f"{float(f32.max):.4g}] (float32's normal range), got {t!r}")
    k = self.top_k
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer))
                          or k < 1):
      raise ValueError(f"top_k must be an integer >= 1 or None, got {k!r}")
    p = self.top_p
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                          or not 0 < p <= 1):
      raise ValueError(f"top_p must be a number in (0, 1] or None, got {p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def static(self) -> tuple[bool, bool, bool]:
    """What changes the compiled step: greedy or not, top-k on, top-p on (p=1 is off)."""
    return (self.greedy, not self.greedy and self.top_k is not None,
            not self.greedy and self.top_p is not None and self.top_p < 1)

  def values(self) -> tuple[np.float32, np.int32, np.float32]:
    """The numbers the compiled step takes as arguments (no recompilation per value)."""
    return (np.float32(self.temperature or 1.0), np.int32(min(self.top_k or 1, 2**31 - 1)),
            np.float32(self.top_p or 1.0))


def bucket(n: int, cap: int) -> int:
  """``n`` rounded up to a power of two (at least ``MIN_BUCKET``), at most ``cap``."""
  return min(max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()), cap)


def kv_cache_bytes(cfg: TransformerConfig, mesh: Mesh, batch: int, cache_len: int) -> int:
  """Bytes of the KV cache one device holds: its rows of ``batch`` (split over
  ``"data"``), ``cache_len`` positions, its stored kv heads (``KVHeadLayout``,
  replicated and padding heads included), keys and values of every layer."""
  parts = mesh.shape[flax_tp.MODEL_AXIS]
  # (latent attention caches each head's expanded k and v, attn_dim wide)
  layout = flax_tp.KVHeadLayout(cfg.kv_heads * cfg.attn_dim, parts, cfg.attn_dim,
                                num_heads=cfg.num_heads)
  rows = -(-batch // mesh.shape[flax_tp.DATA_AXIS])
  return (2 * cfg.num_layers * rows * cache_len * layout.padded_size
          * jnp.dtype(cfg.compute_dtype).itemsize)


class Decoder:
  """The compiled prefill and decode steps of one model graph on one mesh.

  Holds no params: each call takes the model's current state, so a model that
  trains on reuses the same compiled steps.
  """

  def __init__(self, model: Transformer):
    if not isinstance(model, Transformer):
      raise TypeError(f"generate needs a models.transformer.Transformer (built or loaded on a "
                      f"mesh), got {type(model).__name__}")
    if model.execution.sequence_parallel:
      # Decoding a token is no sequence to split: run the same params through
      # the plain layers (sequence parallelism changes no param).
      model = execution_lib.view(
          model, dataclasses.replace(model.execution, sequence_parallel=False))
    self.graphdef, state = nnx.split(model)
    # An FSDP model's params are taken whole over "data" once per generation
    # (``_steps``), not gathered again for every token.
    self.specs = nnx.get_partition_spec(whole_over_data(state, place=False))
    self.cfg, self.mesh = model.cfg, model.mesh
    self.kv_heads = model.kv_cache_heads()
    self.data_size = self.mesh.shape[flax_tp.DATA_AXIS]
    batch = split_over(flax_tp.DATA_AXIS, self.data_size)
    self.row_spec = P(batch)
    self.cache_spec = P(batch, None, flax_tp.MODEL_AXIS, None)
    self.row_sharding = NamedSharding(self.mesh, self.row_spec)
    self.prefill = jax.jit(self._prefill, static_argnames=("cache_len", "sampling"))
    self.decode = jax.jit(self._decode, static_argnames=("sampling",), donate_argnums=(1,))

  def cache_bytes_per_device(self, batch: int, cache_len: int) -> int:
    """Bytes of the KV cache each device holds for ``batch`` rows of ``cache_len``."""
    return kv_cache_bytes(self.cfg, self.mesh, batch, cache_len)

  def _cache_specs(self):
    return tuple((self.cache_spec, self.cache_spec) for _ in range(self.cfg.num_layers))

  def _pick(self, logits, key, step, sampling, values):
    greedy, use_k, use_p = sampling
    if greedy:
      return vocab_parallel_sample(logits, vocab_size=self.cfg.vocab_size)
    temperature, top_k, top_p = values
    step_key = jax.random.fold_in(key, step)
    keys = jax.vmap(lambda row: jax.random.fold_in(step_key, row))(global_rows(logits.shape[0]))
    return vocab_parallel_sample(logits, vocab_size=self.cfg.vocab_size, keys=keys,
                                 temperature=temperature, top_k=top_k if use_k else None,
                                 top_p=top_p if use_p else None)

  def _prefill(self, state, tokens, lengths, key, values, *, cache_len, sampling):
    """tokens ``[B, Pb]``, lengths ``[B]`` -> (token 0 ``[B]``, the filled cache)."""
    cfg = self.cfg

    def local(state, tokens, lengths, key, values):
      model = nnx.merge(self.graphdef, state)
      b, s = tokens.shape
      if ContextSplit.here(s) is not None:  # the prompt split over "context"
        logits, cache = model.prefill(tokens, cache_len, lengths - 1)
      else:
        shape = (b, cache_len, self.kv_heads, cfg.attn_dim)
        cache = tuple((jnp.zeros(shape, cfg.compute_dtype),
                       jnp.zeros(shape, cfg.compute_dtype)) for _ in range(cfg.num_layers))
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        logits, cache = model.extend(tokens, cache, positions, lengths - 1)
      return self._pick(logits, key, 0, sampling, values), cache

    return jax.shard_map(local, mesh=self.mesh,
                         in_specs=(self.specs, self.row_spec, self.row_spec, P(), P()),
                         out_specs=(self.row_spec, self._cache_specs()),
                         )(state, tokens, lengths, key, values)

  def _decode(self, state, cache, tokens, lengths, done, key, step, eos, pad, values, *,
              sampling):
    """Token ``step - 1`` of each row ``[B]`` -> (token ``step`` ``[B]``, cache, done ``[B]``).

    The input token sits at position ``lengths + step - 1``. A row that has
    produced one of the ``eos [E]`` ids gives ``pad`` from then on.
    """
    def local(state, cache, tokens, lengths, done, key, step, eos, pad, values):
      model = nnx.merge(self.graphdef, state)
      positions = (lengths + step - 1)[:, None]
      logits, cache = model.extend(tokens[:, None], cache, positions,
                                   jnp.zeros_like(lengths))
      token = self._pick(logits, key, step, sampling, values)
      token = jnp.where(done, pad, token)
      return token, cache, done | _is_eos(token, eos)

    rows = self.row_spec
    return jax.shard_map(local, mesh=self.mesh,
                         in_specs=(self.specs, self._cache_specs(), rows, rows, rows, P(), P(),
                                   P(), P(), P()),
                         out_specs=(rows, self._cache_specs(), rows),
                         )(state, cache, tokens, lengths, done, key, step, eos, pad, values)


def _is_eos(token, eos):
  """``[b]`` whether each token is one of the ``[E]`` end ids (none when E = 0)."""
  return jnp.any(token[:, None] == eos[None, :], axis=-1)


_DECODERS: dict[Any, Decoder] = {}


def decoder_for(model: Transformer) -> Decoder:
  """The (cached) ``Decoder`` of ``model``'s graph and mesh."""
  key = (nnx.graphdef(model), model.mesh)
  if key not in _DECODERS:
    if len(_DECODERS) >= 8:
      _DECODERS.pop(next(iter(_DECODERS)))
    _DECODERS[key] = Decoder(model)
  return _DECODERS[key]


def prompt_array(prompt_ids: Any, lengths: Sequence[int] | None,
                 vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Checked ``[batch, P]`` int32 prompts (right-padded) and their ``[batch]`` lengths.

  prompt_ids: a ``[batch, P]`` int array (then ``lengths`` gives each row's
  prompt length, default ``P``), or a list of id sequences of any lengths.
  """
  if lengths is None and isinstance(prompt_ids, (list, tuple)) and all(
      isinstance(r, (list, tuple, np.ndarray)) for r in prompt_ids):
    rows = [np.asarray(r) for r in prompt_ids]
    if not rows:
      raise ValueError("no prompts given: expected at least one row of token ids")
    lengths = [len(r) for r in rows]
    ids = np.zeros((len(rows), max(lengths)), np.int64)
    for i, r in enumerate(rows):
      if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
        raise ValueError(f"prompt row {i} must be a sequence of integer token ids, got "
                         f"{r.dtype} of shape {r.shape}")
      ids[i, :len(r)] = r
  else:
    ids = np.asarray(prompt_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt_ids must be a [batch, prompt_len] integer array (or a list of "
                       f"id lists), got {ids.dtype} of shape {ids.shape}")
    if ids.shape[0] == 0:
      raise ValueError("no prompts given: prompt_ids has 0 rows")
  batch, width = ids.shape
  lengths = np.full(batch, width) if lengths is None else np.asarray(lengths)
  if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"lengths must be {batch} integers (one per prompt row), got {lengths!r}")
  for i, n in enumerate(lengths):
    if not 1 <= n <= width:
      raise ValueError(f"prompt row {i} has length {n}; each prompt needs 1 to {width} tokens")
    row = ids[i, :n]
    bad = row[(row < 0) | (row >= vocab_size)]
    if bad.size:
      raise ValueError(f"prompt row {i} holds token id {int(bad[0])}, outside the model's "
                       f"vocabulary [0, {vocab_size})")
  ids = np.where(np.arange(width) < lengths[:, None], ids, 0)
  return ids.astype(np.int32), lengths.astype(np.int32)


def stream(model: Transformer, prompt_ids: Any, *, max_new_tokens: int,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           seed: int = 0, lengths: Sequence[int] | None = None,
           eos_id: int | Sequence[int] | None = None, pad_id: int = 0) -> Iterator[np.ndarray]:
  """Yields the next token of every row, ``[batch]`` numpy int32, as each is chosen.

  Arguments as for ``generate``. Stops after ``max_new_tokens`` tokens, or once
  every row has produced ``eos_id``.
  """
  for token, done in _steps(model, prompt_ids, max_new_tokens=max_new_tokens,
                            sampling=Sampling(temperature, top_k, top_p), seed=seed,
                            lengths=lengths, eos_id=eos_id, pad_id=pad_id):
    yield np.asarray(token)
    if eos_id is not None and bool(np.all(done)):
      return


def generate(model: Transformer, prompt_ids: Any, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, lengths: Sequence[int] | None = None,
             eos_id: int | Sequence[int] | None = None, pad_id: int = 0) -> np.ndarray:
  """Continues each prompt by ``max_new_tokens`` tokens with a sharded KV cache.

  model: a ``Transformer`` built or loaded (``models.hf.load_hf``) on a mesh.
  prompt_ids: ``[batch, P]`` int token ids, or a list of id lists of any lengths.
    Prompts of different lengths are *right*-padded: pass ``lengths`` (row ``i``'s
    prompt is ``prompt_ids[i, :lengths[i]]``), or the list form, which sets them.
  temperature: 0 is greedy (HF's ``do_sample=False``); otherwise softmax sampling
    at that temperature after ``top_k`` and ``top_p`` filtering (HF's order).
  seed: the sampling noise; the same seed gives the same tokens on every mesh.
  eos_id: a token id (or a list of them) that ends a row; the row's later positions
    hold ``pad_id``.
  returns ``[batch, P + max_new_tokens]`` int32 numpy: row ``i`` holds its prompt,
  then its ``max_new_tokens`` new tokens (from ``lengths[i]`` on), then ``pad_id``.
  """
  prompts, row_lengths = prompt_array(prompt_ids, lengths, model.cfg.vocab_size)
  batch, width = prompts.shape
  out = np.full((batch, width + max_new_tokens), pad_id, np.int32)
  out[:, :width] = np.where(np.arange(width) < row_lengths[:, None], prompts, pad_id)
  tokens = []
  for step, (token, done) in enumerate(_steps(
      model, prompts, max_new_tokens=max_new_tokens,
      sampling=Sampling(temperature, top_k, top_p), seed=seed, lengths=row_lengths,
      eos_id=eos_id, pad_id=pad_id)):
    tokens.append(token)
    # Stop early once every row has ended; looking every 8 tokens keeps the host
    # from waiting on each step.
    if eos_id is not None and step % 8 == 7 and bool(np.all(done)):
      break
  new = np.stack([np.asarray(t) for t in tokens], axis=1)
  for i, n in enumerate(row_lengths):
    out[i, n:n + new.shape[1]] = new[i]
  return out


def _end_ids(eos_id) -> np.ndarray:
  """``[E]`` int32 end-of-text ids from None, one id or several (Llama 3 has three)."""
  ids = [] if eos_id is None else [eos_id] if np.ndim(eos_id) == 0 else list(eos_id)
  for i in ids:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < 2**31:
      raise ValueError(f"eos_id must be a token id >= 0 or a list of them, got {eos_id!r}")
  return np.asarray(ids, np.int32).reshape(-1)


def _steps(model: Transformer, prompt_ids: Any, *, max_new_tokens: int, sampling: Sampling,
           seed: int, lengths, eos_id, pad_id: int):
  """Yields (token ``[batch]``, done ``[batch]``) per new token, as device arrays."""
  cfg = model.cfg
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
    raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
  eos = _end_ids(eos_id)
  if not isinstance(pad_id, (int, np.integer)) or not 0 <= pad_id < 2**31:
    raise ValueError(f"pad_id must be a token id >= 0, got {pad_id!r}")
  prompts, lengths = prompt_array(prompt_ids, lengths, cfg.vocab_size)
  batch, width = prompts.shape
  longest = int(lengths.max()) + max_new_tokens
  if longest > cfg.max_seq_len:
    raise ValueError(f"a prompt of {int(lengths.max())} tokens plus max_new_tokens="
                     f"{max_new_tokens} is {longest} positions, past the model's max_seq_len "
                     f"{cfg.max_seq_len}")
  dec = decoder_for(model)
  cache_len = bucket(longest, cfg.max_seq_len)
  prompt_len = bucket(width, cache_len)
  # The batch is split over "data": pad it with copies of row 0 (dropped again).
  rows = -(-batch // dec.data_size) * dec.data_size
  padded = np.zeros((rows, prompt_len), np.int32)
  padded[:batch, :width] = prompts
  padded[batch:] = padded[0]
  row_lengths = np.concatenate([lengths, np.repeat(lengths[:1], rows - batch)])
  put = lambda x: jax.device_put(x, dec.row_sharding)
  state = whole_over_data(nnx.state(model))  # FSDP: gathered once, for every token
  key = jax.random.key(seed)
  values = sampling.values()
  lengths_dev = put(row_lengths)
  token, cache = dec.prefill(state, put(padded), lengths_dev, key, values,
                             cache_len=cache_len, sampling=sampling.static())
  done = _is_eos(token, jnp.asarray(eos))
  yield token[:batch], done[:batch]
  for step in range(1, max_new_tokens):
    token, cache, done = dec.decode(state, cache, token, lengths_dev, done, key,
                                    np.int32(step), eos, np.int32(pad_id), values,
                                    sampling=sampling.static())
    yield token[:batch], done[:batch]
