"""``flax_tp.parallelize`` on a model nobody rewrote, against the hand-written model.

    python -m bench.plan                          # 1x8, 2x4, 4x2 at the small width
    python -m bench.plan --meshes 2x4 --repeats 1 --preset tiny     # a smoke run

Per mesh, one AdamW train step of each, compiled on the same mesh from the same
seed and batch:
- parallelized: ``models/reference.py`` (plain Flax: ``nnx.Linear``, ``nnx.Embed``,
  its plain-Flax loss) through ``flax_tp.parallelize(..., plan=None)``;
- flax_tp: ``models/transformer.py`` (flax_tp's layers, vocab-parallel
  cross-entropy) through ``train.step.Trainer``.
Both at ``bench.run.bench_config``'s sizes (8 heads, sizes 8 divides). Reports
the collectives of each compiled step (``flax_tp.hlo``), the arrays only one of
them sends, bytes per device, compile time and the median step time (interleaved).
Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    DEVICES,
    Contender,
    bench_config,
    compile_timed,
    interleaved_medians,
)


def parse_args(argv=None) -> argparse.Namespace:
  from train.errors import OneLineParser, positive_int

  p = OneLineParser(prog="bench.plan", description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="small", choices=["tiny", "small", "llama-125m"])
  p.add_argument("--layers", type=positive_int, default=None,
                 help="blocks (default: the preset's)")
  p.add_argument("--meshes", default="1x8,2x4,4x2", help="comma-separated meshes: DxM, DxCxM or named (data=2,model=4)")
  p.add_argument("--batch-size", type=positive_int, default=32)
  p.add_argument("--seq-len", type=positive_int, default=128)
  p.add_argument("--repeats", type=positive_int, default=7, help="timed steps per contender")
  p.add_argument("--out", default=None, help="also write the JSON here")
  return p.parse_args(argv)


def _listed(sent) -> list:
  """``arrays_sent`` counts as JSON rows: [kind, "axis+axis", dtype, shape, count]."""
  return [[kind, "+".join(axes), dtype, shape, n] for (kind, axes, dtype, shape), n in sent.items()]


def _row(compiled, mesh, seconds: float) -> dict:
  from flax_tp.hlo import collectives
  found = collectives(compiled.as_text(), mesh)
  return {"collective_ops": len(found),
          "collective_arrays": sum(len(c.operands) for c in found),
          "collective_bytes": sum(c.bytes for c in found), "compile_s": seconds}


def parallelized_contender(cfg, mesh, tokens, tx):
  import jax
  import optax
  from flax import nnx

  import flax_tp
  from models.reference import ReferenceTransformer, reference_loss
  model = flax_tp.parallelize(ReferenceTransformer(cfg, rngs=nnx.Rngs(0)), mesh,
                              inputs=(tokens[:, :-1],))
  graphdef, params = nnx.split(model, nnx.Param)

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(
        lambda p: reference_loss(nnx.merge(graphdef, p), tokens))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)  # zeros_like: sharded like the params
  compiled, seconds = compile_timed(jax.jit(step, donate_argnums=(0, 1)), params, opt_state,
                                    tokens)
  return Contender("parallelized", compiled, (params, opt_state), tokens), seconds


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
  import jax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  import flax_tp
  from bench import mesh_list, meshes_or_exit, out_path_or_exit, peers
  from flax_tp.hlo import arrays_sent, collectives
  from models.transformer import Transformer
  from train.step import Trainer, make_optimizer

  specs = mesh_list(args.meshes)
  meshes_or_exit(specs, "bench.plan", context=False)
  out_path_or_exit(args.out, "bench.plan")
  cfg = bench_config(args.preset, args.layers, args.seq_len)
  tx = make_optimizer(lr=1e-3, steps=1000, warmup_steps=10)
  tokens_host = peers.tokens_for(cfg, args.batch_size, args.seq_len)
  results = {"command": "python -m bench.plan " + " ".join(
                 argv if argv is not None else sys.argv[1:]),
             "jax": jax.__version__, "config": cfg.flat(), "meshes": {}}
  for spec in specs:
    mesh = flax_tp.make_mesh(spec)
    batch = P("data" if mesh.shape["data"] > 1 else None)
    tokens = jax.device_put(tokens_host, NamedSharding(mesh, batch))
    mine, mine_s = parallelized_contender(cfg, mesh, tokens, tx)
    trainer = Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)), tx)
    params = trainer.params
    compiled, theirs_s = compile_timed(trainer.train_step, params,
                                       trainer.init_opt_state(params), tokens, None)
    hand = Contender("flax_tp", compiled, (params, trainer.init_opt_state(params)), tokens,
                     (None,))
    medians = interleaved_medians({"parallelized": mine, "flax_tp": hand}, args.repeats)
    ours, theirs = (arrays_sent(collectives(c.compiled.as_text(), mesh),
                                by_elements=(("data",),))  # (flax_tp's packed sums)
                    for c in (mine, hand))
    entry = {"parallelized": {**_row(mine.compiled, mesh, mine_s),
                              "step_s": medians["parallelized"]},
             "flax_tp": {**_row(hand.compiled, mesh, theirs_s), "step_s": medians["flax_tp"]},
             "only_parallelized": _listed(ours - theirs),
             "only_flax_tp": _listed(theirs - ours)}
    entry["ratios"] = {key: entry["parallelized"][key] / entry["flax_tp"][key]
                       for key in ("collective_bytes", "step_s", "compile_s")}
    results["meshes"][spec] = entry
    print(f"{spec}: bytes {entry['parallelized']['collective_bytes']:,} / "
          f"{entry['flax_tp']['collective_bytes']:,} = {entry['ratios']['collective_bytes']:.4f}"
          f"; step {entry['ratios']['step_s']:.2f}; only parallelized: "
          f"{entry['only_parallelized']}; only flax_tp: {entry['only_flax_tp']}", flush=True)
    del mine, hand, trainer
  text = json.dumps(results, indent=1)
  print(text)
  if args.out:
    Path(args.out).write_text(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
