"""Pipeline parallelism: the bubble measured against the analytic one, memory per stage,
and the bytes over "stage" against the minimum.

    python -m bench.pipeline                      # the whole table (about 10 CPU minutes)
    python -m bench.pipeline --layers 4 --seq 16 --batch 8 --repeats 2 --layouts 2:2:gpipe
                                                  # a smoke run

Each layout ``S:M:schedule`` is ``--preset`` with ``--layers`` layers on ``stage=S,model=2``
(``M`` microbatches), next to the same model unpipelined on one stage's devices
(``1x2``), the same global batch ``--batch x --seq``, float32:

- step: median step times, interleaved. The bubble measured is ``1 - T_1 * k / T_S``, with
  ``k = 1`` here: the 8 simulated devices share this machine's 2 cores, so a step takes
  as long as its total work, and a stage's idle iterations compute (what is thrown
  away) like busy ones; on hardware where the stages run at once, ``k = 1 / S``.
  Beside it the analytic bubble ``1 - R * M / iterations`` (``(S - 1) / (R * M + S - 1)``
  when ``M >= S``), and that with what else a pipelined step computes, the head and the loss on
  every stage and the identity layers: ``bubble_expected_here``, ``1 - W_1 / W_S`` of
  the two steps' FLOPs.
- memory: params and XLA's temporaries (activations kept for backward) per device, from
  the compiled step (``memory_analysis``), against the unpipelined step's.
- bytes: what one device sends over "stage" per step, from the compiled step's HLO (a
  collective-permute in the pipeline's scan runs once per iteration, forward and
  backward), against the minimum: each microbatch's activation once forward and its
  cotangent once backward over each of the ``R * S - 1`` stage boundaries it crosses,
  which the ``S`` devices of a stage row share.
Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL = 2  # the tensor-parallel degree of every layout
BASELINE = "1x2"  # one stage's devices
DEFAULT_LAYOUTS = ("2:1:gpipe,2:2:gpipe,2:4:gpipe,2:8:gpipe,2:2:circular,2:4:circular,"
                   "2:2:1f1b,2:4:1f1b,2:8:1f1b,4:4:gpipe,4:8:gpipe,4:4:circular,4:8:1f1b")


def layouts(text: str) -> list[tuple[int, int, str]]:
  """``"2:4:gpipe,4:4:circular"`` -> ``[(2, 4, "gpipe"), (4, 4, "circular")]``."""
  from flax_tp.pipeline import SCHEDULES
  out = []
  for part in filter(None, (p.strip() for p in text.split(","))):
    pieces = part.split(":")
    if (len(pieces) != 3 or not all(p.isdigit() and int(p) > 0 for p in pieces[:2])
        or pieces[2] not in SCHEDULES):
      raise argparse.ArgumentTypeError(
          f"bad layout {part!r}: expected STAGES:MICROBATCHES:SCHEDULE, positive integers "
          f"and one of {','.join(SCHEDULES)}, e.g. 2:4:gpipe")
    out.append((int(pieces[0]), int(pieces[1]), pieces[2]))
  if not out:
    raise argparse.ArgumentTypeError("no layout given")
  return out


def parse_args(argv=None) -> argparse.Namespace:
  from models.config import TransformerConfig
  from train.errors import OneLineParser, positive_int

  p = OneLineParser(prog="bench.pipeline", description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="small", choices=TransformerConfig.preset_names())
  p.add_argument("--layers", type=positive_int, default=8)
  p.add_argument("--seq", type=positive_int, default=128)
  p.add_argument("--batch", type=positive_int, default=16, help="global batch (sequences)")
  p.add_argument("--layouts", type=layouts, default=layouts(DEFAULT_LAYOUTS),
                 help="comma-separated STAGES:MICROBATCHES:SCHEDULE")
  p.add_argument("--repeats", type=positive_int, default=5)
  p.add_argument("--out", default=None)
  return p.parse_args(argv)


def _spec(stages: int) -> str:
  return f"stage={stages},model={MODEL}"


def _label(stages: int, microbatches: int, schedule: str) -> str:
  return f"S={stages} M={microbatches} {schedule}"


def over_stage(compiled, mesh, iterations: int, senders: int) -> dict:
  """Bytes a device sends over "stage" in one step of ``compiled``, averaged over the
  stages: the collective-permutes (each run ``iterations`` times, forward and backward;
  ``senders`` of the ``S`` stages send: GPipe's last stage has no next one), the
  all-reduces of arrays (once each), the scalars apart."""
  from flax_tp.hlo import collectives, sent_bytes
  share = senders / mesh.shape["stage"]
  out = dict(permute=0.0, all_reduce=0.0, scalars=0.0, permute_sites=0, all_reduce_sites=0)
  for c in collectives(compiled.as_text(), mesh):
    if "stage" not in c.axes:
      continue
    if c.kind == "collective-permute":
      out["permute"] += sent_bytes(c, mesh) * iterations * share
      out["permute_sites"] += 1
    elif c.kind == "all-reduce" and c.bytes > 8:
      out["all_reduce"] += sent_bytes(c, mesh)
      out["all_reduce_sites"] += 1
    elif c.kind == "all-reduce":
      out["scalars"] += sent_bytes(c, mesh)
    else:
      raise SystemExit(f"bench.pipeline: unexpected {c.kind} over {c.axes}")
  return out


def main(argv=None) -> int:
  # Before flax_tp is first imported (parse_args reads the presets): it gives the
  # simulated devices their threads.
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  args = parse_args(argv)
  import jax
  import numpy as np
  from flax import nnx

  import flax_tp
  from bench import meshes_or_exit, out_path_or_exit
  from bench.harness import flax_tp_contender, interleaved_medians
  from models.config import TransformerConfig
  from models.execution import Execution
  from train.step import make_optimizer

  meshes_or_exit([BASELINE] + sorted({_spec(s) for s, _, _ in args.layouts}), "bench.pipeline")
  out_path_or_exit(args.out, "bench.pipeline")
  for _, microbatches, _ in args.layouts:
    if args.batch % microbatches:
      print(f"bench.pipeline: error: --batch {args.batch} does not split into {microbatches} "
            "microbatches", file=sys.stderr)
      return 2
  log = lambda line: print(line, file=sys.stderr, flush=True)
  cfg = TransformerConfig.preset(args.preset, num_layers=args.layers,
                                 max_seq_len=max(args.seq, 1))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq + 1),
                                             dtype=np.int32)
  tx = make_optimizer(lr=1e-3, steps=10)
  d, v, s, b = cfg.d_model, cfg.vocab_size, args.seq, args.batch
  # Per token: the head's matmul against a block's (attention's projections and scores,
  # the MLP), forward FLOPs (backward is twice either); embedding lookups are free.
  block_flops = 2 * (4 * d * d + 2 * d * cfg.d_ff) + 4 * s * d
  head_flops = 2 * d * v
  contenders, rows = {}, []

  def memory(trainer, compiled):
    stats = compiled.memory_analysis()
    params = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(trainer.params))
    return dict(param_bytes=params, temp_bytes=stats.temp_size_in_bytes)

  trainer, contenders["baseline"], seconds = flax_tp_contender(
      cfg, flax_tp.make_mesh(BASELINE), tokens, tx, Execution(scan_layers=True))
  base = dict(label=f"unpipelined on {BASELINE}", compile_s=seconds,
              **memory(trainer, contenders["baseline"].compiled))
  log(f"{base['label']}: params {base['param_bytes'] / 2**20:.2f} MiB, temporaries "
      f"{base['temp_bytes'] / 2**20:.2f} MiB per device ({seconds:.0f} s to compile)")
  for stages, microbatches, schedule in args.layouts:
    label = _label(stages, microbatches, schedule)
    mesh = flax_tp.make_mesh(_spec(stages))
    execution = Execution(microbatches=microbatches, pipeline_schedule=schedule)
    trainer, contenders[label], seconds = flax_tp_contender(cfg, mesh, tokens, tx, execution)
    plan = trainer.model(trainer.params).pipeline
    one_f_one_b = schedule == "1f1b"
    # 1F1B's iterations each send an activation forward and a cotangent back.
    iterations = microbatches + 2 * (stages - 1) if one_f_one_b else plan.iterations(
        microbatches)
    sent = over_stage(contenders[label].compiled, mesh, iterations,
                      senders=stages - 1 if plan.repeats == 1 else stages)
    activation = (b // microbatches) * s * d * 4  # a microbatch's [b/M, s, d], float32
    # Over all S devices of a stage row: M activations and M cotangents per boundary.
    minimum = 2 * microbatches * (plan.repeats * stages - 1) * activation / stages
    # The work of a step, per token: unpipelined, every layer and one head; pipelined,
    # every stored slot (identity layers too) at each of the iterations a stage runs its
    # R groups, and the head on each of the S stages.
    # 1F1B computes only what is real (a stage with nothing to run skips it) but each
    # block's forward twice (recomputed in its backward: 4 forwards' work, not 3), and
    # the head on the last stage only.
    unpipelined = plan.layers * block_flops + head_flops
    if one_f_one_b:
      pipelined = plan.slots * block_flops * 4 / 3 + head_flops
    else:
      pipelined = (plan.slots * block_flops * iterations / (plan.repeats * microbatches)
                   + stages * head_flops)
    # 1F1B's one all-reduce over "stage" of an array: stage 0's input cotangents and
    # the last stage's gradients of what follows the blocks (final norm, head).
    state = trainer.model(trainer.params)
    tail = [state.ln_f, state.embed if cfg.tie_embeddings else state.head]
    tail_bytes = sum(x.addressable_shards[0].data.nbytes
                     for x in jax.tree.leaves(nnx.state(tail, nnx.Param)))
    rows.append(dict(
        label=label, tail_bytes=tail_bytes if one_f_one_b else 0, stages=stages, microbatches=microbatches, schedule=schedule,
        repeats=plan.repeats, identity_layers=plan.slots - plan.layers, iterations=iterations,
        bubble_analytic=plan.bubble(microbatches),
        bubble_expected_here=1 - unpipelined / pipelined,
        layers=plan.describe(microbatches), compile_s=seconds,
        **memory(trainer, contenders[label].compiled),
        sent=sent, sent_total=sent["permute"] + sent["all_reduce"] + sent["scalars"],
        minimum=minimum))
    log(f"{label}: {plan.describe(microbatches)}; params {rows[-1]['param_bytes'] / 2**20:.2f}"
        f" MiB, temporaries {rows[-1]['temp_bytes'] / 2**20:.2f} MiB per device; over stage "
        f"{rows[-1]['sent_total'] / 2**20:.2f} MiB sent per device, "
        f"{rows[-1]['sent_total'] / minimum:.2f}x the minimum ({seconds:.0f} s to compile)")
  medians = interleaved_medians(contenders, args.repeats)
  base["step_s"] = medians["baseline"]
  for row in rows:
    row["step_s"] = medians[row["label"]]
    row["bubble_measured"] = 1 - base["step_s"] / row["step_s"]
    log(f"{row['label']}: {row['step_s'] * 1e3:.1f} ms against {base['step_s'] * 1e3:.1f} ms "
        f"unpipelined: bubble measured {row['bubble_measured']:.0%}, analytic "
        f"{row['bubble_analytic']:.0%}, expected here {row['bubble_expected_here']:.0%} (with "
        "identity layers and the head on every stage)")
  results = dict(jax=jax.__version__, preset=args.preset, layers=args.layers, seq=args.seq,
                 batch=args.batch, model=MODEL, baseline=base, rows=rows)
  print(json.dumps(results, indent=1))
  if args.out:
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
