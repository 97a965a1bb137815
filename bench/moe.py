"""Mixture of experts: what the dispatch sends against its minimum, and what each device
holds of the experts against ``1 / (D * M)`` of them (BENCHMARKS.md §13), for each
dispatcher (all-gather; all-to-all with a capacity factor) and expert layout (over
"data"; over data x model, each expert whole).

For one ``flax_tp.MoE`` layer's compiled forward and backward on each mesh:
- *dispatch bytes*: what each device sends over ``"data"`` for the tokens, their routing
  and their outputs (all-gather in, reduce-scatter back, and the mirror in backward),
  counted as a ring sends it (``flax_tp.hlo.sent_bytes``: an all-gather, all-to-all or
  reduce-scatter of a result of ``n`` bytes over ``D`` devices: ``(D - 1) / D * n``,
  the same, or ``(D - 1) * n``). The minimum is each routed
  token's ``d_model`` activations to and from its expert's shard, forward and backward:
  ``4 * t * k * (D - 1) / D * d`` values for ``t`` tokens per shard, uniform routing;
- *expert bytes per device*: params of the experts on device 0, against the experts'
  logical bytes divided by ``D * M`` (above 1.00 only by padding).

    python -m bench.moe --out bench/moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

SHAPES = {  # name: (d_model, expert FFN width, experts, top-k)
    "tiny": (24, 90, 6, 2),
    "mixtral/8": (512, 1792, 8, 2),  # Mixtral 8x7B's proportions at an eighth of its width
}


# The dispatchers and layouts measured: (name, MoE options).
SETTINGS = {
    "all_gather": dict(),
    "all_to_all@1.25": dict(dispatcher="all_to_all", capacity_factor=1.25),
    "all_gather, data x model": dict(expert_axes=("data", "model")),
    "all_to_all@1.25, data x model": dict(dispatcher="all_to_all", capacity_factor=1.25,
                                          expert_axes=("data", "model")),
}


def measure(shape: str, spec: str, tokens_per_shard: int,
            setting: str = "all_gather") -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import flax_tp
  from flax_tp.hlo import collectives, sent_bytes
  d, width, experts, k = SHAPES[shape]
  mesh = flax_tp.make_mesh(spec)
  data, model = mesh.shape["data"], mesh.shape["model"]
  moe = flax_tp.MoE(d, width, experts, k, mesh=mesh, rngs=nnx.Rngs(0), **SETTINGS[setting])
  x = jax.random.normal(jax.random.key(0), (data * tokens_per_shard, d))
  # The gradient of the input too, as a step needs it (x is an activation there).
  step = jax.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2), argnums=(0, 1)))
  found = collectives(step.lower(moe, x).compile().as_text(), mesh)
  sent = sum(sent_bytes(c, mesh) for c in found if c.axes == ("data",)
             and c.kind in ("all-gather", "reduce-scatter", "all-to-all"))
  minimum = 4 * tokens_per_shard * k * (data - 1) / data * d * 4
  expert_bytes = sum(getattr(moe, n)[...].addressable_shards[0].data.nbytes
                     for n in ("gate", "up", "down"))
  logical = 3 * experts * d * width * 4
  return dict(shape=shape, mesh=spec, setting=setting, d_model=d, expert_width=width,
              experts=experts, top_k=k,
              tokens_per_shard=tokens_per_shard, dispatch_bytes=int(sent),
              dispatch_minimum=int(minimum),
              dispatch_ratio=(sent / minimum) if minimum else None,
              expert_bytes_per_device=int(expert_bytes),
              expert_share=int(logical / (data * model)),
              expert_ratio=float(expert_bytes / (logical / (data * model))),
              collectives=[dict(kind=c.kind, axes=list(c.axes), bytes=c.bytes,
                                shapes=[list(s) for _, s in c.operands]) for c in found],
              weights_gathered=any(s == tuple(np.shape(moe.gate[...])) for c in found
                                   for _, s in c.operands))


def step_times(shape: str, spec: str, tokens_per_shard: int, repeats: int) -> dict[str, Any]:
  """One MoE layer's forward + backward (params and input), timed interleaved: flax_tp's
  dropless grouped path and its capacity path against two GSPMD peers on the same params
  and shardings (experts over "data", FFN over "model", jax.jit): every expert on every
  token as one einsum, and as a loop over experts. The capacity path runs at factor
  ``E / k`` (room for every choice: nothing dropped, so the same function) and at 1.25
  (a usual training setting, which drops some). All but the last give the same input
  gradient, which is asserted."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  import flax_tp
  from bench.harness import interleaved_medians
  d, width, experts, k = SHAPES[shape]
  mesh = flax_tp.make_mesh(spec)
  moe = flax_tp.MoE(d, width, experts, k, mesh=mesh, rngs=nnx.Rngs(0))
  x = jax.device_put(jax.random.normal(jax.random.key(0),
                                       (mesh.shape["data"] * tokens_per_shard, d)),
                     NamedSharding(mesh, P("data")))
  mine = jax.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2), argnums=(0, 1)))
  capped = {f"flax_tp_{kind}capacity_{factor:g}": flax_tp.MoE(
      d, width, experts, k, mesh=mesh, capacity_factor=factor, rngs=nnx.Rngs(0),
      dispatcher="all_to_all" if kind else "all_gather")
            for kind in ("", "all_to_all_") for factor in (experts / k, 1.25)}
  logical = flax_tp.unshard(moe)
  specs = {"router": P(), "gate": P("data", None, "model"), "up": P("data", None, "model"),
           "down": P("data", "model", None)}
  params = {n: jax.device_put(logical[n][...], NamedSharding(mesh, spec))
            for n, spec in specs.items()}

  def routing(p, x):
    weights, chosen = jax.lax.top_k(jax.nn.softmax(x @ p["router"], -1), k)
    return weights / weights.sum(-1, keepdims=True), chosen

  def einsum_moe(p, x):
    weights, chosen = routing(p, x)
    combine = jnp.sum(jax.nn.one_hot(chosen, experts) * weights[..., None], 1)  # [t, E]
    hidden = (jax.nn.silu(jnp.einsum("td,edf->etf", x, p["gate"]))
              * jnp.einsum("td,edf->etf", x, p["up"]))
    return jnp.einsum("etd,te->td", jnp.einsum("etf,efd->etd", hidden, p["down"]), combine)

  def loop_moe(p, x):
    weights, chosen = routing(p, x)
    y = jnp.zeros_like(x)
    for e in range(experts):
      out = (jax.nn.silu(x @ p["gate"][e]) * (x @ p["up"][e])) @ p["down"][e]
      y = y + jnp.sum(jnp.where(chosen == e, weights, 0), -1)[:, None] * out
    return y

  peers = {name: jax.jit(jax.grad(lambda p, x, f=f: jnp.sum(f(p, x) ** 2), argnums=(0, 1)))
           for name, f in (("gspmd_einsum", einsum_moe), ("gspmd_loop", loop_moe))}
  ours = mine(moe, x)[1]
  exact = {name: (lambda peer=peer: peer(params, x)[1]) for name, peer in peers.items()}
  for full in (f"flax_tp_capacity_{experts / k:g}",
               f"flax_tp_all_to_all_capacity_{experts / k:g}"):
    exact[full] = lambda full=full: mine(capped[full], x)[1]
  for name, theirs in exact.items():  # the same function, or the timing compares nothing
    theirs = theirs()
    assert float(jnp.max(jnp.abs(ours - theirs))) <= 1e-4 * float(jnp.max(jnp.abs(theirs))), name
  steps = {"flax_tp": lambda: jax.block_until_ready(mine(moe, x))}
  steps.update({name: (lambda m=m: jax.block_until_ready(mine(m, x)))
                for name, m in capped.items()})
  steps.update({name: (lambda peer=peer: jax.block_until_ready(peer(params, x)))
                for name, peer in peers.items()})
  medians = interleaved_medians(steps, repeats)
  return dict(shape=shape, mesh=spec, tokens_per_shard=tokens_per_shard,
              step_s=medians, ratios={n: medians["flax_tp"] / v for n, v in medians.items()})


DEEPSEEK_V3_LAYER = dict(d=7168, width=2048, experts=256, k=8, data=64, tokens=4096)


def deepseek_v3_layer() -> list[dict[str, Any]]:
  """DeepSeek-V3's MoE layer (d_model 7168, top-8 of 256 experts of FFN 2048) on 64 data
  shards of 4096 tokens, each dispatcher's compiled forward and backward from abstract
  shapes (nothing allocated): the bytes each device sends over "data", counted from the
  HLO as ``measure`` counts them. Needs 64 devices: ``main`` runs it in a process of its
  own (``--deepseek-v3-layer``)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec

  import flax_tp
  from flax_tp.hlo import collectives, sent_bytes
  c = DEEPSEEK_V3_LAYER
  mesh = flax_tp.make_mesh(f"{c['data']}x1")
  rows = []
  for setting in ("all_gather", "all_to_all@1.25"):
    abstract = nnx.eval_shape(lambda options=SETTINGS[setting]: flax_tp.MoE(
        c["d"], c["width"], c["experts"], c["k"], mesh=mesh, rngs=nnx.Rngs(0), **options))
    graphdef, state = nnx.split(abstract)
    state = jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), state,
        nnx.get_partition_spec(state))
    x = jax.ShapeDtypeStruct((c["data"] * c["tokens"], c["d"]), jnp.float32,
                             sharding=NamedSharding(mesh, PartitionSpec("data")))

    def loss(state, x, graphdef=graphdef):
      return jnp.sum(nnx.merge(graphdef, state)(x)[0] ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile().as_text()
    found = collectives(hlo, mesh)
    rows.append(dict(setting=setting, dispatch_bytes=int(sum(
        sent_bytes(f, mesh) for f in found if f.axes == ("data",)
        and f.kind in ("all-gather", "reduce-scatter", "all-to-all"))),
        collectives=[dict(kind=f.kind, bytes=f.bytes) for f in found]))
  return rows


def analytic(d: int, experts: int, k: int, data: int, tokens_per_shard: int,
             factor: float) -> dict[str, Any]:
  """One MoE layer's dispatch bytes per device (forward and backward, float32 tokens, the
  routing left out), by the formulas the measured rows check at 8 devices: the
  all-gather's ``2 (D - 1) t d`` gathered and ``2 (D - 1) t d`` scattered values (outputs
  forward, cotangents backward), the all-to-all's four ``(D - 1) / D * E * C * d`` buffers
  (``C`` per expert and source shard), and the minimum ``4 t k (D - 1) / D * d``."""
  import math
  t = tokens_per_shard
  capacity = max(1, min(t, math.ceil(factor * t * k / experts)))
  e_local = -(-experts // data)
  all_gather = 4 * (data - 1) * t * d * 4
  all_to_all = 4 * (data - 1) / data * data * e_local * capacity * d * 4
  minimum = 4 * t * k * (data - 1) / data * d * 4
  return dict(d_model=d, experts=experts, top_k=k, data=data, tokens_per_shard=t,
              capacity_factor=factor, capacity=capacity, all_gather_bytes=all_gather,
              all_to_all_bytes=all_to_all, minimum_bytes=minimum,
              all_gather_ratio=all_gather / minimum, all_to_all_ratio=all_to_all / minimum)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n")[0])
  p.add_argument("--meshes", default="2x4,4x2,8x1",
                 help="comma-separated meshes: DxM, DxCxM or named (data=2,model=4)")
  p.add_argument("--tokens", type=int, default=512, help="tokens per data shard")
  p.add_argument("--time-tokens", type=int, default=128,
                 help="tokens per data shard in the timed section (0: skip it)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default=None)
  p.add_argument("--deepseek-v3-layer", action="store_true",
                 help="only DeepSeek-V3's layer compiled on 64 devices (prints its JSON)")
  args = p.parse_args(argv)
  if args.deepseek_v3_layer:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=64"
    print(json.dumps(deepseek_v3_layer()))
    return 0
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax

  from bench import mesh_list, meshes_or_exit, out_path_or_exit
  meshes = mesh_list(args.meshes)
  meshes_or_exit(meshes, "bench.moe", context=False)
  out_path_or_exit(args.out, "bench.moe")
  rows = []
  for shape, spec, setting in ((sh, sp, se) for sh in SHAPES for sp in meshes
                               for se in SETTINGS):
    row = measure(shape, spec, args.tokens, setting)
    rows.append(row)
    print(f"{shape} {spec} {setting}: dispatch {row['dispatch_bytes']:,} B / minimum "
          f"{row['dispatch_minimum']:,} B = {row['dispatch_ratio']:.2f} | experts per device "
          f"{row['expert_bytes_per_device']:,} B / (1 / (D*M)) {row['expert_share']:,} B = "
          f"{row['expert_ratio']:.3f} | an expert weight gathered: {row['weights_gathered']}",
          flush=True)
  # DeepSeek-V3's MoE layer (d_model 7168, top-8 of 256) at 64 data shards of 4096 tokens:
  # by the formulas the rows above check, and compiled from abstract shapes on 64
  # simulated devices (a process of its own: this one has 8)
  c = DEEPSEEK_V3_LAYER
  deepseek = analytic(c["d"], c["experts"], c["k"], c["data"], c["tokens"], 1.25)
  done = subprocess.run([sys.executable, "-m", "bench.moe", "--deepseek-v3-layer"],
                        capture_output=True, text=True, check=True,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        env={**os.environ, "XLA_FLAGS": ""})
  deepseek["compiled"] = json.loads(done.stdout.strip().splitlines()[-1])
  gib = lambda key: deepseek[key] / 2**30
  measured = {r["setting"]: r["dispatch_bytes"] / 2**30 for r in deepseek["compiled"]}
  print(f"deepseek-v3 layer, 64 data shards: all-gather {gib('all_gather_bytes'):.2f} GiB "
        f"({deepseek['all_gather_ratio']:.2f} x minimum; compiled {measured['all_gather']:.2f}), "
        f"all-to-all at 1.25 {gib('all_to_all_bytes'):.2f} GiB "
        f"({deepseek['all_to_all_ratio']:.2f} x; compiled {measured['all_to_all@1.25']:.2f}), "
        f"minimum {gib('minimum_bytes'):.2f} GiB", flush=True)
  times = []
  # (GSPMD refuses the tiny shape's FFN of 90 over 4 or 2: its peers run the even one only)
  for shape in ("mixtral/8",) if args.time_tokens else ():
    for spec in (m for m in meshes if m != "8x1"):
      row = step_times(shape, spec, args.time_tokens, args.repeats)
      times.append(row)
      print(f"{shape} {spec}: step " + ", ".join(
          f"{n} {v * 1e3:.1f} ms" for n, v in row["step_s"].items()) + " | flax_tp / peer " +
          ", ".join(f"{n} {v:.2f}" for n, v in row["ratios"].items() if n != "flax_tp"),
          flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"jax": jax.__version__, "command": "python -m bench.moe " + " ".join(
          argv if argv is not None else sys.argv[1:]), "rows": rows, "step_times": times,
                 "deepseek_v3_layer": deepseek},
                f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
