"""Two checkouts' train steps timed in one process, interleaved: a change against its parent.

On this 2-core machine whole runs of a step move by up to 5% from one process to the next
(the same commit gave 0.96-1.05 of issue 41's peer at 2x4 within half an hour), more than
most changes to the step are worth. Importing both checkouts' ``flax_tp``, ``models`` and
``train`` into one process and timing their compiled steps in turns takes that away: what
is left moves by about 3%.

    git worktree add /tmp/parent HEAD~1
    python -m bench.ab_checkouts --roots /tmp/parent,. --meshes 2x4,1x8 --repeats 30

Each root's step is the issue-41 shape (2 layers, d_model 128, 8 heads, MLP 512, vocabulary
256, batch 16 x 128, float32, AdamW without clipping) unless ``--layers`` etc. say
otherwise. Prints one line per mesh: each root's median step and its ratio to the first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from bench import mesh_list

_PACKAGES = ("flax_tp", "models", "train")


def _step_of(root: str, mesh_spec: str, args: argparse.Namespace) -> Callable[[], None]:
  """Imports ``root``'s packages afresh (dropping any other checkout's from
  ``sys.modules``) and returns one call of its compiled train step, blocking."""
  import jax
  import numpy as np
  from flax import nnx

  for name in [n for n in sys.modules if n.split(".")[0] in _PACKAGES]:
    del sys.modules[name]
  root = os.path.abspath(root)
  sys.path.insert(0, root)
  try:
    import flax_tp
    from models.config import TransformerConfig
    from models.transformer import Transformer
    from train.step import Trainer, make_optimizer
  finally:
    sys.path.remove(root)
  if not os.path.abspath(flax_tp.__file__).startswith(root + os.sep):
    raise SystemExit(f"{root}: imported flax_tp from {flax_tp.__file__}, not from this checkout")
  cfg = TransformerConfig(vocab_size=args.vocab, d_model=args.d, num_heads=args.heads,
                          head_dim=args.d // args.heads, d_ff=args.mlp,
                          num_layers=args.layers, max_seq_len=args.seq)
  trainer = Trainer(Transformer(cfg, mesh=flax_tp.make_mesh(mesh_spec), rngs=nnx.Rngs(0)),
                    make_optimizer(lr=1e-3, steps=1000, grad_clip=0.0))
  tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq + 1))
  tokens = jax.device_put(tokens.astype(np.int32), trainer.batch_sharding)
  state = {"params": trainer.params, "opt": trainer.init_opt_state(trainer.params)}
  key = jax.random.key(0)

  def step() -> None:
    state["params"], state["opt"], metrics = trainer.train_step(
        state["params"], state["opt"], tokens, key)
    jax.block_until_ready(metrics)
  return step


def compare(roots: list[str], mesh_spec: str, args: argparse.Namespace) -> list[float]:
  """Median step (s) of each root's step on ``mesh_spec`` (in ``roots``' order; a root
  may come twice, which times a checkout against itself), timed in turns."""
  import numpy as np

  steps = [_step_of(root, mesh_spec, args) for root in roots]
  for step in steps:  # compile, then warm
    for _ in range(3):
      step()
  times: list[list[float]] = [[] for _ in roots]
  for _ in range(args.repeats):
    for step, timed in zip(steps, times, strict=True):
      start = time.perf_counter()
      step()
      timed.append(time.perf_counter() - start)
  return [float(np.median(t)) for t in times]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--roots", required=True,
                      help="comma-separated checkouts; the first is the baseline")
  parser.add_argument("--meshes", default="2x4")
  parser.add_argument("--repeats", type=int, default=30)
  for name, default in (("layers", 2), ("d", 128), ("heads", 8), ("mlp", 512),
                        ("vocab", 256), ("seq", 128), ("batch", 16)):
    parser.add_argument(f"--{name}", type=int, default=default)
  args = parser.parse_args(argv)
  roots = args.roots.split(",")
  for root in roots:
    if not os.path.isfile(os.path.join(root, "flax_tp", "__init__.py")):
      parser.error(f"--roots: {root!r} is not a flax_tp checkout (no flax_tp/__init__.py)")
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  for mesh_spec in mesh_list(args.meshes):
    medians = compare(roots, mesh_spec, args)
    print(mesh_spec, "  ".join(f"{root}: {1e3 * t:.1f} ms ({t / medians[0]:.3f})"
                               for root, t in zip(roots, medians, strict=True)), flush=True)


if __name__ == "__main__":
  main()
