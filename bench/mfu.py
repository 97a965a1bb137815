"""Model FLOP utilisation of the Llama presets on one accelerator (BENCHMARKS.md §6).

    python -m bench.mfu                     # on the GPU: ~125M and ~350M, bfloat16
    python -m bench.mfu --presets llama-tiny --points 2x16 --repeats 1 --peak-tflops 1  # smoke

For each preset and each ``BATCHxSEQ`` point, flax_tp's train step on a 1x1 mesh
and plain Flax's (``models/reference.py``, same params), timed interleaved,
medians after warm-up; with ``--remat``, flax_tp's step again under each
recomputation setting (plain Flax has none), so that larger points fit. A point
that does not fit in memory is recorded as such, and the run goes on; each point
is written to ``--out`` as soon as it is measured.

Model FLOPs per step: tokens x (6 x N + 12 x layers x seq x heads x head_dim),
N the params but an untied input embedding (a lookup, not a matmul), the
attention term without halving for causality (PaLM's formula). MFU = model FLOPs
/ step time / the device's peak dense FLOP/s for the compute dtype, from
``--peak-tflops`` or the datasheet table below.
Prints one JSON object (and writes it to ``--out``), with the device's kind and
the jax / jaxlib / flax versions beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
  sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402  (after the path above: run as a script too)
    at_point,
    flax_tp_contender,
    interleaved_medians,
    model_flops,
    out_of_memory,
    param_count,
    peak_tflops,
    peer_contender,
)


def parse_args(argv=None) -> argparse.Namespace:
  from train.errors import OneLineParser, positive_int

  p = OneLineParser(prog="bench.mfu", description=__doc__.splitlines()[0])
  p.add_argument("--presets", default="llama-125m,llama-350m")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="compute dtype (params stay float32)")
  p.add_argument("--points", default="16x1024,32x1024,64x1024",
                 help="comma-separated BATCHxSEQ points")
  p.add_argument("--remat", default="",
                 help="comma-separated recomputation settings to time flax_tp under too "
                      "(block, dots_saveable, ...)")
  p.add_argument("--loss-chunks", default="",
                 help="comma-separated Execution.loss_chunks counts (> 1) to time flax_tp "
                      "under too, beside 1 (with each --remat)")
  p.add_argument("--attention", default="auto",
                 help="comma-separated Execution.attention kernels to time flax_tp with "
                      "(auto, xla, splash)")
  p.add_argument("--peers", default=None,
                 help="comma-separated attention kernels of the independent plain-JAX peer "
                      "(bench/peer_llama.py) to time beside: splash, xla (default: both on "
                      "a TPU, xla elsewhere); 'none' for none")
  p.add_argument("--plain-flax", action=argparse.BooleanOptionalAction, default=True,
                 help="time plain Flax (models/reference.py) too")
  p.add_argument("--repeats", type=positive_int, default=10)
  p.add_argument("--peak-tflops", type=float, default=None,
                 help="the device's peak dense TFLOP/s for --dtype (default: datasheet)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  given = args.points
  try:
    args.points = [tuple(int(n) for n in point.split("x")) for point in given.split(",")]
    if any(len(point) != 2 or min(point) < 1 for point in args.points):
      raise ValueError
  except ValueError:
    p.error(f"--points must be BATCHxSEQ pairs of positive integers, got {given!r}")
  if args.peak_tflops is not None and not args.peak_tflops > 0:
    p.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
  from flax_tp.remat import REMAT_CHOICES
  from models.config import TransformerConfig
  args.presets = [name.strip() for name in args.presets.split(",") if name.strip()]
  for name in args.presets:
    if name not in TransformerConfig.preset_names():
      p.error(f"unknown preset {name!r}; expected some of {TransformerConfig.preset_names()}")
  args.attention = [name for name in args.attention.split(",") if name]
  from models.splash import KERNELS
  for name in args.attention:
    if name not in KERNELS:
      p.error(f"unknown --attention {name!r}; expected some of {KERNELS}")
  if args.peers is not None:
    args.peers = [] if args.peers == "none" else [n for n in args.peers.split(",") if n]
    for name in args.peers:
      if name not in ("splash", "xla"):
        p.error(f"unknown --peers {name!r}; expected some of ('splash', 'xla') or 'none'")
  given = args.loss_chunks
  try:
    args.loss_chunks = [int(n) for n in given.split(",") if n]
    if any(n < 2 for n in args.loss_chunks):
      raise ValueError
  except ValueError:
    p.error(f"--loss-chunks must be integers > 1, got {given!r}")
  args.remat = [name for name in args.remat.split(",") if name]
  for name in args.remat:
    if name not in REMAT_CHOICES:
      p.error(f"unknown --remat {name!r}; expected some of {REMAT_CHOICES}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  from bench import out_path_or_exit
  out_path_or_exit(args.out, "bench.mfu")
  import flax
  import jax
  import jaxlib

  import flax_tp
  from models.config import TransformerConfig
  from train.step import make_optimizer

  device = jax.devices()[0]
  peak = args.peak_tflops or peak_tflops(device.device_kind, args.dtype)
  if peak is None:
    print(f"bench.mfu: error: no datasheet peak for {device.device_kind!r} in "
          f"{args.dtype}; pass --peak-tflops", file=sys.stderr)
    return 2
  log = lambda line: print(line, file=sys.stderr, flush=True)
  results = {"device": device.device_kind, "platform": device.platform,
             "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                          "flax": flax.__version__, "python": sys.version.split()[0]},
             "dtype": args.dtype, "peak_tflops": peak, "repeats": args.repeats, "points": []}
  tx = make_optimizer(lr=1e-4, steps=1000, warmup_steps=10)
  mesh = flax_tp.make_mesh("1x1")
  todo = [(preset, batch, seq) for preset in args.presets for batch, seq in args.points]

  def save() -> None:
    """The points measured so far, written whole (a lent GPU's time limit or Ctrl-C
    must not lose them)."""
    if args.out:
      tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
      tmp.write_text(json.dumps(results, indent=1) + "\n")
      os.replace(tmp, args.out)

  try:
    for preset, batch, seq in todo:
      peers = args.peers
      if peers is None:
        peers = ["splash", "xla"] if device.platform == "tpu" else ["xla"]
      row = measure_point(TransformerConfig.preset(preset, dtype=args.dtype), batch, seq,
                          args.remat, mesh, tx, args.repeats, peak,
                          attention=args.attention, peers=peers, plain_flax=args.plain_flax,
                          loss_chunks=args.loss_chunks)
      results["points"].append({"preset": preset, **row})
      log(json.dumps(results["points"][-1]))
      save()
  except KeyboardInterrupt:
    save()
    where = f"; they are in {args.out}" if args.out else ""
    print(f"bench.mfu: interrupted after {len(results['points'])} of {len(todo)} points{where}",
          file=sys.stderr)
    return 130
  print(json.dumps(results, indent=1))
  return 0


def flax_tp_name(attention: str, remat: str, loss_chunks: int = 1) -> str:
  """A flax_tp contender's name: "flax_tp", "flax_tp attention=xla remat=block", ..."""
  return " ".join(["flax_tp", *([f"attention={attention}"] if attention != "auto" else []),
                   *([f"remat={remat}"] if remat != "none" else []),
                   *([f"loss_chunks={loss_chunks}"] if loss_chunks != 1 else [])])


def measure_point(cfg, batch: int, seq: int, remats: list[str], mesh, tx, repeats: int,
                  peak: float, *, attention=("auto",), peers=(), plain_flax=True,
                  loss_chunks=()) -> dict:
  """One preset at one ``batch x seq``: each contender's median step and MFU, or
  "out of memory". flax_tp under each of ``attention`` (without recomputation, and with
  each of ``remats``; the head whole, and by each of ``loss_chunks``), the independent
  peer (``bench/peer_llama.py``) with each of ``peers``' attention, and plain Flax."""
  from bench import peer_llama, peers as flax_peers
  from models.execution import Execution
  cfg, tokens = at_point(cfg, batch, seq)
  row = {"batch": batch, "seq": seq}
  builders = {flax_tp_name(kernel, remat, chunks):
              (lambda kernel=kernel, remat=remat, chunks=chunks: flax_tp_contender(
                  cfg, mesh, tokens, tx, Execution(remat=remat, attention=kernel,
                                                   loss_chunks=chunks))[1])
              for kernel in attention for remat in ["none", *remats]
              for chunks in [1, *loss_chunks]}
  for kind in peers:
    builders[f"peer {kind}"] = lambda kind=kind: peer_contender(
        peer_llama.PeerLlama(cfg, tx, kind, seq=seq), tokens)[0]
  if plain_flax:
    builders["plain Flax"] = lambda: peer_contender(flax_peers.single(cfg, tx), tokens)[0]
  medians = time_together(builders, repeats)
  row["timing"] = "interleaved"
  if medians is None:
    # They do not all fit in memory together (each holds its params and optimizer state,
    # and a TPU reserves a program's scratch memory at each call): each is built afresh
    # with the others freed and timed alone; one that does not fit even alone is
    # recorded as such.
    row["timing"] = "one at a time (the contenders do not fit in memory together)"
    medians = {}
    for name, build in builders.items():
      alone = time_together({name: build}, repeats)
      if alone is None:
        row[name] = "out of memory"
      else:
        medians.update(alone)
  if medians:
    params = param_count(cfg)
    flops = model_flops(cfg, params, batch, seq)
    row.update(params=params, model_flops=flops)
    for name, seconds in medians.items():
      row[name] = {"step_s": seconds, "mfu": flops / seconds / (peak * 1e12)}
    if "flax_tp" in medians and "plain Flax" in medians:
      row["flax_tp / plain Flax"] = medians["flax_tp"] / medians["plain Flax"]
    peer_times = [t for name, t in medians.items() if name.startswith("peer ")]
    if "flax_tp" in medians and peer_times:
      row["flax_tp / best peer"] = medians["flax_tp"] / min(peer_times)
  return row


def time_together(builders: dict, repeats: int) -> dict[str, float] | None:
  """Each builder's contender built, run once and timed interleaved with the others:
  their median seconds per step, or None if they ran out of memory (the failed
  contenders are freed before this returns, not kept alive by a traceback)."""
  contenders = {}
  try:
    for name, build in builders.items():
      contenders[name] = build()
      contenders[name]()  # compiles and runs once
    return interleaved_medians(contenders, repeats)
  except Exception as err:  # only running out of memory is expected
    if not out_of_memory(err):
      raise
  finally:
    contenders.clear()
  return None


def device_report(preset: str, repeats: int, log) -> dict[str, Any]:
  """One accelerator: step time and model FLOP utilisation of the default model."""
  import jax
  import numpy as np

  import flax_tp
  from bench import peers
  from models.config import TransformerConfig
  from train.step import make_optimizer
  kind = jax.devices()[0].device_kind
  out = {"device": kind}
  # The datasheet's dense peaks of this device kind (TF32 for float32); MFU is left out
  # for a device the table does not hold.
  peak = {dtype: None if peak_tflops(kind, dtype) is None else peak_tflops(kind, dtype) * 1e12
          for dtype in ("float32", "bfloat16")}
  tx = make_optimizer(lr=1e-3, steps=1000, warmup_steps=10)
  mesh = flax_tp.make_mesh("1x1")
  for dtype in ("float32", "bfloat16"):
    for batch, seq in ((32, 128), (256, 512)):
      cfg = TransformerConfig.preset(preset, dtype=dtype, max_seq_len=seq)
      tokens = np.asarray(peers.tokens_for(cfg, batch, seq))
      _, mine, _ = flax_tp_contender(cfg, mesh, tokens, tx)
      ref, _ = peer_contender(peers.single(cfg, tx), tokens)
      medians = interleaved_medians({"flax_tp": mine, "reference": ref}, max(repeats, 10))
      flops = model_flops(cfg, param_count(cfg), batch, seq)
      mfu = None if peak[dtype] is None else flops / medians["flax_tp"] / peak[dtype]
      key = f"{dtype} b={batch} s={seq}"
      out[key] = {**medians, "model_flops": flops, "mfu": mfu, "peak_flops": peak[dtype]}
      log("device", f"{key}: step flax_tp / plain Flax; MFU",
          f"{medians['flax_tp'] * 1e3:.2f} / {medians['reference'] * 1e3:.2f} ms; "
          + (f"MFU {mfu * 100:.2f}%" if mfu is not None else f"no datasheet peak for {kind!r}"))
  return out


if __name__ == "__main__":
  sys.exit(main())
