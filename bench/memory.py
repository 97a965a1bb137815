"""Activation memory, compile time and step time of sequence parallelism, recomputation
and scanned layers.

    python -m bench.memory                      # all three sections (several minutes)
    python -m bench.memory --sections step --preset tiny --repeats 1    # a smoke run

Sections:
- memory: the ``llama-350m`` preset's train step on ``2x4`` compiled from abstract
  inputs (nothing is allocated or run); XLA's memory analysis gives each device's
  temporary bytes (activations saved for backward and every other intermediate)
  for plain / SP / SP + remat / SP + remat + scan, at each ``--seqs`` length;
- compile: seconds to compile the step at depths 2, 8 and 24 (``--compile-preset``
  width) with and without ``--scan-layers``;
- step: median step time of each option on this CPU, as a ratio to the plain run
  (``--step-preset``, interleaved repeats);
- probe: ``jax.checkpoint`` on a plain chain of dense layers, without flax_tp,
  unrolled and scanned (what XLA's backend does with recomputation by itself).
Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OPTIONS = {
    "plain": {},
    "sp": dict(sequence_parallel=True),
    "sp+remat": dict(sequence_parallel=True, remat="block"),
    "sp+remat+scan": dict(sequence_parallel=True, remat="block", scan_layers=True),
}
# Further combinations the memory section measures when ``--options`` names them.
MORE_OPTIONS = {
    "remat": dict(remat="block"),
    "scan": dict(scan_layers=True),
    "sp+scan": dict(sequence_parallel=True, scan_layers=True),
    "remat+scan": dict(remat="block", scan_layers=True),
}
SECTIONS = ("memory", "compile", "step", "probe", "fsdp")


def parse_args(argv=None) -> argparse.Namespace:
  from models.config import TransformerConfig
  from train.errors import OneLineParser, comma_choices, comma_positive_ints, positive_int

  presets = TransformerConfig.preset_names()
  p = OneLineParser(prog="bench.memory", description=__doc__.split("\n\n")[0])
  p.add_argument("--sections", type=comma_choices(SECTIONS), default=list(SECTIONS),
                 help=f"comma-separated, from {','.join(SECTIONS)}")
  p.add_argument("--preset", default="llama-350m", choices=presets,
                 help="model of the memory section")
  p.add_argument("--mesh", default="2x4")
  p.add_argument("--seqs", type=comma_positive_ints, default=[1024, 2048],
                 help="sequence lengths of the memory section")
  p.add_argument("--options", type=comma_choices(tuple({**OPTIONS, **MORE_OPTIONS})),
                 default=list(OPTIONS), help="the option sets of the memory section: "
                 f"{', '.join({**OPTIONS, **MORE_OPTIONS})}")
  p.add_argument("--batch", type=positive_int, default=8, help="global batch (memory and step)")
  p.add_argument("--compile-preset", default="llama-125m", choices=presets)
  p.add_argument("--depths", type=comma_positive_ints, default=[2, 8, 24])
  p.add_argument("--step-preset", default="small", choices=presets)
  p.add_argument("--step-seq", type=positive_int, default=128)
  p.add_argument("--repeats", type=positive_int, default=5)
  p.add_argument("--fsdp-meshes", type=comma_choices(("2x4", "4x2", "8x1", "1x8")),
                 default=["2x4", "4x2"], help="meshes of the fsdp section")
  p.add_argument("--fsdp-seq", type=positive_int, default=1024)
  p.add_argument("--fsdp-options", type=comma_choices(tuple({**OPTIONS, **MORE_OPTIONS})),
                 default=["plain"], help="option sets of the fsdp section")
  p.add_argument("--out", default=None)
  return p.parse_args(argv)


def _path_key(path) -> tuple:
  return tuple(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def abstract_step(cfg, mesh, batch: int, seq: int, keep: dict | None = None,
                  execution: dict | None = None):
  """The compiled train step of ``cfg`` run as ``execution`` (``models.execution.Execution``
  fields) from abstract params and batch (no arrays); ``keep`` (a dict) receives the
  abstract ``params`` and ``opt_state``."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding

  from models.execution import Execution
  from models.transformer import Transformer
  from train.step import Trainer, make_optimizer
  model = nnx.eval_shape(lambda: Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0),
                                             execution=Execution(**(execution or {}))))
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=10))
  specs = nnx.get_partition_spec(trainer.params)
  params = jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), trainer.params, specs)
  # The optimizer state sharded as Trainer.init_opt_state leaves it: each moment like
  # its param (matched by path: mu and nu mirror the params' tree), counters replicated.
  # (XLA's propagation through an abstract init gives every moment replicated.)
  replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
  by_path = {_path_key(path): x.sharding
             for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}

  def like_its_param(path, x):
    key = _path_key(path)
    sharding = next((by_path[key[i:]] for i in range(len(key)) if key[i:] in by_path),
                    replicated)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  # (over what the optimizer trains: a selection bias or a LoRA base has no moments)
  opt_state = jax.tree_util.tree_map_with_path(
      like_its_param, jax.eval_shape(lambda p: trainer.tx.init(trainer.trained(p)), params))
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=trainer.batch_sharding)
  if keep is not None:
    keep.update(params=params, opt_state=opt_state)
  start = time.perf_counter()
  compiled = trainer.train_step.lower(params, opt_state, tokens, None).compile()
  return compiled, time.perf_counter() - start


def memory_section(args, log) -> list[dict]:
  import flax_tp
  from models.config import TransformerConfig
  mesh = flax_tp.make_mesh(args.mesh)
  rows = []
  for seq in args.seqs:
    for name in args.options:
      cfg = TransformerConfig.preset(args.preset, max_seq_len=seq)
      compiled, seconds = abstract_step(cfg, mesh, args.batch, seq,
                                        execution={**OPTIONS, **MORE_OPTIONS}[name])
      stats = compiled.memory_analysis()
      row = dict(seq=seq, options=name, temp_bytes=stats.temp_size_in_bytes,
                 argument_bytes=stats.argument_size_in_bytes, compile_s=seconds)
      rows.append(row)
      log(f"memory {args.preset} {args.mesh} seq {seq} {name}: temp "
          f"{row['temp_bytes'] / 2**30:.2f} GiB per device")
  return rows


def compile_section(args, log) -> list[dict]:
  import flax_tp
  from models.config import TransformerConfig
  mesh = flax_tp.make_mesh(args.mesh)
  rows = []
  for depth in args.depths:
    for scan in (False, True):
      cfg = TransformerConfig.preset(args.compile_preset, num_layers=depth, max_seq_len=128)
      _, seconds = abstract_step(cfg, mesh, args.batch, 128, execution=dict(scan_layers=scan))
      rows.append(dict(layers=depth, scan_layers=scan, compile_s=seconds))
      log(f"compile {args.compile_preset} x{depth} scan={scan}: {seconds:.1f} s")
  return rows


def step_section(args, log) -> dict:
  import numpy as np

  import flax_tp
  from bench.harness import flax_tp_contender, interleaved_medians
  from models.config import TransformerConfig
  from models.execution import Execution
  from train.step import make_optimizer
  mesh = flax_tp.make_mesh(args.mesh)
  tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.step_seq + 1),
                                             dtype=np.int32)
  contenders = {}
  for name, options in {**OPTIONS, "remat": MORE_OPTIONS["remat"],
                        "scan": MORE_OPTIONS["scan"]}.items():
    cfg = TransformerConfig.preset(args.step_preset, max_seq_len=args.step_seq)
    _, contenders[name], _ = flax_tp_contender(cfg, mesh, tokens,
                                               make_optimizer(lr=1e-3, steps=10),
                                               Execution(**options))
  medians = interleaved_medians(contenders, args.repeats)
  ratios = {name: medians[name] / medians["plain"] for name in medians}
  for name, ratio in ratios.items():
    log(f"step {args.step_preset} {args.mesh} {name}: {medians[name] * 1e3:.1f} ms "
        f"({ratio:.2f}x plain)")
  return dict(step_s=medians, ratio=ratios)


def fsdp_section(args, log) -> list[dict]:
  """Per device, with and without FSDP, for ``--preset`` at each of ``--fsdp-meshes`` and
  ``--fsdp-options``: params + AdamW state (each array's shard, from its sharding)
  against the ideal ``3 P / (D M)``, and what the step's collectives over "data"
  produce against FSDP's analytic minimum (in the row)."""
  import jax
  from flax import nnx

  import flax_tp
  from flax_tp.hlo import collectives
  from models.config import TransformerConfig
  from models.reference import ReferenceTransformer
  cfg0 = TransformerConfig.preset(args.preset, max_seq_len=args.fsdp_seq)
  logical = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
      lambda: ReferenceTransformer(cfg0, rngs=nnx.Rngs(0))), nnx.Param)))
  rows = []
  for spec, option, fsdp in ((s, o, f) for s in args.fsdp_meshes for o in args.fsdp_options
                             for f in (False, True)):
    mesh = flax_tp.make_mesh(spec)
    d, m = mesh.shape["data"], mesh.shape["model"]
    cfg = TransformerConfig.preset(args.preset, max_seq_len=args.fsdp_seq)
    args_of = {}
    compiled, seconds = abstract_step(cfg, mesh, args.batch, args.fsdp_seq, args_of,
                                      execution=dict(fsdp=fsdp,
                                                     **{**OPTIONS, **MORE_OPTIONS}[option]))
    found = [c for c in collectives(compiled.as_text(), mesh) if c.axes == ("data",)]
    produced = {kind: sum(c.bytes for c in found if c.kind == kind)
                for kind in ("all-gather", "reduce-scatter", "all-reduce")}
    # Per device: each array's shard, from its sharding (params, AdamW's mu and nu).
    state = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                for x in jax.tree.leaves(args_of))
    row = dict(mesh=spec, options=option, fsdp=fsdp, state_bytes=state,
               ideal_state_bytes=3 * logical / (d * m),
               data_collective_result_bytes=produced, compile_s=seconds)
    # FSDP's minimum: each param's model shard gathered forward and again backward
    # (2 P / M), each gradient reduce-scattered (P / (D M)); data parallelism: one
    # all-reduce of every gradient (P / M).
    row["minimum_result_bytes"] = (dict(all_gather=2 * logical / m,
                                        reduce_scatter=logical / (d * m)) if fsdp
                                   else dict(all_reduce=logical / m))
    rows.append(row)
    log(f"fsdp {args.preset} {spec} {option} fsdp={fsdp}: state {row['state_bytes'] / 2**30:.3f} "
        f"GiB/device (ideal {row['ideal_state_bytes'] / 2**30:.3f}); over data "
        + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in produced.items() if v))
  return rows


def probe_section(log) -> list[dict]:
  """jax.checkpoint on a plain chain of 24 dense layers ([2048, 1024] float32), no
  flax_tp at all: does XLA's analysis show recomputation saving memory, unrolled and
  scanned?"""
  import jax
  import jax.numpy as jnp

  from flax_tp.remat import recompute_in_backward
  layers, rows, width = 24, 2048, 1024

  def layer(w, x):
    return jnp.tanh(jnp.tanh(x @ w) @ w.T) + x

  def loss(ws, x, remat, scan):
    f = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable) if remat \
        else layer
    if remat == "flax_tp":  # flax_tp.remat's recomputing VJP
      f = lambda w, x: recompute_in_backward(layer, w, x)
    if scan:
      x, _ = jax.lax.scan(lambda x, w: (f(w, x), None), x, ws)
    else:
      for i in range(layers):
        x = f(ws[i], x)
    return jnp.sum(x ** 2)

  ws = jax.ShapeDtypeStruct((layers, width, width), jnp.float32)
  x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
  out = []
  for remat, scan in ((False, False), (True, False), ("flax_tp", False), (False, True),
                      (True, True)):
    compiled = jax.jit(jax.grad(lambda w, x, r=remat, s=scan: loss(w, x, r, s))).lower(
        ws, x).compile()
    out.append(dict(remat=remat, scan=scan,
                    temp_bytes=compiled.memory_analysis().temp_size_in_bytes))
    log(f"probe remat={remat} scan={scan}: temp {out[-1]['temp_bytes'] / 2**20:.0f} MiB")
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax

  from bench import meshes_or_exit, out_path_or_exit
  meshes_or_exit([args.mesh], "bench.memory")
  out_path_or_exit(args.out, "bench.memory")
  log = lambda line: print(line, file=sys.stderr, flush=True)
  sections = args.sections
  results = {"jax": jax.__version__, "mesh": args.mesh, "batch": args.batch}
  if "memory" in sections:
    results["memory"] = memory_section(args, log)
  if "compile" in sections:
    results["compile"] = compile_section(args, log)
  if "step" in sections:
    results["step"] = step_section(args, log)
  if "probe" in sections:
    results["probe"] = probe_section(log)
  if "fsdp" in sections:
    results["fsdp"] = fsdp_section(args, log)
  print(json.dumps(results, indent=1))
  if args.out:
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
