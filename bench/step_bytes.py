"""Where a compiled train step's bytes go: flax_tp's beside the independent peer's
(BENCHMARKS.md §6, issue "speed on the accelerator" point 2).

    python -m bench.step_bytes --preset llama-125m --point 8x1024 --out /tmp/bytes.json
    python -m bench.step_bytes --preset llama-tiny --point 2x16 --attention xla   # smoke

For each contender (flax_tp under each ``--attention`` and ``--execution`` setting; the
peer, ``bench/peer_llama.py``, under each of ``--peers``) XLA's own accounting of the
step it compiled for this device: FLOPs and bytes accessed (``cost_analysis``), the
temporaries and arguments (``memory_analysis``), and the optimized HLO's largest
instruction results by shape and dtype (how many of each and their bytes), which name
the tensors one program writes that the other does not. With ``--hlo-dir`` each
program's optimized HLO text is written there too, to read fusion by fusion.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
  sys.path.insert(0, str(ROOT))

# An HLO instruction's result: "%name = f32[8,1024,768]{...} op(" (a tuple's parts are
# counted at the instructions that make them).
_RESULT = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\][^ ]* (\w[\w\-]*)\(",
                     re.M)
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "s8": 1, "u8": 1, "pred": 1,
          "s64": 8, "f64": 8}


def largest_results(hlo_text: str, top: int = 15) -> list[dict]:
  """The ``top`` (dtype, shape) results of the entry computation's and fusions' callers
  by total bytes (count x size): what the program writes to memory, as XLA left it."""
  # The bodies of fusions (their insides stay in registers and on-chip memory) are left
  # out: their results are counted at the fusion instruction that calls them.
  fused = set(re.findall(r" fusion\(.*?calls=%?([\w.\-]+)", hlo_text))
  kept = []
  for block in re.split(r"\n(?=\S)", hlo_text):
    name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
    if name is None or name.group(1) not in fused:
      kept.append(block)
  tally = collections.Counter()
  for dtype, dims, op in _RESULT.findall("\n".join(kept)):
    if op in ("parameter", "constant", "get-tuple-element", "bitcast", "tuple"):
      continue
    size = _BYTES.get(dtype, 4)
    for d in filter(None, dims.split(",")):
      size *= int(d)
    tally[(dtype, dims, op)] += size
  rows = []
  for (dtype, dims, op), total in tally.most_common(top):
    one = _BYTES.get(dtype, 4)
    for d in filter(None, dims.split(",")):
      one *= int(d)
    rows.append({"result": f"{dtype}[{dims}]", "op": op, "count": total // max(one, 1),
                 "gb": round(total / 1e9, 3)})
  return rows


def accounting(compiled) -> dict:
  """XLA's figures of one compiled program (GB, TFLOP)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  memory = compiled.memory_analysis()
  return {"tflop": round(cost.get("flops", 0.0) / 1e12, 3),
          "gb_accessed": round(cost.get("bytes accessed", 0.0) / 1e9, 2),
          "temp_gb": round(memory.temp_size_in_bytes / 1e9, 3),
          "argument_gb": round(memory.argument_size_in_bytes / 1e9, 3)}


def main(argv=None) -> int:
  from train.errors import OneLineParser
  p = OneLineParser(prog="bench.step_bytes", description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="llama-125m")
  p.add_argument("--point", default="8x1024", help="BATCHxSEQ")
  p.add_argument("--attention", default="auto", help="comma-separated flax_tp kernels")
  p.add_argument("--execution", default="",
                 help="semicolon-separated extra flax_tp settings, each comma-separated "
                      "Execution fields (e.g. 'remat=save_attention;loss_chunks=4')")
  p.add_argument("--peers", default="splash,xla", help="the peer's kernels, or 'none'")
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--hlo-dir", default=None)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  try:
    batch, seq = (int(n) for n in args.point.split("x"))
  except ValueError:
    p.error(f"--point must be BATCHxSEQ, got {args.point!r}")

  import jax

  import flax_tp
  from bench import peer_llama
  from bench.harness import at_point, flax_tp_contender, peer_contender
  from models.config import TransformerConfig
  from models.execution import Execution
  from train.step import make_optimizer

  cfg, tokens = at_point(TransformerConfig.preset(args.preset, dtype="bfloat16"), batch, seq)
  tx = make_optimizer(lr=1e-4, steps=1000, warmup_steps=10)
  mesh = flax_tp.make_mesh("1x1")
  settings = [{}] + [dict(field.split("=", 1) for field in setting.split(","))
                     for setting in args.execution.split(";") if setting]
  contenders = {}
  for kernel in filter(None, args.attention.split(",")):
    for setting in settings:
      fields = {k: int(v) if v.isdigit() else v for k, v in setting.items()}
      name = " ".join([f"flax_tp attention={kernel}", *(f"{k}={v}" for k, v in fields.items())])
      contenders[name] = lambda kernel=kernel, fields=fields: flax_tp_contender(
          cfg, mesh, tokens, tx, Execution(attention=kernel, **fields))[1].compiled
  for kind in [] if args.peers == "none" else filter(None, args.peers.split(",")):
    contenders[f"peer {kind}"] = lambda kind=kind: peer_contender(
        peer_llama.PeerLlama(cfg, tx, kind, seq=seq), tokens)[0].compiled
  results = {"device": jax.devices()[0].device_kind, "preset": args.preset, "batch": batch,
             "seq": seq, "programs": {}}
  for name, build in contenders.items():
    compiled = build()
    text = compiled.as_text()
    results["programs"][name] = {**accounting(compiled),
                                 "largest": largest_results(text, args.top)}
    if args.hlo_dir:
      Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
      (Path(args.hlo_dir) / (re.sub(r"\W+", "_", name) + ".hlo.txt")).write_text(text)
    print(json.dumps({name: {k: v for k, v in results["programs"][name].items()
                             if k != "largest"}}), file=sys.stderr, flush=True)
    del compiled
  if args.out:
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
  print(json.dumps(results, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
