"""Where a step's time goes on the accelerator: flax_tp's step beside the peer's, by op.

    python3 -m bench.device_profile --preset llama-125m --point 8x1024 --out /tmp/profile.json

Builds flax_tp's train step (``bench.harness.flax_tp_contender``: as train/run.py's loop
runs it) and the independent peer's (``bench/peer_llama.py``, splash attention) at one
point on a 1x1 mesh, times them interleaved (medians), then traces a few steps of each
with ``jax.profiler`` and reads the trace: per step, the device's time in its programs
("XLA Modules"), in its ops ("XLA Ops", by op name, with the op's shape and jax source
from the compiled HLO), and each step's wall time on the host ("Steps"). A step's wall
time past its module time is the host's: dispatch, arguments, results.

On a TPU v5e it found (BENCHMARKS.md §6) splash's backward kernels run as one call per
example (their mask tables batched) and the loop's nnx.State flattened per step.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
  sys.path.insert(0, str(ROOT))

_META = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"")


def op_sources(hlo_text: str) -> dict[str, tuple[str, str]]:
  """Each named instruction of compiled HLO text -> (its result shape, its jax op name)."""
  found = {}
  for line in hlo_text.splitlines():
    match = _META.match(line)
    if match:
      found[match.group(1)] = (match.group(2)[:60], match.group(3)[-100:])
  return found


def device_times(events: list[dict], device: str, steps: int) -> dict:
  """From a Chrome trace's ``events``, the process whose name holds ``device`` (e.g.
  "TPU:0"): milliseconds per step on each of its threads ("Steps", "XLA Modules", "XLA
  Ops") and, per op name, its calls and milliseconds per step."""
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  per_thread = collections.Counter()
  ops = collections.defaultdict(lambda: [0, 0.0])
  for e in events:
    if e.get("ph") != "X" or device not in names.get(e["pid"], ""):
      continue
    thread = threads.get((e["pid"], e["tid"]), "")
    per_thread[thread] += e.get("dur", 0)
    if thread == "XLA Ops":
      ops[e["name"]][0] += 1
      ops[e["name"]][1] += e.get("dur", 0)
  if not per_thread:
    raise ValueError(f"the trace holds no events of a process named like {device!r}; "
                     f"its processes: {sorted(set(names.values()))}")
  return {"threads_ms": {t: us / steps / 1e3 for t, us in per_thread.items()},
          "ops": {name: (calls / steps, us / steps / 1e3) for name, (calls, us) in ops.items()}}


def main(argv=None) -> int:
  from train.errors import OneLineParser, positive_int
  p = OneLineParser(prog="bench.device_profile", description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="llama-125m")
  p.add_argument("--point", default="8x1024", help="BATCHxSEQ")
  p.add_argument("--repeats", type=positive_int, default=8, help="interleaved timed steps")
  p.add_argument("--traced", type=positive_int, default=3, help="steps traced per contender")
  p.add_argument("--top", type=positive_int, default=40, help="ops listed per contender")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  try:
    batch, seq = (int(n) for n in args.point.split("x"))
  except ValueError:
    p.error(f"--point must be BATCHxSEQ, got {args.point!r}")

  import jax

  import flax_tp
  from bench import peer_llama
  from bench.harness import at_point, flax_tp_contender, interleaved_medians, peer_contender
  from models.config import TransformerConfig
  from train.step import make_optimizer

  device = jax.devices()[0]
  if device.platform not in ("tpu", "gpu"):
    p.error(f"reads an accelerator's trace; this process's device is {device.platform!r}")
  cfg, tokens = at_point(TransformerConfig.preset(args.preset, dtype="bfloat16"), batch, seq)
  tx = make_optimizer(lr=1e-4, steps=1000, warmup_steps=10)
  contenders = {
      "flax_tp": flax_tp_contender(cfg, flax_tp.make_mesh("1x1"), tokens, tx)[1],
      "peer splash": peer_contender(peer_llama.PeerLlama(cfg, tx, "splash", seq=seq),
                                    tokens)[0]}
  medians = interleaved_medians(contenders, args.repeats)
  results = {"device": device.device_kind, "preset": args.preset, "batch": batch,
             "seq": seq, "versions": {"jax": jax.__version__},
             "step_ms": {n: m * 1e3 for n, m in medians.items()},
             "flax_tp / peer": medians["flax_tp"] / medians["peer splash"], "profiles": {}}
  print(json.dumps({k: results[k] for k in ("step_ms", "flax_tp / peer")}), file=sys.stderr)
  for name, contender in contenders.items():
    folder = tempfile.mkdtemp(prefix="device_profile_")
    jax.profiler.start_trace(folder)
    for _ in range(args.traced):
      contender()
    jax.profiler.stop_trace()
    trace = sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(trace) as f:
      events = json.load(f)["traceEvents"]
    times = device_times(events, f"{device.platform.upper()}:0", args.traced)
    sources = op_sources(contender.compiled.as_text())
    top = sorted(times["ops"].items(), key=lambda kv: -kv[1][1])[:args.top]
    results["profiles"][name] = {
        "threads_ms": times["threads_ms"],
        "ops": [{"op": op, "calls": calls, "ms": round(ms, 4),
                 "result": sources.get(op, ("", ""))[0], "source": sources.get(op, ("", ""))[1]}
                for op, (calls, ms) in top]}
    print(json.dumps({name: times["threads_ms"]}), file=sys.stderr, flush=True)
  if args.out:
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
  print(json.dumps(results, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
