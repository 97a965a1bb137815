"""Peak host memory while building a model: ``python -m bench.hostmem --mesh 1x8``.

Prints one JSON line. Run in its own process so the peak (VmHWM) is this
build's alone; it is reset just before building (``/proc/self/clear_refs``).
On CPU the simulated devices' arrays live in host memory too, so the figure
that matters is the *transient*: peak minus what the built model keeps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def proc_status(field: str) -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024
  raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
  from train.errors import OneLineParser, positive_int
  parser = OneLineParser(prog="bench.hostmem", description=__doc__.split("\n\n")[0])
  parser.add_argument("--mesh", default="1x8")
  parser.add_argument("--reference", action="store_true", help="build the plain-Flax model")
  parser.add_argument("--d-model", type=positive_int, default=512)
  parser.add_argument("--vocab", type=positive_int, default=32768)
  args = parser.parse_args()
  if args.d_model % 8:
    parser.error(f"--d-model must be a multiple of the 8 heads, got {args.d_model}")
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax
  from flax import nnx

  import flax_tp
  from bench import meshes_or_exit
  meshes_or_exit([args.mesh], "bench.hostmem")
  from models.config import TransformerConfig
  from models.reference import ReferenceTransformer
  from models.transformer import Transformer

  cfg = TransformerConfig(vocab_size=args.vocab, d_model=args.d_model, num_heads=8,
                          head_dim=args.d_model // 8, d_ff=4 * args.d_model, num_layers=4)
  mesh = flax_tp.make_mesh(args.mesh)
  # Warm up JAX (backends, the initializers' compiled kernels) on a tiny model.
  Transformer(cfg.tiny(), mesh=mesh, rngs=nnx.Rngs(0))
  ReferenceTransformer(cfg.tiny(), rngs=nnx.Rngs(0))
  Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
  before = proc_status("VmRSS")
  model = (ReferenceTransformer(cfg, rngs=nnx.Rngs(0)) if args.reference
           else Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
  jax.block_until_ready(nnx.state(model))
  peak, after = proc_status("VmHWM"), proc_status("VmRSS")
  sizes = [v[...].size * v[...].dtype.itemsize
           for _, v in nnx.to_flat_state(flax_tp.unshard(model) if not args.reference
                                        else nnx.state(model, nnx.Param))]
  print(json.dumps(dict(model="reference" if args.reference else "flax_tp", mesh=args.mesh,
                        model_bytes=sum(sizes), largest_param_bytes=max(sizes),
                        rss_growth_bytes=after - before, peak_growth_bytes=peak - before,
                        transient_bytes=peak - after)))


if __name__ == "__main__":
  main()
