"""Context parallelism for long sequences: memory per device, bytes over "context" and
step time, all-gather against ring against no context axis.

    python -m bench.context                     # every section (about 20 CPU minutes)
    python -m bench.context --sections bytes,step --bytes-seq 512 --repeats 2  # a smoke run

Sections:
- memory: ``--preset``'s (``llama-350m``) train step compiled from abstract inputs
  (nothing is allocated or run) at each of ``--seqs``, global batch 1, scanned layers
  and block remat (how a long sequence is trained), on ``1x8`` (sequence parallelism
  over 8, no context axis), ``1x2x4`` and ``1x8x1`` with each strategy (and ``1x8x1``
  with FSDP): XLA's temporary bytes per device. From the three lengths, a quadratic (attention's scores grow with
  the square of the sequence, the rest linearly) gives the longest sequence each
  layout trains within ``--budget-gib`` of temporaries per device;
- bytes: what one block's attention moves over "context" per device (received bytes,
  from the compiled step's HLO: two unscanned layers without remat, divided by two),
  against the analytic minimum: every other device's k/v once forward and their
  gradients once backward, ``2 (C - 1)`` blocks of ``[b, L, hkv_local, head_dim]`` k and v
  (``hkv_local``: the kv heads a model shard stores, ``KVHeadLayout``);
- step: median step time of ``--step-preset`` at ``--step-seq`` on this CPU, no context
  axis / all-gather / ring, side by side (interleaved repeats). CPU step times of 8
  simulated devices on 2 cores say which does more work, not what a GPU cluster sees.
Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SECTIONS = ("memory", "bytes", "step")
# (label, mesh, Execution fields): the layouts every section compares.
LAYOUTS = (
    ("none", "1x8", dict(sequence_parallel=True)),
    ("all_gather", "1x2x4", dict(sequence_parallel=True)),
    ("ring", "1x2x4", dict(sequence_parallel=True, context_parallel="ring")),
    ("all_gather", "1x8x1", {}),
    ("ring", "1x8x1", dict(context_parallel="ring")),
)
# The memory section adds FSDP on the context-only mesh: without tensor parallelism each
# device would hold every param and gradient whole (FSDP splits them over data x context).
MEMORY_LAYOUTS = LAYOUTS + (
    ("all_gather+fsdp", "1x8x1", dict(fsdp=True)),
    ("ring+fsdp", "1x8x1", dict(context_parallel="ring", fsdp=True)),
)
LONG = dict(scan_layers=True, remat="block")  # how the memory section trains


def parse_args(argv=None) -> argparse.Namespace:
  from models.config import TransformerConfig
  from train.errors import OneLineParser, comma_choices, comma_positive_ints, positive_int

  presets = TransformerConfig.preset_names()
  p = OneLineParser(prog="bench.context", description=__doc__.split("\n\n")[0])
  p.add_argument("--sections", type=comma_choices(SECTIONS), default=list(SECTIONS),
                 help=f"comma-separated, from {','.join(SECTIONS)}")
  p.add_argument("--preset", default="llama-350m", choices=presets,
                 help="model of the memory and bytes sections")
  p.add_argument("--seqs", type=comma_positive_ints, default=[4096, 8192, 16384],
                 help="sequence lengths of the memory section (three or more give the "
                 "budget's fit)")
  p.add_argument("--budget-gib", type=float, default=16.0,
                 help="temporary bytes per device the longest-sequence estimate allows")
  p.add_argument("--bytes-seq", type=positive_int, default=4096)
  p.add_argument("--step-preset", default="small", choices=presets)
  p.add_argument("--step-seq", type=positive_int, default=1024)
  p.add_argument("--repeats", type=positive_int, default=5)
  p.add_argument("--out", default=None)
  return p.parse_args(argv)


def _label(name: str, spec: str) -> str:
  return f"{spec} {name}"


def memory_section(args, log) -> dict:
  import flax_tp
  from bench.memory import abstract_step
  from models.config import TransformerConfig
  rows = []
  for seq in args.seqs:
    for name, spec, options in MEMORY_LAYOUTS:
      cfg = TransformerConfig.preset(args.preset, max_seq_len=seq)
      compiled, seconds = abstract_step(cfg, flax_tp.make_mesh(spec), 1, seq,
                                        execution={**LONG, **options})
      stats = compiled.memory_analysis()
      rows.append(dict(seq=seq, mesh=spec, strategy=name, temp_bytes=stats.temp_size_in_bytes,
                       argument_bytes=stats.argument_size_in_bytes, compile_s=seconds))
      log(f"memory {args.preset} {spec} {name} seq {seq}: temp "
          f"{stats.temp_size_in_bytes / 2**20:.1f} MiB per device ({seconds:.0f} s to compile)")
  return dict(rows=rows, longest=_longest(rows, args.budget_gib * 2**30))


def _longest(rows: list[dict], budget: float) -> dict:
  """Per layout: the longest sequence whose fitted temporaries stay within ``budget``
  (a quadratic through the measured lengths, least squares beyond three)."""
  import numpy as np
  out = {}
  for name, spec, _ in MEMORY_LAYOUTS:
    mine = sorted((r["seq"], r["temp_bytes"]) for r in rows
                  if (r["strategy"], r["mesh"]) == (name, spec))
    if len(mine) < 3:
      continue
    seqs, temps = (np.asarray(v, float) for v in zip(*mine, strict=True))
    c2, c1, c0 = np.polyfit(seqs, temps, 2)
    roots = [r.real for r in np.roots([c2, c1, c0 - budget]) if abs(r.imag) < 1e-9 and r > 0]
    out[_label(name, spec)] = dict(seq=int(max(roots)) if roots else None,
                                   fit=[float(c2), float(c1), float(c0)])
  return out


def bytes_section(args, log) -> list[dict]:
  import flax_tp
  from bench.memory import abstract_step
  from flax_tp.context import ContextSplit
  from flax_tp.hlo import collectives
  from models.config import TransformerConfig
  layers = 2
  rows = []
  for name, spec, options in LAYOUTS:
    mesh = flax_tp.make_mesh(spec)
    axes = flax_tp.MeshAxes.of(mesh)
    if axes.context == 1:
      continue
    cfg = TransformerConfig.preset(args.preset, max_seq_len=args.bytes_seq, num_layers=layers)
    compiled, _ = abstract_step(cfg, mesh, 1, args.bytes_seq, execution=options)
    received = {}
    for c in collectives(compiled.as_text(), mesh):
      if c.axes != ("context",) or c.kind == "all-reduce":
        continue  # (an all-reduce is the gradients' sum, at data 1 over context alone)
      share = {"all-gather": (axes.context - 1) / axes.context,  # of the gathered result
               "reduce-scatter": axes.context - 1,  # the result is one device's part
               "collective-permute": 1}.get(c.kind)
      if share is None:
        raise SystemExit(f"bench.context: unexpected {c.kind} over context in {spec} {name}")
      received[c.kind] = received.get(c.kind, 0) + c.bytes * share / layers
    # A dense model runs the S inputs of the S + 1 tokens (the last is only a label).
    split = ContextSplit(args.bytes_seq, axes.context)
    kv_heads = flax_tp.KVHeadLayout(cfg.kv_heads * cfg.head_dim, axes.model, cfg.head_dim,
                                    num_heads=cfg.num_heads).padded_size // cfg.head_dim
    block = 2 * split.local_len * kv_heads * cfg.head_dim * 4  # k and v, float32, b = 1
    minimum = 2 * (axes.context - 1) * block
    total = sum(received.values())
    rows.append(dict(mesh=spec, strategy=name, seq=args.bytes_seq, per_layer=received,
                     per_layer_total=total, minimum=minimum, ratio=total / minimum,
                     block_bytes=block))
    log(f"bytes {args.preset} {spec} {name} seq {args.bytes_seq}: {total / 2**20:.1f} MiB "
        f"per layer per device over context, {total / minimum:.2f}x the minimum")
  return rows


def step_section(args, log) -> dict:
  import numpy as np

  import flax_tp
  from bench.harness import flax_tp_contender, interleaved_medians
  from models.config import TransformerConfig
  from models.execution import Execution
  from train.step import make_optimizer
  cfg = TransformerConfig.preset(args.step_preset, max_seq_len=args.step_seq)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.step_seq + 1),
                                             dtype=np.int32)
  contenders = {}
  for name, spec, options in LAYOUTS:
    _, contenders[_label(name, spec)], _ = flax_tp_contender(
        cfg, flax_tp.make_mesh(spec), tokens, make_optimizer(lr=1e-3, steps=10),
        Execution(**options))
  medians = interleaved_medians(contenders, args.repeats)
  base = medians[_label(*LAYOUTS[0][:2])]
  for label, seconds in medians.items():
    log(f"step {args.step_preset} seq {args.step_seq} {label}: {seconds * 1e3:.1f} ms "
        f"({seconds / base:.2f}x no context axis)")
  return dict(step_s=medians, ratio={k: v / base for k, v in medians.items()})


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax

  from bench import meshes_or_exit, out_path_or_exit
  meshes_or_exit([spec for _, spec, _ in LAYOUTS], "bench.context")
  out_path_or_exit(args.out, "bench.context")
  if not math.isfinite(args.budget_gib) or args.budget_gib <= 0:
    print(f"bench.context: error: --budget-gib must be a positive number, got "
          f"{args.budget_gib}", file=sys.stderr)
    return 2
  log = lambda line: print(line, file=sys.stderr, flush=True)
  results = {"jax": jax.__version__, "preset": args.preset}
  if "memory" in args.sections:
    results["memory"] = memory_section(args, log)
  if "bytes" in args.sections:
    results["bytes"] = bytes_section(args, log)
  if "step" in args.sections:
    results["step"] = step_section(args, log)
  print(json.dumps(results, indent=1))
  if args.out:
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
