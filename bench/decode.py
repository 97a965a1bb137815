"""Decoding speed with the sharded KV cache against recomputing the whole sequence.

    python -m bench.decode                       # llama-125m, meshes 1x1 and 1x8
    python -m bench.decode --preset llama-tiny --contexts 16 --new-tokens 4   # a smoke run

For each mesh and context length (a random prompt of that many tokens, batch 1):

- cached: ``models.generate.stream`` after warm-up; decode tokens/s is the
  median rate between consecutive tokens (the prefill excluded);
- recompute: what decoding without a cache costs per token, one prefill of the
  whole context (every position through every layer; only the last
  position's logits, so no gather inflates it); tokens/s is its inverse;
- cache bytes per device for the whole cache (context + new tokens, rounded
  up to its bucket) against total / M, the share an even split would give.

Cache bytes need no run, so they are also given for ``--cache-meshes``. Prints one
JSON object (and writes it to ``--out``). Times on this CPU are of simulated
devices sharing its cores: ratios within one mesh, cached against recompute,
are the meaningful figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
  from models.config import TransformerConfig
  from train.errors import OneLineParser, comma_positive_ints, positive_int

  p = OneLineParser(prog="bench.decode", description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="llama-125m", choices=TransformerConfig.preset_names())
  p.add_argument("--meshes", default="1x1,1x8", help="meshes to time: DxM, DxCxM or named (data=2,model=4), comma-separated")
  p.add_argument("--cache-meshes", default="1x2,1x4,1x8", help="meshes of the cache-bytes table")
  p.add_argument("--contexts", type=comma_positive_ints, default=[128, 512],
                 help="prompt lengths")
  p.add_argument("--new-tokens", type=positive_int, default=16)
  p.add_argument("--repeats", type=positive_int, default=3, help="timed prefills per context")
  p.add_argument("--out", default=None)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax
  import numpy as np
  from flax import nnx

  import flax_tp
  from bench import mesh_list, meshes_or_exit, out_path_or_exit
  from models.config import TransformerConfig
  from models.generate import Sampling, bucket, decoder_for, kv_cache_bytes, stream
  from models.transformer import Transformer
  meshes_or_exit(mesh_list(args.meshes) + mesh_list(args.cache_meshes), "bench.decode")
  out_path_or_exit(args.out, "bench.decode")
  contexts = args.contexts
  longest = max(contexts) + args.new_tokens
  cfg = TransformerConfig.preset(args.preset, max_seq_len=max(
      TransformerConfig.preset(args.preset).max_seq_len, longest))
  results = {"preset": args.preset, "jax": jax.__version__, "platform": jax.devices()[0].platform,
             "new_tokens": args.new_tokens, "timed": {}, "cache": {}}
  for spec in mesh_list(args.meshes):
    mesh = flax_tp.make_mesh(spec)
    model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0))
    dec = decoder_for(model)
    state = nnx.state(model)
    rows = []
    for context in contexts:
      prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, context))
      list(stream(model, prompt, max_new_tokens=args.new_tokens))  # compile both steps
      stamps = []
      for _ in stream(model, prompt, max_new_tokens=args.new_tokens):
        stamps.append(time.perf_counter())
      cached = 1.0 / statistics.median(np.diff(stamps))
      # Recompute: the whole context through the model for one token's logits.
      cache_len = bucket(context + 1, cfg.max_seq_len)
      tokens = jax.device_put(np.zeros((dec.data_size, bucket(context, cache_len)), np.int32),
                              dec.row_sharding)
      lengths = jax.device_put(np.full(dec.data_size, context, np.int32), dec.row_sharding)
      args_ = (state, tokens, lengths, jax.random.key(0), Sampling().values())
      options = dict(cache_len=cache_len, sampling=Sampling().static())
      jax.block_until_ready(dec.prefill(*args_, **options))
      times = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(dec.prefill(*args_, **options))
        times.append(time.perf_counter() - start)
      recompute = 1.0 / statistics.median(times)
      rows.append(dict(context=context, cached_tokens_s=cached, recompute_tokens_s=recompute,
                       speedup=cached / recompute))
      print(f"{spec} context {context}: cached {cached:.1f} tokens/s, recompute "
            f"{recompute:.2f} tokens/s ({cached / recompute:.0f}x)", file=sys.stderr)
    results["timed"][spec] = rows
    del model, state
  cache_len = bucket(longest, cfg.max_seq_len)
  whole = kv_cache_bytes(cfg, flax_tp.make_mesh("1x1"), 1, cache_len)
  for spec in args.cache_meshes.split(","):
    mesh = flax_tp.make_mesh(spec)
    per_device = kv_cache_bytes(cfg, mesh, 1, cache_len)
    results["cache"][spec] = dict(
        cache_len=cache_len, per_device_bytes=per_device, total_bytes=whole,
        ratio_to_even_split=per_device * mesh.shape[flax_tp.MODEL_AXIS] / whole)
  print(json.dumps(results, indent=1))
  if args.out:
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
