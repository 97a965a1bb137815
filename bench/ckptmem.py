"""Peak host memory while saving and restoring a sharded checkpoint.

    python -m bench.ckptmem                 # 1 process, 8 simulated devices, mesh 1x8
    python -m bench.ckptmem --processes 2   # 2 processes x 4 devices, global mesh 2x4

The model (``--layers`` deep, vocabulary 4096, d_model 512, d_ff 2048) is many
times larger than its largest param. Each process prints one JSON line: the
model's and largest param's bytes, and the *transient* host memory of a
synchronous save, an asynchronous save and a restore onto another mesh: peak
resident memory (VmHWM, reset before each) minus the resident memory before it;
for a restore, beside the restored arrays this process's devices keep. On
CPU the simulated devices' arrays are host memory too, so an asynchronous save's
device-side copy of the state shows up here (on a GPU it is device memory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.hostmem import proc_status


def _measure(fn) -> tuple[int, object]:
  """(peak RSS during ``fn`` minus RSS before it, its result)."""
  Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
  before = proc_status("VmRSS")
  result = fn()
  return proc_status("VmHWM") - before, result


def worker(args) -> None:
  import jax
  if args.processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
  from flax import nnx

  import flax_tp
  from flax_tp.checkpoint import Checkpointer
  from models.config import TransformerConfig
  from models.transformer import Transformer

  cfg = TransformerConfig(vocab_size=4096, d_model=512, num_heads=8, head_dim=64, d_ff=2048,
                          num_layers=args.layers)
  save_mesh, load_mesh = ("1x8", "2x4") if args.processes == 1 else ("2x4", "1x8")
  model = Transformer(cfg, mesh=flax_tp.make_mesh(save_mesh), rngs=nnx.Rngs(0))
  state = {"params": nnx.state(model, nnx.Param)}
  # Every size divides every mesh here, so stored sizes are the logical ones.
  sizes = [v[...].size * v[...].dtype.itemsize for _, v in nnx.to_flat_state(state["params"])]
  folder = Path(args.dir)
  sync_peak, _ = _measure(lambda: Checkpointer(folder / "sync").save(1, state, {}))

  def async_save():
    ck = Checkpointer(folder / "async", asynchronous=True)
    ck.save(1, state, {})
    ck.wait()
  async_peak, _ = _measure(async_save)
  target = Transformer(cfg, mesh=flax_tp.make_mesh(load_mesh), rngs=nnx.Rngs(1))
  like = {"params": nnx.state(target, nnx.Param)}
  restore_peak, restored = _measure(lambda: Checkpointer(folder / "sync").restore(like)[0])
  jax.block_until_ready(restored)
  # What the restore keeps: this process's device blocks (host memory on CPU).
  kept = sum(s.data.nbytes for x in jax.tree.leaves(restored) for s in x.addressable_shards)
  print(json.dumps(dict(processes=args.processes, process=jax.process_index(),
                        save_mesh=save_mesh, restore_mesh=load_mesh, model_bytes=sum(sizes),
                        largest_param_bytes=max(sizes), sync_save_transient=sync_peak,
                        async_save_transient=async_peak, restore_peak_growth=restore_peak,
                        restore_kept=kept)),
        flush=True)


def main() -> None:
  from train.errors import OneLineParser, positive_int
  parser = OneLineParser(prog="bench.ckptmem", description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=positive_int, choices=(1, 2, 4, 8), default=1,
                      help="processes sharing the 8 devices")
  parser.add_argument("--layers", type=positive_int, default=16)
  parser.add_argument("--process-id", type=int, default=None)
  parser.add_argument("--coordinator", default=None)
  parser.add_argument("--dir", default=None)
  args = parser.parse_args()
  if args.process_id is not None or args.processes == 1:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count="
                          f"{8 // args.processes}")
    with tempfile.TemporaryDirectory() as tmp:
      args.dir = args.dir or tmp
      worker(args)
    return
  from train.launch import free_port
  coordinator = f"127.0.0.1:{free_port()}"
  with tempfile.TemporaryDirectory() as tmp:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen([sys.executable, "-m", "bench.ckptmem", "--processes",
                               str(args.processes), "--process-id", str(i), "--coordinator",
                               coordinator, "--dir", tmp, "--layers", str(args.layers)],
                              env=env, cwd=Path(__file__).resolve().parent.parent)
             for i in range(args.processes)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
  main()
