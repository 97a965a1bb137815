"""Where a compiled train step spends its time: flax_tp's step beside the ``gpt`` peer's.

For each contender on each mesh it reports, from the compiled program itself:
- the HLO after optimisation: fusions by kind (XLA names a fusion after its ops, e.g.
  ``multiply_add_fusion``; an XNNPACK ``ynn_fusion`` is named here by the ops it holds),
  the dots and their shapes, the collectives;
- a ``jax.profiler`` trace of a few steps: thread time per device and step of each kind,
  and how many rendezvous (the devices' meeting points of a collective) a step holds.

Thread time is what the host's cores spend, summed over the simulated devices; on this
2-core machine it is what the step's wall time is made of. The tracer slows every op a
little, so compare the contenders' figures with each other, not with ``bench/run.py``'s.

    python -m bench.step_profile --meshes 2x4,4x2 --out bench/peers_gpt/profile.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
from typing import Any

_FUSION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) fusion\(.*calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_OP = re.compile(r"= \S+ ([\w\-]+)\(")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? (all-reduce|all-gather|reduce-scatter|"
                         r"all-to-all|collective-permute)(?:-start)?\(")
_DOT = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\w+\[[\d,]*\])\S* dot\(")


def hlo_kinds(hlo: str) -> dict[str, str]:
  """Each fusion and collective of the compiled ``hlo`` text -> its kind.

  A fusion's kind is its name without the number (``copy_bitcast_fusion``); an XNNPACK
  fusion (``ynn_fusion``) is named by the ops it holds (``ynn:dot``, ``ynn:reduce``), and
  a reduction to a scalar is told apart (``ynn:reduce->scalar``): those are norms. A
  collective's kind is its opcode.
  """
  bodies: dict[str, list[str]] = {}
  current = None
  for line in hlo.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = bodies.setdefault(m.group(1), [])
    elif current is not None and line.strip() not in ("", "}"):
      current.append(line)
  kinds = {}
  for line in hlo.splitlines():
    m = _COLLECTIVE.match(line)
    if m:
      kinds[m.group(1)] = m.group(2)
      continue
    m = _FUSION.match(line)
    if not m:
      continue
    name, shape, body = m.groups()
    if name.startswith("ynn_fusion"):
      ops = {op.group(1) for b in bodies.get(body, []) if (op := _OP.search(b))}
      ops -= {"parameter", "bitcast", "broadcast", "constant"}
      kind = "ynn:" + "+".join(sorted(ops))
      if shape.startswith("f32[]") and "reduce" in ops:
        kind += "->scalar"
      kinds[name] = kind
    else:
      kinds[name] = re.sub(r"\.\d+$", "", name)
  return kinds


def dot_shapes(hlo: str) -> list[str]:
  """The output shapes of the program's dots, sorted (two programs doing the same
  matmuls list the same shapes)."""
  return sorted(m.group(1) for line in hlo.splitlines() if (m := _DOT.match(line)))


def traced_thread_time(step, steps: int) -> tuple[collections.Counter, collections.Counter]:
  """Run ``step()`` ``steps`` times under ``jax.profiler`` -> (nanoseconds, count) per
  trace event name, over all host threads."""
  import jax
  folder = tempfile.mkdtemp(prefix="flax_tp_profile_")
  with jax.profiler.trace(folder):
    for _ in range(steps):
      step()
  [path] = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
  data = jax.profiler.ProfileData.from_file(path)
  seconds, count = collections.Counter(), collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        seconds[event.name] += event.duration_ns
        count[event.name] += 1
  return seconds, count


def profile_contender(contender, devices: int, steps: int) -> dict[str, Any]:
  """One contender's compiled step: HLO census and traced thread time per kind."""
  hlo = contender.compiled.as_text()
  kinds = hlo_kinds(hlo)
  for _ in range(2):  # warm
    contender()
  ns, count = traced_thread_time(contender, steps)
  per = devices * steps
  time_ms: dict[str, float] = collections.Counter()
  for name, kind in kinds.items():
    time_ms[kind] += ns.get(name, 0) / per / 1e6
  fusions = [k for k in kinds.values() if k not in _COLLECTIVES]
  return {
      "fusions": len(fusions),
      "fusion_kinds": dict(collections.Counter(fusions).most_common()),
      "collectives": dict(collections.Counter(k for k in kinds.values() if k in _COLLECTIVES)),
      "dots": dot_shapes(hlo),
      "thread_ms_per_device": {k: round(v, 3) for k, v in
                               sorted(time_ms.items(), key=lambda kv: -kv[1])},
      "fusion_thread_ms_per_device": round(sum(v for k, v in time_ms.items()
                                               if k not in _COLLECTIVES), 3),
      "collective_thread_ms_per_device": round(sum(v for k, v in time_ms.items()
                                                   if k in _COLLECTIVES), 3),
      "rendezvous_per_device": count.get("Rendezvous", 0) / per,
  }


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def parse_args(argv=None) -> argparse.Namespace:
  from train.errors import positive_int
  p = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="small", choices=["tiny", "small", "llama-125m"])
  p.add_argument("--layers", type=positive_int, default=2)
  p.add_argument("--batch-size", type=positive_int, default=16)
  p.add_argument("--seq-len", type=positive_int, default=128)
  p.add_argument("--meshes", default="2x4,4x2", help="comma-separated meshes: DxM, DxCxM or named (data=2,model=4)")
  p.add_argument("--steps", type=positive_int, default=5, help="steps traced per contender")
  p.add_argument("--out", default=None, help="write the figures here as JSON")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from bench.harness import DEVICES, bench_config, flax_tp_contender, peer_contender
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
  import jax
  import optax

  import flax_tp
  from bench import mesh_list, meshes_or_exit, out_path_or_exit, peers
  meshes = mesh_list(args.meshes)
  meshes_or_exit(meshes, "bench.step_profile", context=False)
  out_path_or_exit(args.out, "bench.step_profile")

  cfg = bench_config(args.preset, layers=args.layers, seq_len=args.seq_len)
  # AdamW without clipping on either side, as the gpt peer is timed in bench/run.py.
  tx = optax.adamw(1e-3)
  tokens = peers.tokens_for(cfg, args.batch_size, args.seq_len)
  results: dict[str, Any] = {"command": " ".join(["python -m bench.step_profile", *(argv or sys.argv[1:])]),
                             "jax": jax.__version__, "meshes": {}}
  for spec in meshes:
    mesh = flax_tp.make_mesh(spec)
    _, mine, _ = flax_tp_contender(cfg, mesh, tokens, tx)
    gpt, _ = peer_contender(peers.gpt(cfg, tx, mesh), tokens)
    entry = {name: profile_contender(c, mesh.size, args.steps)
             for name, c in (("flax_tp", mine), ("gpt", gpt))}
    entry["same_dots"] = entry["flax_tp"]["dots"] == entry["gpt"]["dots"]
    results["meshes"][spec] = entry
    for name in ("flax_tp", "gpt"):
      e = entry[name]
      top = ", ".join(f"{k} {v:.2f}" for k, v in list(e["thread_ms_per_device"].items())[:6])
      print(f"{spec} {name}: {e['fusions']} fusions, {len(e['dots'])} dots, "
            f"{sum(e['collectives'].values())} collectives, "
            f"{e['rendezvous_per_device']:.0f} rendezvous; thread ms/device/step: fusions "
            f"{e['fusion_thread_ms_per_device']:.2f}, collectives "
            f"{e['collective_thread_ms_per_device']:.2f} ({top})", flush=True)
    print(f"{spec}: the same dots (shapes) in both: {entry['same_dots']}", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
