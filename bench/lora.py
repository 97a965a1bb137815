"""LoRA against full fine-tuning: what each device holds of the params, their gradients
and AdamW's two moments (BENCHMARKS.md §14).

Per device: the bytes of each array's shard on device 0, from the models' abstract
shapes and shardings (``nnx.eval_shape``: nothing is allocated, so the 1B-parameter
preset costs no memory). Full fine-tuning holds every param, its gradient and two
moments; LoRA holds every param (the frozen base and the adapters) but the gradients and
moments of the adapters alone, which are split over ``"model"`` as their base.

    python -m bench.lora --out bench/lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

PRESETS = ("llama-350m", "llama3.2-1b")
ALL_PROJECTIONS = ("blocks.*.attn.[qkvo]", "blocks.*.mlp.*")
SETTINGS = {  # name: (rank, alpha, targets)
    "peft-default r8 q,v": (8, 8.0, ("blocks.*.attn.[qv]",)),
    "r16 all projections": (16, 32.0, ALL_PROJECTIONS),
}


def device_bytes(state: Any) -> int:
  """Bytes of device 0's shard of every array in ``state`` (abstract or real)."""
  import jax
  import numpy as np
  total = 0
  for leaf in jax.tree.leaves(state):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
  return total


def measure(preset: str, spec: str, fsdp: bool) -> dict[str, Any]:
  from flax import nnx

  import flax_tp
  from models.config import TransformerConfig
  from models.execution import Execution
  from models.transformer import Transformer
  cfg = TransformerConfig.preset(preset)
  mesh = flax_tp.make_mesh(spec)
  execution = Execution(fsdp=fsdp)

  def build(lora):
    return nnx.eval_shape(lambda: Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0),
                                              execution=execution, lora=lora))

  full = device_bytes(nnx.state(build(None), nnx.Param))
  row = dict(preset=preset, mesh=spec, fsdp=fsdp,
             full_fine_tune=dict(params=full, grads=full, adam=2 * full, total=4 * full))
  for name, (rank, alpha, targets) in SETTINGS.items():
    model = build(flax_tp.LoRAConfig(rank=rank, alpha=alpha, targets=targets))
    params = device_bytes(nnx.state(model, nnx.Param))
    adapters = device_bytes(nnx.state(model, nnx.LoRAParam))
    total = params + 3 * adapters
    row[name] = dict(params=params, adapters=adapters, grads=adapters, adam=2 * adapters,
                     total=total, ratio_to_full=total / (4 * full))
  return row


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
  p.add_argument("--meshes", default="2x4,1x8", help="comma-separated meshes: DxM, DxCxM or named (data=2,model=4)")
  p.add_argument("--presets", default=",".join(PRESETS))
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax

  from bench import mesh_list, meshes_or_exit, out_path_or_exit
  meshes = mesh_list(args.meshes)
  meshes_or_exit(meshes, "bench.lora", context=False)
  out_path_or_exit(args.out, "bench.lora")
  rows = []
  for preset in (p.strip() for p in args.presets.split(",") if p.strip()):
    for spec in meshes:
      for fsdp in (False, True) if not spec.startswith("1x") else (False,):
        row = measure(preset, spec, fsdp)
        rows.append(row)
        mib = lambda b: f"{b / 2**20:,.1f} MiB"
        print(f"{preset} {spec}{' fsdp' if fsdp else ''}: full fine-tune "
              f"{mib(row['full_fine_tune']['total'])} | " + " | ".join(
                  f"{name} {mib(row[name]['total'])} ({row[name]['ratio_to_full']:.3f})"
                  for name in SETTINGS), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"jax": jax.__version__, "command": "python -m bench.lora " + " ".join(
          argv if argv is not None else sys.argv[1:]), "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
