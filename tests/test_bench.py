"""The benchmark script runs end to end (tiny preset, one repeat): a smoke test, no timings."""

import json

import pytest

from bench.run import main, megatron_minimum
from models.config import TransformerConfig

# Processes spawned / the benchmarks run: the slow lane (.ci/run runs it second).
pytestmark = pytest.mark.slow


def test_bench_smoke(tmp_path):
  out = tmp_path / "new" / "results.json"  # the folder is made before the run
  # One mesh keeps it short; the Dx1 data-parallel peer is the same code path.
  assert main(["--preset", "tiny", "--repeats", "1", "--meshes", "2x4", "--batch-size", "8",
               "--seq-len", "16", "--skip", "hostmem,scaling", "--out", str(out)]) == 0
  results = json.loads(out.read_text())
  audit = results["meshes"]["2x4"]["audit"]
  # The audit is exact: Megatron's minimum, nothing more (clipping's scalars aside).
  assert audit["count_ratio"] == 1.0 and audit["bytes_ratio"] == 1.0, audit
  assert results["meshes"]["2x4"]["gspmd"]["step_s"] > 0
  assert results["meshes"]["2x4"]["gspmd_fused"]["step_s"] > 0
  assert results["meshes"]["2x4"]["gpt"]["step_s"] > 0
  assert results["overhead"]["step"]["ratio"] > 0
  assert abs(results["memory"]["2x4"]["ratio"] - 1.0) < 1e-9
  try:
    import matplotlib  # noqa: F401  (the bench extra)
  except ImportError:
    return
  for name in ("step_time.png", "collective_bytes.png"):  # drawn beside --out
    assert (out.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_minimum_formula():
  cfg = TransformerConfig.tiny()
  # 2 blocks: (4 * 2 + 2) activations of [4, 16, 24] float32 and 3 [4, 16] reductions in
  # 2 collectives (the loss's max; its two sums packed).
  minimum = megatron_minimum(cfg, data=2, model=4, batch=8, seq=16, local_param_bytes=100)
  assert minimum == {"count": 4 * 2 + 2 + 2 + 1,
                     "bytes": 10 * 4 * 16 * 24 * 4 + 3 * 4 * 16 * 4 + 100 + 4}
  assert megatron_minimum(cfg, 1, 1, 8, 16, 100) == {"count": 0, "bytes": 0}


def test_decode_bench_smoke(tmp_path):
  from bench.decode import main as decode_main
  out = tmp_path / "decode.json"
  assert decode_main(["--preset", "llama-tiny", "--meshes", "1x2", "--cache-meshes", "1x2,1x4",
                      "--contexts", "8", "--new-tokens", "3", "--repeats", "1",
                      "--out", str(out)]) == 0
  results = json.loads(out.read_text())
  row = results["timed"]["1x2"][0]
  assert row["context"] == 8 and row["cached_tokens_s"] > 0 and row["recompute_tokens_s"] > 0
  # 6 query / 2 kv heads: over 2 devices each holds its own kv head; over 4 every device
  # holds two slots (kv heads 0, 0-1, 1, 1), four times an even split's half head.
  assert results["cache"]["1x2"]["ratio_to_even_split"] == 1.0
  assert results["cache"]["1x4"]["ratio_to_even_split"] == 4.0


def test_memory_bench_smoke(tmp_path):
  from bench.memory import main as memory_main
  out = tmp_path / "memory.json"
  assert memory_main(["--sections", "memory", "--preset", "llama-tiny", "--seqs", "64",
                      "--mesh", "1x2", "--options", "plain,sp,sp+remat",
                      "--out", str(out)]) == 0
  results = json.loads(out.read_text())
  assert [r["options"] for r in results["memory"]] == ["plain", "sp", "sp+remat"]
  temp = {r["options"]: r["temp_bytes"] for r in results["memory"]}
  # Each option lowers XLA's figure; recomputation does so unrolled too (BENCHMARKS §10).
  assert temp["plain"] > temp["sp"] > 0
  assert temp["sp+remat"] < 0.75 * temp["sp"]  # jax.checkpoint alone gave ~0.96 here


def test_fused_qkv_peer_is_the_reference_model():
  """bench/peers.py's fused-projection GPT (GSPMD's second peer) computes the reference
  model's function from the same weights, grouped-query heads and biases included."""
  import jax
  import numpy as np
  from flax import nnx

  from bench.peers import fused_qkv_reference
  from models.reference import ReferenceTransformer, reference_loss
  cfg = TransformerConfig.preset("llama-tiny", qkv_bias=True)
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
  fused = fused_qkv_reference(cfg, nnx.Rngs(0))
  assert fused.blocks[0].attn.qkv.kernel[...].shape == (cfg.d_model, (6 + 2 * 2) * 4)
  loss = nnx.jit(reference_loss)
  np.testing.assert_allclose(loss(fused, tokens),
                             loss(ReferenceTransformer(cfg, rngs=nnx.Rngs(0)), tokens),
                             rtol=1e-6)


def test_gspmd_peers_shard_every_matrix_but_the_norms():
  """The GSPMD peers split every projection (SwiGLU's gate included) and the embedding,
  as flax_tp does: a replicated matrix would make the peer do more work than it should."""
  from flax import nnx

  from bench.peers import fused_qkv_reference, megatron_spec
  from models.reference import ReferenceTransformer
  cfg = TransformerConfig.preset("llama-tiny", qkv_bias=True, mlp_bias=True,
                                 tie_embeddings=False)
  for model in (ReferenceTransformer(cfg, rngs=nnx.Rngs(0)),
                fused_qkv_reference(cfg, nnx.Rngs(0))):
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      spec = megatron_spec(path, var[...].ndim)
      replicated = all(name is None for name in spec)
      is_norm_or_row_bias = path[-2] in ("ln1", "ln2", "ln_f") or path[-2:] in (
          ("o", "bias"), ("down", "bias"))
      assert replicated == is_norm_or_row_bias, (path, spec)


def test_gpt_peer_shards_as_megatron_and_learns(meshes):
  """The independent docs-style GPT (bench/peers.py ``gpt``): its fused q/k/v, MLP input
  and embedding split over "model", its output projections over their inputs, norms and
  row biases whole; on an Auto-axes mesh its jitted AdamW step lowers the loss."""
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from bench.peers import GPTPeer, tokens_for
  from train.step import make_optimizer
  cfg = TransformerConfig.preset("small", num_layers=2, num_heads=8, head_dim=16)
  peer = GPTPeer(cfg, make_optimizer(lr=1e-2, steps=10, grad_clip=0.0), meshes["2x4"])
  from flax import nnx
  specs = {"/".join(map(str, path)): var[...].sharding.spec
           for path, var in nnx.to_flat_state(peer.params)}
  assert specs["blocks/0/qkv/kernel"] == P(None, "model")
  assert specs["blocks/0/o/kernel"] == P("model", None)
  assert specs["blocks/1/up/bias"] == P("model")
  assert specs["embed/embedding"] == P("model", None)
  assert all(name is None for name in specs["blocks/0/ln1/scale"])
  assert peer.params["blocks"][0]["qkv"]["kernel"][...].shape == (128, 8 * 3 * 16)
  tokens = jax.device_put(tokens_for(cfg, 8, 16), peer.batch_sharding)
  params, opt_state = peer.state()
  losses = []
  for _ in range(4):
    params, opt_state, loss = peer.step(params, opt_state, tokens)
    losses.append(float(loss))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_plan_bench_smoke(tmp_path):
  from bench.plan import main as plan_main
  out = tmp_path / "plan.json"
  assert plan_main(["--preset", "tiny", "--meshes", "2x4", "--repeats", "1", "--batch-size", "8",
                    "--seq-len", "16", "--out", str(out)]) == 0
  entry = json.loads(out.read_text())["meshes"]["2x4"]
  # The parallelized plain model sends what the hand-written one does, plus the plain
  # loss's one [b, s] sum over the vocabulary (4 rows of 16 per data replica); and the
  # sum of exps and the target logit apart, which flax_tp's loss packs in one [2, b, s].
  assert entry["only_parallelized"] == [["all-reduce", "model", "f32", [4, 16], 3]]
  assert entry["only_flax_tp"] == [["all-reduce", "model", "f32", [2, 4, 16], 1]]
  assert entry["parallelized"]["step_s"] > 0 and entry["flax_tp"]["step_s"] > 0


def test_families_bench_smoke(tmp_path):
  """2 kv heads copied over 4 and 8 devices: exactly Megatron's minimum plus the
  kv-gradient sum (BENCHMARKS §8: per block the k and v kernels, each plus one padding
  slot), nothing else."""
  from bench.families import main as families_main
  from models.config import TransformerConfig
  out = tmp_path / "families.json"
  assert families_main(["--presets", "llama-tiny", "--meshes", "2x4,1x8", "--seq", "16",
                        "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["mesh"] for r in rows] == ["2x4", "1x8"]
  cfg = TransformerConfig.preset("llama-tiny")
  for row in rows:
    assert row["params"] > 0 and row["param_and_adam_bytes"] > 0 and row["temp_bytes"] > 0
    assert not row["other_collectives"]
    # 2 kv heads over 4 or 8 devices are copied: each block adds its k and v sums
    excess = row["collectives_measured"]["bytes"] - row["collectives_minimum"]["bytes"]
    assert excess == cfg.num_layers * 2 * cfg.d_model * (cfg.kv_heads * cfg.head_dim + 1) * 4


@pytest.mark.parametrize("module", ["run", "plan", "decode", "memory", "mfu", "families"])
def test_bench_refuses_an_unwritable_out_before_running(module, tmp_path, capsys):
  import importlib
  bench_main = importlib.import_module(f"bench.{module}").main
  with pytest.raises(SystemExit) as exit_info:
    bench_main(["--out", str(tmp_path)])  # a folder: no results could be written there
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "cannot write --out" in err[0] and "folder" in err[0], err


def test_mfu_bench_smoke(tmp_path):
  from bench.mfu import main as mfu_main, model_flops, param_count
  out = tmp_path / "mfu.json"
  assert mfu_main(["--presets", "llama-tiny", "--points", "2x8", "--remat", "block",
                   "--loss-chunks", "2", "--repeats", "1", "--peak-tflops", "1",
                   "--out", str(out)]) == 0
  results = json.loads(out.read_text())
  assert results["versions"]["jax"] and results["peak_tflops"] == 1.0
  (row,) = results["points"]
  cfg = TransformerConfig.preset("llama-tiny")  # tied: the table is the head's matmul
  assert cfg.tie_embeddings and row["params"] == param_count(cfg)
  # 2 x 8 tokens x (6 N + 12 x 2 layers x 8 positions x 6 heads x 4 dims)
  assert row["model_flops"] == 2 * 8 * (6 * row["params"] + 12 * 2 * 8 * 6 * 4)
  # Untied, the 259 x 24 input embedding is a lookup, not a matmul: left out of N.
  untied = TransformerConfig.preset("llama-tiny", tie_embeddings=False)
  assert param_count(untied) == row["params"] + 259 * 24
  assert model_flops(untied, param_count(untied), 2, 8) == row["model_flops"]
  # the independent peer (bench/peer_llama.py) with XLA's attention, off a TPU
  for name in ("flax_tp", "flax_tp remat=block", "flax_tp loss_chunks=2",
               "flax_tp remat=block loss_chunks=2", "plain Flax", "peer xla"):
    step = row[name]["step_s"]
    assert step > 0 and row[name]["mfu"] == pytest.approx(row["model_flops"] / step / 1e12)
  assert row["flax_tp / plain Flax"] == pytest.approx(
      row["flax_tp"]["step_s"] / row["plain Flax"]["step_s"])
  assert row["flax_tp / best peer"] == pytest.approx(
      row["flax_tp"]["step_s"] / row["peer xla"]["step_s"])


@pytest.mark.parametrize("argv", [["--points", "16x"], ["--points", "0x8"], ["--repeats", "0"],
                                  ["--peak-tflops", "-1"], ["--presets", "llama-1b"],
                                  ["--remat", "block,sometimes"], ["--attention", "flash"],
                                  ["--peers", "splash,flash"], ["--loss-chunks", "1"]])
def test_mfu_bench_refuses_bad_values(argv, capsys):
  from bench.mfu import main as mfu_main
  try:
    code = mfu_main(argv)
  except SystemExit as exit_info:
    code = exit_info.code
  assert code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("bench.mfu: error: "), err


def test_mfu_bench_times_alone_what_does_not_fit_together(monkeypatch):
  """A TPU v5e ran out of memory timing the ~125M preset's contenders together (each
  holds its state; a program's scratch is reserved at each call): they are then timed
  one at a time, and one that does not fit even alone is recorded as out of memory."""
  import bench.mfu
  real_medians = bench.mfu.interleaved_medians

  def medians_of_one_at_a_time(steps, repeats):
    if len(steps) > 1:
      raise ValueError("RESOURCE_EXHAUSTED: Attempting to reserve 13.44G")
    return real_medians(steps, repeats)

  def peer_out_of_memory(peer, tokens):
    raise ValueError("RESOURCE_EXHAUSTED: Error loading program 'jit_step'")

  monkeypatch.setattr(bench.mfu, "interleaved_medians", medians_of_one_at_a_time)
  monkeypatch.setattr(bench.mfu, "peer_contender", peer_out_of_memory)
  import flax_tp
  from train.step import make_optimizer
  row = bench.mfu.measure_point(TransformerConfig.preset("llama-tiny"), 2, 8, ["block"],
                                flax_tp.make_mesh("1x1"), make_optimizer(lr=1e-3, steps=10), 1, 1.0)
  assert row["timing"] == "one at a time (the contenders do not fit in memory together)"
  assert row["plain Flax"] == "out of memory"
  for name in ("flax_tp", "flax_tp remat=block"):
    assert row[name]["step_s"] > 0
  assert "flax_tp / plain Flax" not in row


def test_mfu_bench_keeps_the_points_measured_before_an_interrupt(tmp_path, monkeypatch, capsys):
  """Each point is written as soon as it is measured: Ctrl-C (or a lent GPU's time
  limit) loses only the point in progress."""
  import bench.mfu
  calls = []

  def measure_point(cfg, batch, seq, *rest, **options):
    calls.append((batch, seq))
    if len(calls) == 2:
      raise KeyboardInterrupt
    return {"batch": batch, "seq": seq, "flax_tp": {"step_s": 1.0, "mfu": 0.5}}

  monkeypatch.setattr(bench.mfu, "measure_point", measure_point)
  out = tmp_path / "mfu.json"
  assert bench.mfu.main(["--presets", "llama-tiny", "--points", "2x8,4x8,8x8",
                         "--peak-tflops", "1", "--out", str(out)]) == 130
  assert calls == [(2, 8), (4, 8)]
  points = json.loads(out.read_text())["points"]
  assert points == [{"preset": "llama-tiny", "batch": 2, "seq": 8,
                     "flax_tp": {"step_s": 1.0, "mfu": 0.5}}]
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == f"bench.mfu: interrupted after 1 of 3 points; they are in {out}"
  assert not (tmp_path / "mfu.json.tmp").exists()


def test_step_bytes_reports_xlas_accounting_of_each_step(tmp_path):
  """bench.step_bytes: XLA's FLOPs, bytes and temporaries of flax_tp's step (and with the
  head by pieces) and the peer's, and their largest results outside fusion bodies."""
  from bench.step_bytes import largest_results, main as bytes_main
  out = tmp_path / "bytes.json"
  assert bytes_main(["--preset", "llama-tiny", "--point", "2x16", "--attention", "xla",
                     "--execution", "loss_chunks=2", "--peers", "xla", "--top", "5",
                     "--hlo-dir", str(tmp_path / "hlo"), "--out", str(out)]) == 0
  programs = json.loads(out.read_text())["programs"]
  assert set(programs) == {"flax_tp attention=xla", "flax_tp attention=xla loss_chunks=2",
                           "peer xla"}
  for figures in programs.values():
    assert figures["tflop"] >= 0 and figures["temp_gb"] >= 0 and len(figures["largest"]) == 5
  assert len(list((tmp_path / "hlo").glob("*.hlo.txt"))) == 3
  # a fusion's body is not counted; the fusion's own result is
  hlo = """HloModule m
%fused_computation (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %m = f32[4,8]{1,0} multiply(%p, %p)
}
ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %f = f32[4,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_computation
  ROOT %c = bf16[4,8]{1,0} convert(%f)
}
"""
  assert largest_results(hlo) == [
      {"result": "f32[4,8]", "op": "fusion", "count": 1, "gb": 0.0},
      {"result": "bf16[4,8]", "op": "convert", "count": 1, "gb": 0.0}]


def test_profile_names_the_compiled_programs_ops():
  """bench/step_profile.py reads the compiled HLO (dots, fusions, collectives) and times those
  very ops in a jax.profiler trace of the program."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from bench.step_profile import dot_shapes, hlo_kinds, profile_contender
  mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])

  def step(x, w):
    y = jnp.tanh(x @ w)
    return jax.lax.psum(jnp.sum(y * y), "model")

  mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(None, "model")),
                                 out_specs=P()))
  x = jnp.ones((4, 5))
  w = jax.device_put(jnp.ones((5, 6)), jax.sharding.NamedSharding(mesh, P(None, "model")))
  compiled = mapped.lower(x, w).compile()
  hlo = compiled.as_text()
  assert dot_shapes(hlo) == ["f32[4,3]"]  # each device's half of the output
  kinds = hlo_kinds(hlo)
  assert list(kinds.values()).count("all-reduce") == 1
  assert all(name in hlo for name in kinds)

  class Step:
    def __init__(self):
      self.compiled = compiled

    def __call__(self):
      jax.block_until_ready(compiled(x, w))

  figures = profile_contender(Step(), devices=2, steps=2)
  assert figures["collectives"] == {"all-reduce": 1}
  assert figures["dots"] == ["f32[4,3]"]
  assert figures["rendezvous_per_device"] >= 1  # the all-reduce met its peer
  assert figures["fusion_thread_ms_per_device"] > 0


def test_moe_bench_smoke(tmp_path):
  """bench.moe end to end on one mesh: the dispatch at its minimum (2 data shards, top-2),
  the experts at 1/(D*M) per device, and the timed section (its peers and the capacity
  path at E/k asserted equal inside it) with every path timed."""
  from bench.moe import main as moe_main
  out = tmp_path / "moe.json"
  assert moe_main(["--meshes", "2x4", "--tokens", "64", "--time-tokens", "8", "--repeats", "1",
                   "--out", str(out)]) == 0
  results = json.loads(out.read_text())
  mixtral = {r["setting"]: r for r in results["rows"] if r["shape"] == "mixtral/8"}
  assert round(mixtral["all_gather"]["dispatch_ratio"], 2) == 1.0
  assert mixtral["all_gather"]["expert_ratio"] == 1.0
  # the all-to-all's buffers: F = 1.25 times the minimum (64 tokens: no rounding)
  assert mixtral["all_to_all@1.25"]["dispatch_ratio"] == 1.25
  assert not any(r["weights_gathered"] for r in results["rows"])
  deepseek = results["deepseek_v3_layer"]
  assert deepseek["all_gather_ratio"] == 64 / 8 and deepseek["all_to_all_ratio"] == 1.25
  # compiled on 64 devices from abstract shapes: the all-to-all's buffers exactly as the
  # formula; the all-gather's tokens as the formula plus the routing (k ids and weights)
  compiled = {r["setting"]: r["dispatch_bytes"] for r in deepseek["compiled"]}
  assert compiled["all_to_all@1.25"] == deepseek["all_to_all_bytes"]
  routing = 4 * 63 * 4096 * 8 * 4  # ids and weights, gathered and their cotangents scattered
  assert deepseek["all_gather_bytes"] < compiled["all_gather"] <= (
      deepseek["all_gather_bytes"] + routing)
  (timed,) = results["step_times"]
  assert set(timed["step_s"]) == {"flax_tp", "flax_tp_capacity_4", "flax_tp_capacity_1.25",
                                  "flax_tp_all_to_all_capacity_4",
                                  "flax_tp_all_to_all_capacity_1.25", "gspmd_einsum",
                                  "gspmd_loop"}
  assert all(v > 0 for v in timed["step_s"].values())


def test_lora_bench_smoke(tmp_path):
  """bench.lora end to end on the tiny preset: full fine-tuning holds four times its
  params; LoRA its params (base and adapters) and three times its adapters; PEFT's
  default (rank 8 on q, v) less than full fine-tuning even at this width."""
  from bench.lora import SETTINGS, main as lora_main
  out = tmp_path / "lora.json"
  assert lora_main(["--presets", "llama-tiny", "--meshes", "2x4", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["mesh"], r["fsdp"]) for r in rows] == [("2x4", False), ("2x4", True)]
  for row in rows:
    full = row["full_fine_tune"]
    assert full["total"] == 4 * full["params"]
    for name in SETTINGS:
      lora = row[name]
      assert lora["total"] == lora["params"] + 3 * lora["adapters"]
      assert lora["params"] > full["params"] and lora["adapters"] > 0
    assert row["peft-default r8 q,v"]["total"] < full["total"]


@pytest.mark.parametrize("text,specs", [
    ("1x8,2x4", ["1x8", "2x4"]),
    ("2x2x2, 1x8x1", ["2x2x2", "1x8x1"]),
    ("data=2,context=2,model=2,1x8", ["data=2,context=2,model=2", "1x8"]),
    ("1x8,model=8", ["1x8", "model=8"]),
    ("data=2,model=4,data=4,model=2", ["data=2,model=4", "data=4,model=2"]),
    ("data=2,model=4;2x4", ["data=2,model=4", "2x4"]),
])
def test_mesh_lists_take_every_mesh_form(text, specs):
  from bench import mesh_list
  assert mesh_list(text) == specs
  import flax_tp
  for spec in specs:
    flax_tp.make_mesh(spec)


def test_a_two_axis_benchmark_names_a_context_mesh(capsys):
  from bench import meshes_or_exit
  meshes_or_exit(["1x2x4"], "bench.x")  # the default: context parallelism measured
  with pytest.raises(SystemExit) as e:
    meshes_or_exit(["2x4", "data=1,context=2,model=4"], "bench.x", context=False)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "'data=1,context=2,model=4' has a context axis" in err


@pytest.mark.slow
def test_context_bench_counts_each_strategys_bytes_against_the_minimum(tmp_path):
  """bench.context's bytes section: the all-gather moves the minimum over "context"
  (every other device's k/v forward, their gradients back: 2 (C - 1) blocks), the ring
  (C - 1) + (C - 1) + C blocks, one fewer at C = 2 (the two rings' swaps are one)."""
  from bench.context import main as context_main
  out = tmp_path / "context.json"
  assert context_main(["--sections", "bytes", "--preset", "llama-tiny", "--bytes-seq", "40",
                       "--out", str(out)]) == 0
  rows = {(r["mesh"], r["strategy"]): r for r in json.loads(out.read_text())["bytes"]}
  assert set(rows) == {("1x2x4", "all_gather"), ("1x2x4", "ring"), ("1x8x1", "all_gather"),
                       ("1x8x1", "ring")}
  for (mesh, strategy), row in rows.items():
    c = 2 if mesh == "1x2x4" else 8
    blocks = 2 * (c - 1) if strategy == "all_gather" else 3 * c - 2 - (c == 2)
    assert row["per_layer_total"] == pytest.approx(blocks * row["block_bytes"]), (mesh, strategy)
    assert row["minimum"] == 2 * (c - 1) * row["block_bytes"]


@pytest.mark.slow
def test_pipeline_bench_counts_the_bytes_over_stage_and_the_bubble(tmp_path):
  """bench.pipeline: over "stage" a device sends, per step, one microbatch activation per
  iteration forward and one cotangent back (GPipe's and 1F1B's last stage none; 1F1B's
  M + 2(S - 1) iterations), and two all-reduces of the whole [b, s, d] (1F1B: one, with
  the head's and final norm's gradients); the analytic bubble is (S - 1) / (R * M + S -
  1) (M >= S); 1F1B keeps less for backward than GPipe at M = 4."""
  from bench.pipeline import main as pipeline_main
  out = tmp_path / "pipeline.json"
  assert pipeline_main(["--layers", "4", "--seq", "8", "--batch", "8", "--repeats", "1",
                        "--layouts", "2:4:gpipe,2:4:circular,2:4:1f1b",
                        "--out", str(out)]) == 0
  results = json.loads(out.read_text())
  d = 128  # the small preset's d_model
  for row in results["rows"]:
    s, m, r = row["stages"], row["microbatches"], row["repeats"]
    activation = (8 // m) * 8 * d * 4
    senders = s - 1 if row["schedule"] != "circular" else s
    assert row["sent"]["permute"] == pytest.approx(
        2 * row["iterations"] * activation * senders / s)
    if row["schedule"] == "1f1b":
      assert row["iterations"] == m + 2 * (s - 1)
      assert row["tail_bytes"] == 256 // 2 * d * 4 + 2 * d * 4  # head shard, LayerNorm
      assert row["sent"]["all_reduce"] == pytest.approx(  # (scalars may join it)
          2 * (s - 1) / s * (m * activation + row["tail_bytes"]), abs=16)
    else:
      assert row["sent"]["all_reduce"] == pytest.approx(2 * 2 * (s - 1) / s * m * activation)
    assert row["minimum"] == pytest.approx(2 * m * (r * s - 1) * activation / s)
    assert row["bubble_analytic"] == pytest.approx((s - 1) / (r * m + s - 1))
    assert row["step_s"] > 0 and row["param_bytes"] < results["baseline"]["param_bytes"]
  temps = {row["schedule"]: row["temp_bytes"] for row in results["rows"]}
  assert temps["1f1b"] < temps["gpipe"]


def test_ab_checkouts_times_two_checkouts_in_one_process(tmp_path):
  """bench/ab_checkouts.py imports each checkout's packages afresh into one process and
  times their steps in turns (here this checkout against itself, and a path that is not a
  checkout refused by name). A subprocess: the module swap must not touch this worker."""
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  small = ["--layers", "1", "--d", "16", "--heads", "2", "--mlp", "32", "--vocab", "33",
           "--seq", "8", "--batch", "4", "--repeats", "2", "--meshes", "2x2"]
  run = subprocess.run([sys.executable, "-m", "bench.ab_checkouts", "--roots", f"{root},{root}",
                        *small], cwd=root, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  [line] = run.stdout.splitlines()
  assert line.startswith("2x2 ") and line.count(f"{root}: ") == 2 and "(1.000)" in line
  bad = subprocess.run([sys.executable, "-m", "bench.ab_checkouts", "--roots", str(tmp_path)],
                       cwd=root, capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and "is not a flax_tp checkout" in bad.stderr


def test_device_profile_reads_the_devices_ops_from_a_trace(capsys):
  """``bench.device_profile``'s reading of a jax.profiler trace: the device's process only
  (not the host's), time per step on each of its threads and per op; ops named back to
  their HLO result and jax source. On a CPU it refuses in one line (it reads an
  accelerator's trace)."""
  from bench.device_profile import device_times, main as profile_main, op_sources
  meta = lambda pid, name, tid=None: {"ph": "M", "pid": pid, "tid": tid, "args": {"name": name},
                                      "name": "thread_name" if tid is not None
                                      else "process_name"}
  op = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur}
  events = [meta(1, "/device:TPU:0"), meta(1, "XLA Ops", 7), meta(1, "XLA Modules", 8),
            meta(2, "/host:CPU"), meta(2, "XLA Ops", 7),
            op(1, 7, "fusion.3", 300), op(1, 7, "fusion.3", 500), op(1, 7, "custom-call.1", 1000),
            op(1, 8, "jit_step", 2000), op(2, 7, "fusion.3", 9000)]
  times = device_times(events, "TPU:0", steps=2)
  assert times["threads_ms"] == {"XLA Ops": 0.9, "XLA Modules": 1.0}
  assert times["ops"] == {"fusion.3": (1.0, 0.4), "custom-call.1": (0.5, 0.5)}
  with pytest.raises(ValueError, match="GPU:0"):
    device_times(events, "GPU:0", steps=1)
  hlo = ('  %fusion.3 = bf16[8,1024,768]{2,1,0} fusion(%p), kind=kLoop, calls=%f, '
         'metadata={op_name="jit(step)/jvp()/dot_general" stack_frame_id=1}')
  assert op_sources(hlo) == {"fusion.3": ("bf16[8,1024,768]{2,1,0}", "jit(step)/jvp()/dot_general")}
  with pytest.raises(SystemExit) as exit_info:
    profile_main(["--point", "2x16"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "device is 'cpu'" in err, err
