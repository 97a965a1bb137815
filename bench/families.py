"""The model families at their released shapes: each device's memory and the collective
bytes of the train step against Megatron's minimum, compiled from abstract shapes.

    python -m bench.families                                  # the three presets at 2x4, 1x8
    python -m bench.families --presets qwen3-0.6b --meshes 1x8 --seq 256   # one of them

Nothing is allocated or run: ``bench.memory.abstract_step`` compiles the train step from
abstract params, optimizer state and batch. Per preset and mesh it reports the bytes
each device holds for params + Adam state (XLA's argument bytes, less the batch), its
temporary bytes (activations and every other intermediate), and the collectives of the
compiled step against ``bench.run.megatron_minimum`` (``audit``). Prints one JSON
object (and writes it to ``--out``).
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

PRESETS = ("llama3.2-1b", "qwen3-0.6b", "gemma3-1b")
# How a preset's step runs where plain tensor and data parallelism cannot hold it:
# DeepSeek-V3's 671B params need FSDP and its experts over every device (a share each),
# scanned so the compile holds one block of each kind; GPT-OSS 20B's 32 experts of FFN
# 2880 likewise (whole experts, four per device). Their collectives are not set against
# Megatron's dense minimum, which has no expert dispatch or FSDP gathers.
EXECUTION = {"deepseek-v3": dict(scan_layers=True, fsdp=True, expert_axes=("data", "model")),
             "gpt-oss-20b": dict(scan_layers=True, fsdp=True, expert_axes=("data", "model"))}


def parse_args(argv=None) -> argparse.Namespace:
  from models.config import TransformerConfig
  from train.errors import OneLineParser, comma_choices, positive_int
  p = OneLineParser(prog="bench.families", description=__doc__.split("\n\n")[0])
  p.add_argument("--presets", type=comma_choices(TransformerConfig.preset_names()),
                 default=list(PRESETS), help=f"comma-separated (default {','.join(PRESETS)})")
  p.add_argument("--meshes", type=comma_choices(("2x4", "1x8", "4x2", "8x1")),
                 default=["2x4", "1x8"])
  p.add_argument("--batch", type=positive_int, default=8, help="global batch")
  p.add_argument("--seq", type=positive_int, default=1024)
  p.add_argument("--out", default=None)
  return p.parse_args(argv)


def local_bytes(tree) -> int:
  """Bytes one device holds of abstract arrays (``ShapeDtypeStruct`` with shardings)."""
  import jax
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def measure(preset: str, spec: str, batch: int, seq: int) -> dict:
  import flax_tp
  from bench.memory import abstract_step
  from bench.run import megatron_minimum
  from flax_tp.hlo import collectives, tally
  from models.config import TransformerConfig
  cfg = TransformerConfig.preset(preset, max_seq_len=seq)
  mesh = flax_tp.make_mesh(spec)
  keep: dict = {}
  execution = EXECUTION.get(preset)
  compiled, seconds = abstract_step(cfg, mesh, batch, seq, keep=keep, execution=execution)
  stats = compiled.memory_analysis()
  rows = tally(collectives(compiled.as_text(), mesh))
  model, data = rows.get("all-reduce@model", {}), rows.get("all-reduce@data", {})
  measured = dict(count=model.get("tensors", 0) + data.get("ops", 0),
                  bytes=model.get("bytes", 0) + data.get("bytes", 0)
                  + data.get("scalar_bytes", 0))
  minimum = None if execution else megatron_minimum(
      cfg, mesh.shape["data"], mesh.shape["model"], batch, seq, local_bytes(keep["params"]))
  others = {k: v for k, v in rows.items() if k not in ("all-reduce@model", "all-reduce@data")}
  from bench.harness import param_count
  logical = param_count(cfg)  # (the stored params hold padding too)
  return dict(
      preset=preset, mesh=spec, execution=execution, params=logical,
      compile_s=round(seconds, 1),
      param_and_adam_bytes=local_bytes(keep["params"]) + local_bytes(keep["opt_state"]),
      temp_bytes=stats.temp_size_in_bytes, collectives_measured=measured,
      collectives_minimum=minimum,
      bytes_ratio=measured["bytes"] / minimum["bytes"] if minimum and minimum["bytes"] else None,
      model_scalars=model.get("scalars", 0), data_ops=data.get("ops", 0),
      other_collectives=others)


def main(argv=None) -> int:
  args = parse_args(argv)
  from bench.harness import DEVICES
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
  import flax
  import jax

  from bench import meshes_or_exit, out_path_or_exit
  meshes_or_exit(args.meshes, "bench.families")
  out_path_or_exit(args.out, "bench.families")
  out = dict(jax=jax.__version__, flax=flax.__version__, batch=args.batch, seq=args.seq,
             started=time.strftime("%Y-%m-%d %H:%M"), rows=[])
  for preset in args.presets:
    for spec in args.meshes:
      row = measure(preset, spec, args.batch, args.seq)
      out["rows"].append(row)
      ratio = ("not set against a minimum" if row["bytes_ratio"] is None
               else f"{row['bytes_ratio']:.3f}x Megatron's minimum")
      print(f"{preset} {spec}: {row['params'] / 1e6:.0f}M params, "
            f"{row['param_and_adam_bytes'] / 2**30:.2f} GiB params+Adam and "
            f"{row['temp_bytes'] / 2**30:.2f} GiB temporaries per device; collective bytes "
            f"{ratio} (compiled in {row['compile_s']} s)", file=sys.stderr, flush=True)
  text = json.dumps(out, indent=1)
  print(text)
  if args.out:
    Path(args.out).write_text(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
