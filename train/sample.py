"""Text generation from a trained parallel model (no KV cache: small models only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_tp


def make_next_logits(trainer):
  """A compiled ``(params, window [1, S], position) -> logits [vocab]`` of one position.

  The window is replicated (one sequence); each device computes its vocabulary
  shard of the logits at ``position`` only, and those ``[vocab_pad]`` values are
  gathered, never the ``[S, vocab]`` logits.
  """
  graphdef, specs = trainer.graphdef, trainer.specs
  layout = flax_tp.ShardLayout(trainer.cfg.vocab_size, trainer.mesh.shape[flax_tp.MODEL_AXIS])

  def local(params, window, position):
    logits = nnx.merge(graphdef, params)(window)  # [1, S, vocab_pad] vocab-sharded
    row = jax.lax.dynamic_index_in_dim(logits[0], position, axis=0, keepdims=False)
    return layout.unpad(flax_tp.all_gather(row, axis=-1), -1)

  return jax.jit(jax.shard_map(local, mesh=trainer.mesh, in_specs=(specs, P(), P()),
                               out_specs=P()))


def generate(trainer, params, prompt: list[int], *, length: int, seq_len: int, seed: int,
             temperature: float = 0.7) -> list[int]:
  """Samples ``length`` token ids after ``prompt`` (temperature sampling, fixed seed)."""
  next_logits = make_next_logits(trainer)
  rng = np.random.default_rng(seed)
  tokens = list(prompt) or [ord("\n")]
  for _ in range(length):
    context = tokens[-seq_len:]
    window = np.zeros((1, seq_len), np.int32)
    window[0, :len(context)] = context
    logits = np.asarray(next_logits(params, jnp.asarray(window), len(context) - 1),
                        np.float64)
    probs = np.exp((logits - logits.max()) / temperature)
    tokens.append(int(rng.choice(len(probs), p=probs / probs.sum())))
  return tokens[len(prompt):]
