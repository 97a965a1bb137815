"""The benchmarks' shared harness, below the entry scripts (``bench/run.py``,
``bench/mfu.py``, ``bench/memory.py``, ``bench/plan.py``): contenders (a compiled train
step that carries its state), interleaved timing, per-device bytes, model FLOPs and the
accelerators' datasheet peaks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

DEVICES = 8


def bench_config(preset: str, layers: int | None = None, seq_len: int = 128):
  """The preset with 8 heads and sizes 8 divides, so that GSPMD can shard it on 8 devices
  (a Llama preset keeps its kv heads: grouped-query attention)."""
  from models.config import TransformerConfig
  base = TransformerConfig.preset(preset)
  head_dim = max(2, (base.num_heads * base.head_dim) // 8 // 2 * 2)
  return TransformerConfig.preset(preset, num_heads=8, head_dim=head_dim, vocab_size=256,
                                  d_ff=-(-base.d_ff // 8) * 8,
                                  num_layers=layers or base.num_layers,
                                  max_seq_len=max(base.max_seq_len, seq_len))


def compile_timed(jitted, *args) -> tuple[Any, float]:
  t0 = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - t0


def per_device_bytes(tree) -> int:
  """Bytes device 0 holds for ``tree`` (its addressable shard of every array)."""
  import jax
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
             if isinstance(x, jax.Array))


def interleaved_medians(steps: dict[str, Callable[[], None]], repeats: int,
                        warmup: int = 2) -> dict[str, float]:
  """Median seconds per step of each contender, timed in turn, round-robin."""
  for fn in steps.values():
    for _ in range(warmup):
      fn()
  times = {name: [] for name in steps}
  for _ in range(repeats):
    for name, fn in steps.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(ts) for name, ts in times.items()}


class Contender:
  """A compiled train step that carries its own state from call to call."""

  def __init__(self, name, compiled, state: tuple, tokens, extra: tuple = ()):
    self.name, self.compiled, self.state, self.tokens, self.extra = (
        name, compiled, state, tokens, extra)

  def __call__(self) -> None:
    import jax
    out = self.compiled(*self.state, self.tokens, *self.extra)
    self.state = out[:2]
    jax.block_until_ready(out[2])


def flax_tp_contender(cfg, mesh, tokens_host, tx, execution=None):
  """flax_tp's compiled train step of ``cfg`` on ``mesh``, run as ``execution`` (a
  ``models.execution.Execution``; default: plain)."""
  import jax
  from flax import nnx

  from models.execution import Execution
  from models.transformer import Transformer
  from train.step import Trainer
  trainer = Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0),
                                execution=execution or Execution()), tx)
  # The step as train/run.py's loop runs it: its state held as lists of arrays.
  held = trainer.held(trainer.params, trainer.init_opt_state(trainer.params))
  tokens = jax.device_put(tokens_host, trainer.batch_sharding)
  compiled, seconds = compile_timed(held.jitted, *held.leaves, tokens, None)
  return trainer, Contender("flax_tp", compiled, held.leaves, tokens, (None,)), seconds


def at_point(cfg, batch: int, seq: int):
  """``(cfg, tokens)`` for a step of ``batch x seq``: ``cfg`` with room for ``seq``
  positions, and the benchmarks' tokens ``[batch, seq + 1]`` on the host (int32)."""
  import dataclasses

  import numpy as np

  from bench.peers import tokens_for
  cfg = dataclasses.replace(cfg, max_seq_len=max(seq, cfg.max_seq_len))
  return cfg, np.asarray(tokens_for(cfg, batch, seq))


def peer_contender(peer, tokens_host):
  import jax
  tokens = jax.device_put(tokens_host, peer.batch_sharding)
  compiled, seconds = compile_timed(peer.step, *peer.state(), tokens)
  return Contender(peer.name, compiled, peer.state(), tokens), seconds


# Dense peak FLOP/s from NVIDIA's datasheets (SXM, without sparsity).
PEAK_TFLOPS = {
    ("NVIDIA H200", "bfloat16"): 989.0, ("NVIDIA H200", "float32"): 494.0,  # TF32
    ("NVIDIA H100 80GB HBM3", "bfloat16"): 989.0, ("NVIDIA H100 80GB HBM3", "float32"): 494.0,
    # TPU v5e (JAX's device_kind "TPU v5 lite"): 197 TFLOP/s dense bf16; no float32 figure.
    ("TPU v5 lite", "bfloat16"): 197.0,
}


def param_count(cfg) -> int:
  """The model's logical params (no padding), counted without allocating them."""
  from models.reference import param_count as count
  return count(cfg)


def model_flops(cfg, params: int, batch: int, seq: int) -> int:
  """Model FLOPs of one train step (see the module docstring)."""
  matmul_params = params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
  attention = 12 * cfg.num_layers * seq * cfg.num_heads * cfg.head_dim
  return batch * seq * (6 * matmul_params + attention)


def out_of_memory(err: Exception) -> bool:
  return "RESOURCE_EXHAUSTED" in str(err) or "Out of memory" in str(err)


def peak_tflops(device_kind: str, dtype: str) -> float | None:
  """The datasheet's dense peak TFLOP/s of ``device_kind`` in ``dtype`` (float32: TF32),
  or None for a device the table does not hold."""
  return PEAK_TFLOPS.get((device_kind, dtype))
