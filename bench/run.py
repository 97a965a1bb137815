#!/usr/bin/env python
"""flax_tp benchmarks: communication, speed and memory, measured side by side.

    python bench/run.py                       # the full run recorded in BENCHMARKS.md
    python bench/run.py --preset tiny --repeats 1 --meshes 2x4   # a quick smoke run

Sections (each row of the table says which): the collective audit against
Megatron's minimum; flax_tp against Flax's own GSPMD sharding and pure data
parallelism; overhead at one device; memory; how the audit's bytes scale.
Times are medians of interleaved repeats after warm-up; ratios compare
contenders measured in the same run. Writes ``bench/results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
  sys.path.insert(0, str(ROOT))

from bench import mesh_list  # noqa: E402  (after the path above: run as a script too)
from bench.harness import (  # noqa: E402
    DEVICES,
    bench_config,
    flax_tp_contender,
    interleaved_medians,
    peer_contender,
    per_device_bytes,
)

SECTIONS = ("audit", "peers", "overhead", "memory", "scaling", "hostmem", "device")


def parse_args(argv=None) -> argparse.Namespace:
  from train.errors import OneLineParser, comma_choices, non_negative_float, positive_int

  p = OneLineParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="small", choices=["tiny", "small", "llama-125m"],
                 help="model width (8 heads, vocabulary 256 so that GSPMD can shard it)")
  p.add_argument("--layers", type=positive_int, default=None,
                 help="blocks (default: the preset's)")
  p.add_argument("--meshes", default="1x8,2x4,4x2,8x1", help="comma-separated meshes: DxM, DxCxM or named (data=2,model=4)")
  p.add_argument("--repeats", type=positive_int, default=7, help="timed steps per contender")
  p.add_argument("--batch-size", type=positive_int, default=32)
  p.add_argument("--seq-len", type=positive_int, default=128)
  p.add_argument("--grad-clip", type=non_negative_float, default=1.0,
                 help="every contender's global-norm clipping (0: none, as the gpt peer's "
                      "docs-style step has none)")
  p.add_argument("--skip", type=comma_choices(SECTIONS), default=[],
                 help=f"comma-separated sections to skip: {','.join(SECTIONS)}")
  p.add_argument("--out", default=str(ROOT / "bench" / "results.json"))
  return p.parse_args(argv)


# -- helpers ---------------------------------------------------------------------


# -- 1. the collective audit -------------------------------------------------------


def megatron_minimum(cfg, data: int, model: int, batch: int, seq: int,
                     local_param_bytes: int) -> dict[str, int]:
  """Megatron TP + DP: the fewest collectives (count, bytes per device) a step needs.

  Over "model", per block: 2 all-reduces of the activations [b, s, d] forward
  (attention and MLP outputs) and 2 backward (their inputs' gradients); the
  embedding's forward all-reduce and the tied LM head's input-gradient
  all-reduce, both [b, s, d]; the loss's 3 [b, s] float32 reductions in 2
  collectives (the max, then the sum of exps and the target logit packed in one;
  Megatron runs the two sums apart). With per-head q/k norms (Qwen3, Gemma 3), each device
  holds the norms' weights whole but norms only its own heads: their two
  ``[head_dim]`` float32 gradients per block are all-reduced over "model" too (as
  Megatron-core all-reduces its qk-layernorm gradients over the tensor-parallel
  group). Over "data": one all-reduce of the local gradient bytes (plus the
  4-byte loss).
  """
  b = batch // data
  act = b * seq * cfg.d_model * cfg.compute_dtype.itemsize
  count = nbytes = 0
  if model > 1:
    count += 4 * cfg.num_layers + 2 + 2
    nbytes += (4 * cfg.num_layers + 2) * act + 3 * b * seq * 4
    if getattr(cfg, "qk_norm", False):
      count += 2 * cfg.num_layers
      nbytes += 2 * cfg.num_layers * cfg.head_dim * 4
  if data > 1:
    count += 1
    nbytes += local_param_bytes + 4
  return {"count": count, "bytes": nbytes}


def audit_step(cfg, mesh, compiled, params, batch: int, seq: int) -> dict[str, Any]:
  """Measured collectives of a compiled step against ``megatron_minimum``.

  Counted: every array all-reduced over "model" (XLA may pack several into one
  op) and every op over "data". Scalars over "model" are listed as excess.
  """
  from flax_tp.hlo import collectives, tally
  rows = tally(collectives(compiled.as_text(), mesh))
  model = rows.get("all-reduce@model", {})
  data = rows.get("all-reduce@data", {})
  count = model.get("tensors", 0) + data.get("ops", 0)
  nbytes = model.get("bytes", 0) + data.get("bytes", 0) + data.get("scalar_bytes", 0)
  minimum = megatron_minimum(cfg, mesh.shape["data"], mesh.shape["model"], batch, seq,
                             per_device_bytes(params))
  excess = []
  if model.get("scalars"):
    excess.append({"what": "all-reduce of scalars over model", "tensors": model["scalars"],
                   "bytes": model["scalar_bytes"],
                   "why": "the gradients' global norm (the logged grad_norm metric, which "
                          "clipping takes too): the model-split params' partial sum of "
                          "squares (Megatron all-reduces the same)"})
  for key, row in rows.items():
    if key not in ("all-reduce@model", "all-reduce@data"):
      excess.append({"what": key, "tensors": row["tensors"] + row["scalars"],
                     "bytes": row["bytes"] + row["scalar_bytes"], "why": "unexpected"})
  return {
      "measured": {"count": count, "bytes": nbytes}, "minimum": minimum,
      "count_ratio": count / minimum["count"] if minimum["count"] else None,
      "bytes_ratio": nbytes / minimum["bytes"] if minimum["bytes"] else None,
      "excess": excess, "collectives": rows,
  }


# -- the run -----------------------------------------------------------------------


def main(argv=None) -> int:
  args = parse_args(argv)
  skip = set(args.skip)
  meshes = mesh_list(args.meshes)
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
  import jax
  import numpy as np

  from bench import meshes_or_exit, out_path_or_exit, peers
  from train.step import make_optimizer

  meshes_or_exit(meshes, "bench/run.py", context=False)
  out_path_or_exit(args.out, "bench/run.py")
  platform_name = jax.devices()[0].platform
  cfg = bench_config(args.preset, args.layers, args.seq_len)
  tx = make_optimizer(lr=1e-3, steps=1000, warmup_steps=10, grad_clip=args.grad_clip)
  tokens_host = np.asarray(peers.tokens_for(cfg, args.batch_size, args.seq_len))
  results: dict[str, Any] = {
      "command": "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
      "machine": {"cores": os.cpu_count(), "platform": platform_name,
                  "devices": jax.device_count(), "jax": jax.__version__,
                  "python": platform.python_version(), "processor": platform.machine()},
      "config": {**cfg.flat(), "batch_size": args.batch_size, "seq_len": args.seq_len},
  }
  rows: list[tuple[str, str, str]] = []  # (section, what, figure) for the table

  def log(section: str, what: str, figure: str) -> None:
    rows.append((section, what, figure))
    print(f"{section:<9} {what:<58} {figure}", flush=True)

  if not {"audit", "peers"} <= skip:  # 1 + 2 + 4: per mesh, flax_tp beside its peers
    results["meshes"] = {spec: audit_and_peers_section(cfg, spec, tokens_host, tx, args, skip,
                                                       log) for spec in meshes}
  if "overhead" not in skip:  # 3. overhead at one device
    results["overhead"] = overhead_section(cfg, tokens_host, tx, args.repeats, log)
  if "memory" not in skip:  # 4. memory: what each device holds against dense / M
    results["memory"] = memory_section(cfg, meshes, tx, log)
  if "hostmem" not in skip:
    results["host_memory"] = host_memory_section(log)
  if "scaling" not in skip and jax.device_count() >= 8:  # 5. how the audit's bytes scale
    results["scaling"] = scaling_report(args.preset, tx, log)
  if "device" not in skip and platform_name == "gpu":
    from bench.mfu import device_report
    results["device"] = device_report(args.preset, args.repeats, log)

  Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
  print(f"wrote {args.out}")
  from bench.plots import PlotsUnavailable, draw
  try:  # beside the results: step time and bytes per mesh against the peers
    for path in draw(results, Path(args.out).parent):
      print(f"wrote {path}")
  except PlotsUnavailable as err:
    print(f"no plots: {err}")
  return 0


def audit_and_peers_section(cfg, spec: str, tokens_host, tx, args, skip: set[str],
                            log) -> dict[str, Any]:
  """Sections 1 and 2 on one mesh: flax_tp's collectives against Megatron's minimum, and
  its step beside GSPMD's (with a model axis) or data parallelism's (without)."""
  import flax_tp
  from bench import peers
  from flax_tp.hlo import collectives

  mesh = flax_tp.make_mesh(spec)
  _, mine, mine_compile = flax_tp_contender(cfg, mesh, tokens_host, tx)
  entry: dict[str, Any] = {"flax_tp": {"compile_s": mine_compile}}
  audit = audit_step(cfg, mesh, mine.compiled, mine.state[0], args.batch_size, args.seq_len)
  entry["audit"] = audit
  if "audit" not in skip:
    log("audit", f"{spec}: collectives measured/minimum (count)",
        f"{audit['measured']['count']}/{audit['minimum']['count']} = "
        f"{audit['count_ratio'] or float('nan'):.2f}")
    log("audit", f"{spec}: bytes per device measured/minimum",
        f"{audit['measured']['bytes']:,}/{audit['minimum']['bytes']:,} = "
        f"{audit['bytes_ratio'] or float('nan'):.3f}")
    for ex in audit["excess"]:
      log("audit", f"{spec}: excess: {ex['what']}",
          f"{ex['tensors']} tensors, {ex['bytes']} B ({ex['why'].split(':')[0]})")
  if "peers" in skip:
    return entry
  contenders = {"flax_tp": mine}
  # With a model axis: GSPMD on the reference (separate q/k/v) and on a GPT with one
  # fused q/k/v projection; without: data parallelism.
  # The independent docs-style GPT (multi-head GELU models only) on every mesh.
  others = ((peers.gspmd, peers.gspmd_fused) if mesh.shape["model"] > 1
            else (peers.data_parallel,))
  if cfg.kv_heads == cfg.num_heads and cfg.mlp == "gelu":
    others += (peers.gpt,)
  for make in others:
    peer = make(cfg, tx, mesh)
    contenders[peer.name], seconds = peer_contender(peer, tokens_host)
    entry[peer.name] = {"compile_s": seconds}
  medians = interleaved_medians(contenders, args.repeats)
  for name, c in contenders.items():
    stats = c.compiled.memory_analysis()
    entry.setdefault(name, {}).update(
        step_s=medians[name],
        collective_bytes=sum(x.bytes for x in collectives(c.compiled.as_text(), mesh)),
        param_bytes_per_device=per_device_bytes(c.state[0]),
        opt_state_bytes_per_device=per_device_bytes(c.state[1]),
        temp_bytes=stats.temp_size_in_bytes)
  for other in list(contenders)[1:]:
    a, b = entry["flax_tp"], entry[other]
    for key, label in (("step_s", "step time"), ("compile_s", "compile time"),
                       ("collective_bytes", "collective bytes"),
                       ("param_bytes_per_device", "param bytes/device"),
                       ("opt_state_bytes_per_device", "optimizer bytes/device"),
                       ("temp_bytes", "compiled temp bytes")):
      ratio = a[key] / b[key] if b[key] else float("nan")
      fmt = ((lambda v: f"{v * 1e3:.1f} ms") if key.endswith("_s")
             else (lambda v: f"{v:,}"))
      log("peers", f"{spec}: {label} flax_tp / {other}",
          f"{fmt(a[key])} / {fmt(b[key])} = {ratio:.2f}")
      # "ratios": against the first peer (as before); "ratios_<peer>" against each.
      entry.setdefault(f"ratios_{other}", {})[key] = ratio
      if other == list(contenders)[1]:
        entry.setdefault("ratios", {})[key] = ratio
  return entry


def overhead_section(cfg, tokens_host, tx, repeats: int, log) -> dict[str, Any]:
  """Section 3: flax_tp at one device against plain Flax, the step and one layer."""
  import flax_tp
  from bench import peers

  mesh = flax_tp.make_mesh("1x1")
  _, mine, _ = flax_tp_contender(cfg, mesh, tokens_host, tx)
  ref, _ = peer_contender(peers.single(cfg, tx), tokens_host)
  medians = interleaved_medians({"flax_tp": mine, "reference": ref}, repeats)
  ratio = medians["flax_tp"] / medians["reference"]
  log("overhead", "1x1 train step flax_tp / plain Flax (goal <= 1.05)",
      f"{medians['flax_tp'] * 1e3:.1f} / {medians['reference'] * 1e3:.1f} ms = {ratio:.3f}")
  layer_medians = dense_overhead(mesh, repeats)
  layer_ratio = layer_medians["column"] / layer_medians["linear"]
  log("overhead", "1x1 ColumnParallelDense / nnx.Linear forward (512->2048, 1024 rows)",
      f"{layer_medians['column'] * 1e3:.2f} / {layer_medians['linear'] * 1e3:.2f} ms = "
      f"{layer_ratio:.3f}")
  return {"step": {**medians, "ratio": ratio},
          "column_dense": {**layer_medians, "ratio": layer_ratio}}


def memory_section(cfg, meshes: list[str], tx, log) -> dict[str, Any]:
  """Section 4: params + optimizer state per device against dense / M, per mesh."""
  import flax_tp

  out = {}
  for spec in meshes:
    mem = out[spec] = memory_report(cfg, flax_tp.make_mesh(spec), tx)
    log("memory", f"{spec}: params+opt bytes/device vs dense/M (+replicated)",
        f"{mem['per_device_bytes']:,} vs {mem['dense_over_m_bytes']:,} + "
        f"{mem['replicated_bytes']:,} = {mem['ratio']:.3f}")
  return out


def host_memory_section(log) -> dict[str, Any]:
  """Section 4 (host): the transient host memory of building each model, in a process
  of its own (``bench.hostmem``)."""
  out = {}
  for flag in ([], ["--reference"]):
    done = subprocess.run([sys.executable, "-m", "bench.hostmem", *flag], cwd=ROOT,
                          capture_output=True, text=True, check=True, env={
                              **os.environ,
                              "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"})
    rec = json.loads(done.stdout.strip().splitlines()[-1])
    out[rec["model"]] = rec
    log("memory", f"build {rec['model']} ({rec['model_bytes'] / 2**20:.0f} MiB, largest "
        f"param {rec['largest_param_bytes'] / 2**20:.0f} MiB): transient peak",
        f"{rec['transient_bytes'] / 2**20:.1f} MiB = "
        f"{rec['transient_bytes'] / rec['largest_param_bytes']:.2f} x largest param")
  return out


def dense_overhead(mesh, repeats: int) -> dict[str, float]:
  import jax
  from flax import nnx

  import flax_tp
  x = jax.random.normal(jax.random.key(0), (1024, 512))
  column = flax_tp.ColumnParallelDense(512, 2048, mesh=mesh, rngs=nnx.Rngs(0))
  linear = nnx.Linear(512, 2048, rngs=nnx.Rngs(0))
  fns = {}
  for name, layer in (("column", column), ("linear", linear)):
    graphdef, state = nnx.split(layer)
    f = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x))
    xs = jax.device_put(x, state["kernel"][...].sharding)
    fns[name] = lambda f=f, s=state, xs=xs: jax.block_until_ready(f(s, xs))
  return interleaved_medians(fns, max(repeats, 5) * 4)


def memory_report(cfg, mesh, tx) -> dict[str, Any]:
  import jax
  from flax import nnx

  from flax_tp.param_info import ParamInfo
  from models.transformer import Transformer
  from train.step import Trainer
  trainer = Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)), tx)
  opt_state = trainer.init_opt_state(trainer.params)
  per_device = per_device_bytes(trainer.params) + per_device_bytes(opt_state)
  sharded_dense = replicated = 0
  replicated_names = []
  for path, var in nnx.to_flat_state(trainer.params):
    layout = ParamInfo.of(var).layout
    nbytes = var[...].nbytes
    if layout is None:
      replicated += nbytes
      replicated_names.append(".".join(map(str, path)))
    else:
      sharded_dense += nbytes // layout.padded_total * layout.size
  # Adam keeps two moments per param: params + opt state = 3x the param bytes.
  model_axis = mesh.shape["model"]
  dense_over_m = 3 * sharded_dense // model_axis
  # Plus the optimizer's step counters (scalars, replicated).
  counters = sum(x.nbytes for x in jax.tree.leaves(opt_state) if x.ndim == 0)
  replicated_total = 3 * replicated + counters
  return {"per_device_bytes": per_device, "dense_over_m_bytes": dense_over_m,
          "replicated_bytes": replicated_total,
          "ratio": per_device / (dense_over_m + replicated_total),
          "replicated_params": sorted({n.split(".")[-2] + "." + n.split(".")[-1]
                                       for n in replicated_names})}


def scaling_report(preset: str, tx, log) -> list[dict[str, Any]]:
  """Audit bytes at 2x4 as batch, sequence and width grow (compile only)."""
  import numpy as np

  import flax_tp
  from bench import peers
  base = bench_config(preset)
  mesh = flax_tp.make_mesh("2x4")
  points = []
  for label, (batch, seq, width) in [("base", (16, 64, 128)), ("batch x2", (32, 64, 128)),
                                     ("batch x4", (64, 64, 128)), ("seq x2", (16, 128, 128)),
                                     ("seq x4", (16, 256, 128)), ("width x2", (16, 64, 256)),
                                     ("width x4", (16, 64, 512))]:
    cfg = dataclasses.replace(base, d_model=width, head_dim=width // 8, d_ff=4 * width,
                              num_layers=2)
    tokens = np.asarray(peers.tokens_for(cfg, batch, seq))
    _, mine, _ = flax_tp_contender(cfg, mesh, tokens, tx)
    audit = audit_step(cfg, mesh, mine.compiled, mine.state[0], batch, seq)
    model_bytes = audit["collectives"].get("all-reduce@model", {}).get("bytes", 0)
    per_bsd = model_bytes / (batch // 2 * seq * width)
    points.append({"label": label, "batch": batch, "seq": seq, "d_model": width,
                   "model_axis_bytes": model_bytes, "bytes_per_bsd": per_bsd,
                   "bytes_ratio": audit["bytes_ratio"]})
    log("scaling", f"2x4 {label} (b={batch}, s={seq}, d={width}): model-axis bytes",
        f"{model_bytes:,} = {per_bsd:.2f} B per local b*s*d; measured/min "
        f"{audit['bytes_ratio']:.3f}")
  return points


if __name__ == "__main__":
  sys.exit(main())
