"""The HF families beyond Llama 2 / Qwen2 (models/families.py) against transformers itself.

Fixtures written by transformers (tests/fixtures/hf/make_fixtures.py): Llama 3.1-style
rope, Qwen3, Mistral, Gemma, Gemma 2, Gemma 3, Phi-3, OLMo 2 and OLMo 3, every norm weight and bias
perturbed, sliding windows shorter than the sequence. Each family on one uneven mesh
(two families on every mesh, in the slow lane): logits, the loss and every gradient,
and greedy generation through the KV cache past the window equal transformers'. Each
mechanism that meets a split (windows, sinks, latent attention, split norms, experts)
again on a second mesh, under the execution options, and on context meshes with both
context-parallel strategies. That a layout equals one device is proved where the layout
lives (test_transformer.py, test_context.py, test_moe.py, the layer tests).
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import fine_tune_folder, rewrite_safetensors

import flax_tp
from models.config import FULL, SLIDING, RopeScaling, TransformerConfig
from models.execution import Execution
from models.families import HFConfigError, config_from_hf, config_to_hf
from models.generate import generate
from models.hf import load_hf, read_config, save_hf
from train.step import Trainer, make_optimizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
DENSE = ["llama3", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
         "olmo3"]
# Mixtures of experts: experts over "data" as well, so 4x2 too.
EXPERTS = ["mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v3_plain",
           "gpt_oss"]
FAMILIES = DENSE + EXPERTS
MESHES = ["1x1", "1x3", "2x4", "1x8"]
MOE_MESHES = [*MESHES, "4x2"]
# Each family against transformers on one mesh, chosen for what it splits unevenly (each
# mesh at least once); the full sweep (slow lane) for two families, one dense with every
# attention mechanism of its kind (Gemma 2: windows, soft caps, its own scale) and one
# with experts and dense layers (Qwen2-MoE: shared expert, mixed layers). Each mechanism
# that meets a split gets its second mesh in the tests below: windows and soft caps
# (gemma2 sweep; mistral 1x8, gemma3_text 2x4 under execution options), sinks (gpt_oss
# 4x2 here, 2x4 and 1x8 below), latent attention (deepseek_v3 2x4 and deepseek_v3_plain
# 1x3 here, 2x4 and 1x8 below), OLMo's split q/k norms (olmo2 2x4, olmo3 1x3), experts
# (every MoE family here, the sweep, and the layouts below).
FAST = {name: MESHES[i % len(MESHES)] for i, name in enumerate(DENSE)}
FAST.update(mixtral="2x4", qwen2_moe="4x2", qwen3_moe="1x3", glm4_moe="1x8",
            deepseek_v3="2x4", deepseek_v3_plain="1x3", gpt_oss="4x2",
            # OLMo's q/k norms over heads split unevenly (6 over 4) and kv heads replicated
            olmo2="2x4", olmo3="1x3")
SWEPT = ("gemma2", "qwen2_moe")
CASES = [pytest.param(name, mesh, marks=() if FAST[name] == mesh else pytest.mark.slow,
                      id=f"{name}-{mesh}")
         for name in FAMILIES for mesh in (MOE_MESHES if name in EXPERTS else MESHES)
         if FAST[name] == mesh or name in SWEPT]


def check_against_fixture(model, name, *, batch_one=False):
  """Logits, loss and every gradient as transformers computed them; greedy generation
  of two prompts of different lengths in one batch (and, ``batch_one``, the first alone)."""
  from models.hf import to_hf_state_dict
  expected = np.load(FIXTURES / name / "expected.npz")
  # A data axis wider than the fixture's 2 rows (4x2): the rows repeated, which leaves
  # the mean loss, its gradients and each row's generation as they are.
  reps = max(1, model.mesh.shape["data"] // len(expected["ids"]))
  ids = np.tile(expected["ids"], (reps, 1))
  logits = jax.jit(lambda t: model(t))(jnp.asarray(ids, jnp.int32))
  np.testing.assert_allclose(logits, np.tile(expected["logits"], (reps, 1, 1)), rtol=1e-5,
                             atol=1e-5)
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
  tokens = jax.device_put(jnp.asarray(ids, jnp.int32), trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  np.testing.assert_allclose(loss, expected["loss"], rtol=1e-6)
  grads = to_hf_state_dict(grads, model.cfg, experts_fused=True)  # as transformers holds them
  theirs = {k[len("grad:"):]: expected[k] for k in expected.files if k.startswith("grad:")}
  assert set(grads) == set(theirs) - ({"lm_head.weight"} if model.cfg.tie_embeddings
                                      else set())
  for key, value in grads.items():
    np.testing.assert_allclose(value, theirs[key], rtol=1e-4, atol=1e-6, err_msg=key)
  generated = np.load(FIXTURES / name / "generate.npz")
  eos = int(generated["eos_id"])
  eos = None if eos < 0 else eos
  out = generate(model, ids, lengths=np.tile(generated["lengths"], reps), max_new_tokens=16,
                 eos_id=eos)
  np.testing.assert_array_equal(out, np.tile(generated["ids"], (reps, 1)))
  if batch_one:
    n = int(generated["lengths"][0])
    alone = generate(model, ids[:1, :n], max_new_tokens=16, eos_id=eos)
    np.testing.assert_array_equal(alone, generated["ids"][:1])


@pytest.mark.parametrize("name,mesh_spec", CASES)
def test_family_equals_transformers(meshes, name, mesh_spec):
  model = load_hf(FIXTURES / name, meshes[mesh_spec])
  # (llama3 is Llama's; deepseek_v3_plain DeepSeek-V3's other attention)
  assert model.cfg.family == {"llama3": None, "deepseek_v3_plain": "deepseek_v3"}.get(name, name)
  check_against_fixture(model, name, batch_one=FAST[name] == mesh_spec)


# The fast lane runs two of these (a dense family's mixed windows scanned under SP, FSDP and
# remat; a MoE family's experts scanned under FSDP and remat); the rest run in the slow
# lane. Each option's layouts are proved in the fast lane where they live
# (test_transformer.py: sequence parallelism, sinks, latent attention; test_data_parallel.py:
# FSDP; test_moe.py: the expert layouts; test_remat.py).
@pytest.mark.parametrize("name,mesh_spec,execution", [
    # mixed sliding/full layers under one scan (the layer's kind is a traced index),
    # sequence parallelism over 4 with its all-gathers, FSDP over the data axis
    ("gemma3_text", "2x4", Execution(scan_layers=True, sequence_parallel=True, fsdp=True,
                                     remat="block")),
    pytest.param("gemma2", "1x3", Execution(sequence_parallel=True, remat="dots_saveable"),
                 marks=pytest.mark.slow),
    pytest.param("phi3", "2x4", Execution(scan_layers=True, fsdp=True), marks=pytest.mark.slow),
    pytest.param("mistral", "1x8", Execution(sequence_parallel=True, scan_layers=True),
                 marks=pytest.mark.slow),
    ("mixtral", "4x2", Execution(scan_layers=True, fsdp=True, remat="block")),
    # its dense and MoE layers scanned as runs of one kind, experts under SP and FSDP
    pytest.param("qwen2_moe", "2x4", Execution(scan_layers=True, sequence_parallel=True,
                                               fsdp=True, remat="dots_saveable"),
                 marks=pytest.mark.slow),
    # GLM-4.5's 9 experts whole on the 8 devices of 2x4 (two on one), its router over
    # scanned runs of a dense and a MoE layer, under SP and FSDP
    pytest.param("glm4_moe", "2x4", Execution(expert_axes=("data", "model"), scan_layers=True,
                                              sequence_parallel=True, fsdp=True),
                 marks=pytest.mark.slow),
    pytest.param("glm4_moe", "4x2", Execution(remat="block"), marks=pytest.mark.slow),
    # DeepSeek-V3's 9 experts whole on the 8 devices of 2x4, its latent attention under
    # SP (the latents gathered, not x), scanned, FSDP; the other MLA (one q projection,
    # values wider than q/k) under SP with x gathered, remat
    pytest.param("deepseek_v3", "2x4", Execution(expert_axes=("data", "model"),
                                                 scan_layers=True, sequence_parallel=True,
                                                 fsdp=True),
                 marks=pytest.mark.slow),
    pytest.param("deepseek_v3_plain", "1x8", Execution(sequence_parallel=True, remat="block"),
                 marks=pytest.mark.slow),
    # GPT-OSS's biased, clamped experts whole on the devices of 2x4 (the down bias added by
    # its expert's device), sinks under SP, scanned sliding/full layers, FSDP; on 1x8 its
    # FFN split 8 ways (the down bias added once, by the first model device), remat
    pytest.param("gpt_oss", "2x4", Execution(expert_axes=("data", "model"), scan_layers=True,
                                             sequence_parallel=True, fsdp=True),
                 marks=pytest.mark.slow),
    pytest.param("gpt_oss", "1x8", Execution(sequence_parallel=True, remat="block"),
                 marks=pytest.mark.slow),
    # each expert whole on one device: 8 experts over data x model
    pytest.param("qwen3_moe", "2x4", Execution(expert_axes=("data", "model")),
                 marks=pytest.mark.slow),
    # jax's splash attention kernel (Pallas interpret mode here) with GPT-OSS's sinks and
    # sliding layers, and with Gemma 2's soft cap and windows, against transformers
    pytest.param("gpt_oss", "2x4", Execution(attention="splash"), marks=pytest.mark.slow),
    pytest.param("gemma2", "1x3", Execution(attention="splash", scan_layers=True),
                 marks=pytest.mark.slow),
    pytest.param("mixtral", "4x2", Execution(expert_axes=("data", "model"),
                                             sequence_parallel=True, scan_layers=True),
                 marks=pytest.mark.slow),
    pytest.param("qwen2_moe", "1x8", Execution(expert_axes=("data", "model"), fsdp=True),
                 marks=pytest.mark.slow),
])
def test_family_under_every_execution_option(meshes, name, mesh_spec, execution):
  model = load_hf(FIXTURES / name, meshes[mesh_spec], execution=execution)
  check_against_fixture(model, name)


RING = "ring"


# Each mechanism that meets the context split, on a context mesh, both strategies: the
# loss's 8 tokens (a MoE's 9) padded to 2C chunks where 2C does not divide them (C = 3),
# the windows crossing the chunks' edges; greedy generation through the cache past the
# window. Windows (mistral; gemma2 with soft caps in the ring; Qwen2's per-layer windows),
# OLMo 3's split norms, experts dispatched over context (mixtral, qwen3_moe), a MoE in
# the ring (qwen2_moe), latent attention (deepseek_v3), sinks (gpt_oss). Context meshes
# in general: tests/test_context.py. The fast lane runs the first (windows across the
# chunks' edges, all-gather); sinks in the ring are tests/test_ring_attention.py's fast case.
@pytest.mark.parametrize("name,mesh_spec,execution", [
    ("mistral", "1x3x2", Execution()),
    pytest.param("gemma2", "2x2x2", Execution(context_parallel=RING, sequence_parallel=True),
                 marks=pytest.mark.slow),
    pytest.param("qwen2_sliding", "1x3x2", Execution(context_parallel=RING),
                 marks=pytest.mark.slow),
    pytest.param("olmo3", "1x3x2", Execution(context_parallel=RING, sequence_parallel=True),
                 marks=pytest.mark.slow),
    pytest.param("qwen2_moe", "2x3x1", Execution(context_parallel=RING),
                 marks=pytest.mark.slow),
    # the experts over data x context (and model): each context shard's tokens dispatched
    pytest.param("mixtral", "2x2x2", Execution(expert_axes=("data", "context")),
                 marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "1x4x2", Execution(expert_axes=("data", "context", "model"),
                                                 sequence_parallel=True),
                 marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "2x2x2", Execution(context_parallel=RING,
                                                   sequence_parallel=True),
                 marks=pytest.mark.slow),
    # the sinks in the ring (forward and its hand-written backward) and the all-gather core
    pytest.param("gpt_oss", "2x2x2", Execution(context_parallel=RING, sequence_parallel=True),
                 marks=pytest.mark.slow),
])
def test_family_on_a_context_mesh_equals_transformers(name, mesh_spec, execution):
  mesh = flax_tp.make_mesh(mesh_spec)
  assert flax_tp.MeshAxes.of(mesh).context > 1
  model = load_hf(FIXTURES / name, mesh, execution=execution)
  check_against_fixture(model, name)


# The all-to-all dispatcher (each routed choice sent only to its expert's device) on
# transformers' MoE fixtures, with each layout of the experts: at capacity factor E / k
# no expert can overflow, so transformers' dropless logits, gradients and generation hold.
@pytest.mark.parametrize("name,mesh_spec,expert_axes", [
    pytest.param("mixtral", "4x2", ("data",), marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "2x4", ("data", "model"), marks=pytest.mark.slow),
    pytest.param("qwen2_moe", "8x1", ("data",), marks=pytest.mark.slow),
    pytest.param("mixtral", "2x2x2", ("data", "context"), marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "2x2x2", ("data", "context", "model"), marks=pytest.mark.slow),
])
def test_the_all_to_all_dispatcher_equals_transformers_with_each_layout(name, mesh_spec,
                                                                        expert_axes):
  cfg = read_config(FIXTURES / name)
  model = load_hf(FIXTURES / name, flax_tp.make_mesh(mesh_spec),
                  execution=Execution(expert_axes=expert_axes, expert_dispatcher="all_to_all"),
                  expert_capacity_factor=cfg.num_experts / cfg.experts_per_token)
  moes = [m for _, m in nnx.iter_graph(model) if isinstance(m, flax_tp.MoE)]
  assert moes and all(m.dispatcher == "all_to_all" for m in moes)
  assert all(m.expert_axes == expert_axes for m in moes)
  check_against_fixture(model, name)


@pytest.mark.parametrize("name", FAMILIES)
def test_save_hf_writes_back_what_transformers_wrote(tmp_path, meshes, name):
  """Every tensor as it was (Phi-3's fused ones fused again, from their split parts),
  and a config.json that reads back to the same model."""
  from safetensors.numpy import load_file
  model = load_hf(FIXTURES / name, meshes["2x4"],
                  execution=Execution(scan_layers=name in ("gemma2", "phi3", "qwen2_moe")))
  save_hf(model, tmp_path)
  original = load_file(FIXTURES / name / "model.safetensors")
  written = load_file(tmp_path / "model.safetensors")
  assert set(written) == set(original) - ({"lm_head.weight"} if model.cfg.tie_embeddings
                                          else set())
  for key, value in written.items():
    np.testing.assert_array_equal(value, original[key], err_msg=key)
  again = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
  assert again == model.cfg


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_folder_loads_in_transformers_to_the_same_logits(tmp_path, meshes, name):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model = load_hf(FIXTURES / name, meshes["1x3"])
  save_hf(model, tmp_path)
  expected = np.load(FIXTURES / name / "expected.npz")
  eager = dict(experts_implementation="eager") if name in EXPERTS else {}
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **eager).eval()
  assert type(theirs).__name__ == json.loads((FIXTURES / name / "config.json").read_text())[
      "architectures"][0]
  with torch.no_grad():
    logits = theirs(torch.as_tensor(expected["ids"])).logits.numpy()
  np.testing.assert_allclose(logits, expected["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name,change", [
    ("llama3", dict(rope_scaling=None)),
    ("qwen3", dict(rope_scaling=None)),
    ("mistral", dict(sliding_window=8)),
    ("qwen2_sliding", dict(layer_types=("full_attention", "full_attention"))),
    ("gemma", dict(embed_scale=False)),
    ("gemma2", dict(attn_softcap=None)),
    ("gemma2", dict(final_softcap=None)),
    ("gemma2", dict(attn_scale=None)),
    ("gemma3_text", dict(rope_local_base=None)),
    ("phi3", dict(rotary_fraction=1.0)),
    ("olmo3", dict(rope_local_base=None)),
    ("olmo3", dict(sliding_window=8)),
    ("qwen2_moe", dict(normalize_top_k=True)),
    ("qwen3_moe", dict(experts_per_token=2)),
    ("glm4_moe", dict(expert_groups=1, expert_groups_per_token=1)),
    ("glm4_moe", dict(routed_scale=1.0)),
    ("glm4_moe", dict(rotary_fraction=1.0)),
    ("glm4_moe", "no selection bias"),
    ("deepseek_v3", dict(rope_interleave=False)),  # its rotary rows as stored
    ("deepseek_v3", dict(attn_scale=None)),  # yarn's mscale_all_dim on the scores
    ("gpt_oss", dict(swiglu_limit=1e4)),  # the clamp
    ("gpt_oss", dict(layer_types=(FULL, FULL))),  # the sliding layer
    ("gpt_oss", "no sinks"),
    ("gpt_oss", "no router bias"),
])
def test_each_fixture_tells_its_mechanism_apart(meshes, name, change):
  """Without the mechanism (or with another window) the logits are not transformers':
  the fixtures can fail the tests above."""
  zeroed = {"no selection bias": "selection_bias", "no sinks": "sinks",
            "no router bias": "router_bias"}
  if isinstance(change, str):
    model = load_hf(FIXTURES / name, meshes["1x1"])
    found = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      if path[-1] == zeroed[change]:  # a sink of -1e4 takes no weight: as if none
        var[...] = jnp.full_like(var[...], -1e4 if change == "no sinks" else 0.0)
        found += 1
    assert found > 0
  else:
    model = load_hf(FIXTURES / name, meshes["1x1"], **change)
  expected = np.load(FIXTURES / name / "expected.npz")
  logits = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(expected["ids"], jnp.int32)))
  assert np.max(np.abs(logits - expected["logits"])) > 1e-3


# -- strict loading --------------------------------------------------------------------------

def _copy(name, folder):
  shutil.copytree(FIXTURES / name, folder)
  return folder


@pytest.mark.parametrize("name,how,named", [
    ("phi3", "extra", "model.layers.0.self_attn.q_proj.weight"),
    ("phi3", "missing", "model.layers.1.mlp.gate_up_proj.weight"),
    ("gemma2", "missing", "model.layers.0.post_feedforward_layernorm.weight"),
    ("qwen3", "missing", "model.layers.1.self_attn.k_norm.weight"),
    ("gemma3_text", "extra", "model.layers.0.self_attn.q_norm.bias"),
    ("mixtral", "missing", "model.layers.1.block_sparse_moe.experts.5.w2.weight"),
    ("qwen3_moe", "extra", "model.layers.0.mlp.experts.7.up_proj.weight"),
    ("qwen2_moe", "missing", "model.layers.1.mlp.shared_expert_gate.weight"),
    ("glm4_moe", "missing", "model.layers.1.mlp.gate.e_score_correction_bias"),
    ("glm4_moe", "extra", "model.layers.1.mlp.shared_expert_gate.weight"),
    ("glm4_moe", "missing", "model.layers.1.mlp.experts.8.down_proj.weight"),
    # past the one multi-token-prediction layer (2) the config declares
    ("glm4_moe", "extra", "model.layers.3.eh_proj.weight"),
    ("deepseek_v3", "missing", "model.layers.0.self_attn.kv_b_proj.weight"),
    ("deepseek_v3", "missing", "model.layers.1.self_attn.q_a_layernorm.weight"),
    ("deepseek_v3", "extra", "model.layers.0.self_attn.q_proj.weight"),
    ("deepseek_v3_plain", "extra", "model.layers.1.self_attn.q_b_proj.weight"),
    ("gpt_oss", "missing", "model.layers.0.self_attn.sinks"),
    ("gpt_oss", "missing", "model.layers.1.mlp.experts.gate_up_proj_bias"),
    ("gpt_oss", "extra", "model.layers.1.mlp.experts.gate_up_proj_blocks"),
    ("gpt_oss_mxfp4", "missing", "model.layers.0.mlp.experts.down_proj_scales"),
])
def test_a_tampered_checkpoint_is_refused_naming_the_tensor(tmp_path, meshes, name, how, named):
  from safetensors.numpy import load_file, save_file
  folder = _copy(name, tmp_path / "m")
  tensors = load_file(folder / "model.safetensors")
  if how == "extra":
    tensors[named] = np.zeros((2, 2), np.float32)
  else:
    del tensors[named]
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(HFConfigError) as err:
    load_hf(folder, meshes["1x2"])
  assert named in str(err.value) and "\n" not in str(err.value)


def test_multi_token_prediction_layers_are_skipped_by_name_and_said(tmp_path, meshes):
  """GLM-4.5 and DeepSeek-V3 ship ``num_nextn_predict_layers`` layers after the decoder's
  (``model.layers.{num_hidden_layers}.*``), which a causal LM does not run: skipped with a
  warning naming them, the model transformers' still; declared as none, they are refused."""
  from safetensors.numpy import load_file, save_file
  folder = _copy("glm4_moe", tmp_path / "m")
  tensors = load_file(folder / "model.safetensors")
  tensors.update({"model.layers.2.eh_proj.weight": np.ones((24, 48), np.float32),
                  "model.layers.2.mlp.experts.0.up_proj.weight": np.ones((14, 24), np.float32)})
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  with pytest.warns(UserWarning, match="skipped the 2 tensors of the multi-token-prediction "
                                       "layer model.layers.2 "):
    model = load_hf(folder, meshes["1x2"])
  expected = np.load(FIXTURES / "glm4_moe" / "expected.npz")
  np.testing.assert_allclose(jax.jit(lambda t: model(t))(jnp.asarray(expected["ids"])),
                             expected["logits"], rtol=1e-5, atol=1e-5)
  config = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
  with pytest.raises(HFConfigError, match="model.layers.2.eh_proj.weight"):
    load_hf(folder, meshes["1x2"])


@pytest.mark.parametrize("mesh_spec", ["2x4", pytest.param("1x8", marks=pytest.mark.slow)])
def test_experts_fused_on_disk_load_as_per_expert_ones(meshes, mesh_spec):
  """Mixtral as transformers 5 holds it (and newer releases ship it): ``mlp.gate``,
  ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; the same model as
  the per-expert folder, so transformers' logits, gradients and generations."""
  model = load_hf(FIXTURES / "mixtral_fused", meshes[mesh_spec])
  check_against_fixture(model, "mixtral")


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path, meshes):
  from safetensors.numpy import load_file, save_file
  folder = _copy("phi3", tmp_path / "m")
  tensors = load_file(folder / "model.safetensors")
  name = "model.layers.0.self_attn.qkv_proj.weight"
  tensors[name] = tensors[name][:-8]
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(HFConfigError, match=f"{name}.*rows"):
    load_hf(folder, meshes["1x2"])


def _config(name):
  return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize("name,change,field", [
    ("llama3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                    "rope_theta": 1e4}}, "rope_type 'dynamic'"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                  "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_type 'longrope'"),
    ("llama3", {"rope_parameters": None, "rope_scaling": {"type": "su"}}, "rope_type 'su'"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]},
     "layer_types 'chunked_attention'"),
    ("gemma3_text", {"rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "sliding_attention"),
    ("mistral", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen3", {"model_type": "qwen3_moe"}, "lacks 'num_experts'"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("qwen2_moe", {"mlp_only_layers": "0"}, "mlp_only_layers"),
    ("glm4_moe", {"quantization_config": {"quant_method": "fp8"}},
     "weight_block_size is None"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "mxfp4"}},
     "quantization_config \\('mxfp4'"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2",
                                             "weight_block_size": [128, 128]}}, "fmt 'e5m2'"),
    ("glm4_moe", {"first_k_dense_replace": 2}, "first_k_dense_replace 2 leaves no MoE layer"),
    ("glm4_moe", {"n_group": 2}, "expert_groups 2 must divide num_experts 9"),
    ("glm4_moe", {"topk_method": "greedy"}, "topk_method 'greedy'"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads 2 is not"),
    ("deepseek_v3", {"qk_rope_head_dim": 3}, "qk_rope_head_dim even"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ("deepseek_v3", {"kv_lora_rank": 0}, "'kv_lora_rank' is 0"),
])
def test_configs_it_cannot_honour_are_named(name, change, field):
  with pytest.raises(HFConfigError, match=field):
    config_from_hf({**_config(name), **change})


def test_legacy_and_transformers_5_rope_fields_read_alike():
  """Llama 3.1's ``rope_scaling`` + ``rope_theta`` (transformers 4) and its
  ``rope_parameters`` (5) are one config; Gemma 3's legacy ``rope_local_base_freq`` and
  ``rope_scaling`` are its nested ``rope_parameters``; Qwen2's ``use_sliding_window``
  places its window from ``max_window_layers`` on."""
  v5 = _config("llama3")
  rope = dict(v5.pop("rope_parameters"))
  v4 = {**v5, "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
  assert config_from_hf(v4) == config_from_hf(_config("llama3"))
  scaling = config_from_hf(v4).rope_scaling
  assert scaling == RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_len=64)
  g3 = _config("gemma3_text")
  legacy = {**g3, "rope_parameters": None, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
  assert config_from_hf(legacy) == config_from_hf(g3)
  assert config_from_hf(g3).rope_local_base == 1e4
  qwen2 = json.loads((FIXTURES / "qwen2" / "config.json").read_text())
  slid = config_from_hf({**qwen2, "use_sliding_window": True, "sliding_window": 3,
                         "max_window_layers": 1, "layer_types": None})
  assert slid.layer_types == (FULL, SLIDING) and slid.sliding_window == 3
  off = config_from_hf({**qwen2, "use_sliding_window": False, "sliding_window": 3,
                        "layer_types": [SLIDING, SLIDING]})
  assert off.layer_types is None and off.sliding_window is None  # as transformers: no window


def test_yarn_attention_factor_follows_transformers():
  """yarn's cos/sin factor: given, or 0.1 ln(factor) + 1, or from mscale/mscale_all_dim."""
  import math
  base = _config("qwen3")
  rope = base["rope_parameters"]
  assert config_from_hf(base).rope_scaling.attention_factor == pytest.approx(
      0.1 * math.log(4.0) + 1)
  given = config_from_hf({**base, "rope_parameters": {**rope, "attention_factor": 0.7}})
  assert given.rope_scaling.attention_factor == 0.7
  ms = config_from_hf({**base, "rope_parameters": {**rope, "mscale": 2.0,
                                                   "mscale_all_dim": 1.0}})
  assert ms.rope_scaling.attention_factor == pytest.approx(
      (0.2 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1))


def test_old_identity_is_unchanged_and_new_fields_round_trip():
  """A config without the families' fields has the identity it had before them (so its
  runs resume); one with them reads back from its JSON form."""
  before = {"vocab_size", "d_model", "num_heads", "head_dim", "d_ff", "num_layers",
            "max_seq_len", "tie_embeddings", "dropout", "dtype", "rope_base", "norm_eps",
            "norm", "mlp", "num_kv_heads", "qkv_bias", "attn_out_bias", "mlp_bias"}
  assert set(TransformerConfig.tiny().identity()) == before
  for name in FAMILIES:
    cfg = read_config(FIXTURES / name)
    identity = json.loads(json.dumps(cfg.identity()))
    assert TransformerConfig.from_identity(identity) == cfg


# -- from the CLI, as a new user runs it -----------------------------------------------------

@pytest.mark.slow
# (GPT-OSS's and DeepSeek-V3's path from the CLI: test_a_2026_family_fine_tunes_...)
# One dense family with its own tokenizer.json kind and mixed window layers, one with
# experts whose selection biases move (Phi-3's fused tensors and OLMo's norms from HF:
# test_family_equals_transformers and test_save_hf_writes_back_what_transformers_wrote)
@pytest.mark.parametrize("name", ["gemma3_text", "glm4_moe"])
def test_a_family_fine_tunes_resumes_on_another_mesh_and_generates(tmp_path, name, capsys):
  """``train/run.py --init-from`` a family's folder (its own tokenizer.json) on 2x4 with
  every execution option, resumed on 1x8 from a copied checkpoint, then
  ``train/generate.py`` from the checkpoint and ``--hf`` from the folder."""

  from helpers import logged_losses

  from train import generate as cli
  from train.run import main
  cfg, folder, flags = fine_tune_folder(tmp_path, name)
  if name == "glm4_moe":  # its selection biases moved each step, and resumed moved
    flags += ["--router-bias-rate", "0.05"]
  ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
  assert main([*flags, "--mesh", "2x4", "--sequence-parallel", "--remat", "block",
               "--scan-layers", "--fsdp", "--checkpoint-dir", str(ck), "--checkpoint-every",
               "3", "--metrics-file", str(metrics)]) == 0
  losses = logged_losses(metrics)
  assert len(losses) == 6 and losses[-1] < losses[0]
  if name == "glm4_moe":
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    spreads = [r["selection_bias_spread"] for r in records if "loss" in r]
    assert 0 < spreads[0] <= 0.1 + 1e-6 and spreads[-1] > spreads[0]
  moved = tmp_path / "moved"
  moved.mkdir()
  shutil.copytree(ck / "3", moved / "3")
  resumed = tmp_path / "r.jsonl"
  assert main([*flags, "--mesh", "1x8", "--resume", "--checkpoint-dir", str(moved),
               "--metrics-file", str(resumed)]) == 0
  again = logged_losses(resumed)
  np.testing.assert_allclose(again[0], losses[3], rtol=1e-5)
  capsys.readouterr()
  assert cli.main(["--checkpoint", str(moved), "--mesh", "1x3", "--prompt", "def f(",
                   "--max-new-tokens", "5"]) == 0
  out = capsys.readouterr()
  assert out.out.startswith("def f(") and "5 tokens on mesh 1x3" in out.err
  assert cli.main(["--hf", str(folder), "--mesh", "2x4", "--prompt", "def f(",
                   "--max-new-tokens", "5"]) == 0
  assert capsys.readouterr().out.startswith("def f(")


def test_llama3_and_gemma_style_tokenizers_round_trip(tmp_path):
  """The two tokenizer.json kinds of these families, through HF's ``tokenizers`` as the
  CLI reads them: Llama 3's tiktoken-style regex split before byte-level BPE, and
  Gemma's SentencePiece-style BPE (``▁`` for spaces, byte-fallback tokens ``<0xNN>`` for
  what its vocabulary lacks). Text they never saw comes back byte for byte."""
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

  from train.data import HFTokenizer
  text = "def f(x) = 'λ→😀'\n\ty  # naïve"
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("def f(x):\n    return x\n" * 20)
  split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
  llama3 = Tokenizer(models.BPE())
  llama3.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  llama3.decoder = decoders.ByteLevel()
  llama3.train([str(corpus)], trainers.BpeTrainer(
      vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      special_tokens=["<|begin_of_text|>"]))
  specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
  pieces = specials + [f"<0x{i:02X}>" for i in range(256)] + sorted(set("def(x):\nrtun▁"))
  gemma = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces + ["de", "def"])},
                               merges=[("d", "e"), ("de", "f")], byte_fallback=True,
                               fuse_unk=True, unk_token="<unk>"))
  gemma.normalizer = normalizers.Replace(" ", "▁")
  gemma.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
  gemma.add_special_tokens(specials)
  for name, tokenizer in (("llama3", llama3), ("gemma", gemma)):
    tokenizer.save(str(tmp_path / f"{name}.json"))
    ours = HFTokenizer(tmp_path / f"{name}.json")
    ids = ours.encode(text.encode())
    assert 0 < len(ids) < len(text.encode()) and ours.decode(ids) == text, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_moe"])
def test_a_moe_family_fine_tunes_resumes_exports_and_transformers_reads_it(tmp_path, name,
                                                                           capsys):
  """A new user's path with a mixture of experts: ``train/run.py --init-from`` a Qwen2-MoE
  folder on 2x4 (experts over "data", their FFNs over "model"; with remat and FSDP),
  resumed on 1x8 from a copied checkpoint, ``train/export.py`` of the last step, and
  transformers reading the export to the logits of the checkpoint's model."""

  from helpers import logged_losses

  import flax_tp
  from train import export
  from train.run import main
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg, folder, flags = fine_tune_folder(tmp_path, name)
  ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
  assert main([*flags, "--mesh", "2x4", "--remat", "block", "--fsdp", "--checkpoint-dir",
               str(ck), "--checkpoint-every", "3", "--metrics-file", str(metrics)]) == 0
  assert "experts: 6 in each of 1 MoE layer(s), top-2, dropless | over data: 3, 3" in capsys.readouterr().out
  losses = logged_losses(metrics)
  assert len(losses) == 6 and losses[-1] < losses[0]
  record = json.loads(metrics.read_text().splitlines()[-1])
  assert len(record["expert_load"]) == 6 and record["router_aux_loss"] > 0
  moved = tmp_path / "moved"
  moved.mkdir()
  shutil.copytree(ck / "3", moved / "3")
  resumed = tmp_path / "r.jsonl"
  # resumed with each expert whole on one device (6 over 8: two zero experts)
  assert main([*flags, "--mesh", "1x8", "--expert-axes", "data,model", "--resume",
               "--checkpoint-dir", str(moved), "--metrics-file", str(resumed)]) == 0
  assert "over model: 1, 1, 1, 1, 1, 1, 0, 0 per shard" in capsys.readouterr().out  # data: 1
  np.testing.assert_allclose(logged_losses(resumed)[0], losses[3], rtol=1e-5)
  out = tmp_path / "exported"
  assert export.main(["--checkpoint", str(moved), "--out", str(out), "--mesh", "2x4"]) == 0
  assert (out / "tokenizer.json").is_file()
  ours = load_hf(out, flax_tp.make_mesh("4x2"))
  assert ours.cfg.family == name and ours.cfg.num_experts == 6
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 12))
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      out, experts_implementation="eager").eval()
  with torch.no_grad():
    expected = theirs(torch.as_tensor(ids)).logits.numpy()
  np.testing.assert_allclose(jax.jit(lambda t: ours(t))(jnp.asarray(ids, jnp.int32)),
                             expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh_spec", ["2x4", pytest.param("1x3", marks=pytest.mark.slow)])
def test_an_fp8_checkpoint_is_dequantized_exactly(tmp_path, meshes, mesh_spec):
  """DeepSeek-V3's release format (fixture: every decoder weight matrix float8_e4m3fn with
  a float32 ``weight_scale_inv`` per 4 x 8 block, partial blocks at the edges): each weight
  is its FP8 values times its blocks' scales, bitwise as torch computes them, and the
  model gives transformers' logits and loss for those weights. ``save_hf`` writes the
  float model (no quantization_config)."""
  from models.hf import to_hf_state_dict
  folder = FIXTURES / "deepseek_v3_fp8"
  model = load_hf(folder, meshes[mesh_spec])
  expected = np.load(folder / "expected.npz")
  ours = to_hf_state_dict(nnx.state(model, nnx.Param), model.cfg)
  dequantized = [k for k in expected.files if k.startswith("dequantized:")]
  assert len(dequantized) == 2 * 5 + 3 + 3 * (9 + 1)  # attention x 2, a dense MLP, experts
  for key in dequantized:
    np.testing.assert_array_equal(ours[key[len("dequantized:"):]], expected[key], err_msg=key)
  ids = jnp.asarray(expected["ids"], jnp.int32)
  np.testing.assert_allclose(jax.jit(lambda t: model(t))(ids), expected["logits"], rtol=1e-5,
                             atol=1e-5)
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
  loss, _ = jax.jit(trainer.loss_and_grads)(trainer.params,
                                            jax.device_put(ids, trainer.batch_sharding))
  np.testing.assert_allclose(loss, expected["loss"], rtol=1e-6)
  save_hf(model, tmp_path / "float")
  assert "quantization_config" not in json.loads((tmp_path / "float" / "config.json").read_text())
  from safetensors.numpy import load_file
  written = load_file(tmp_path / "float" / "model.safetensors")
  assert set(written) == set(ours)
  for key, value in written.items():
    np.testing.assert_array_equal(value, ours[key], err_msg=key)


@pytest.mark.parametrize("how,named", [
    ("no scale", "model.layers.1.self_attn.kv_b_proj.weight"),
    ("scale shape", "model.layers.0.mlp.down_proj.weight_scale_inv"),
])
def test_an_fp8_weight_without_its_scales_is_refused_naming_it(tmp_path, meshes, how, named):
  folder = _copy("deepseek_v3_fp8", tmp_path / "m")

  def edit(tensors):
    if how == "no scale":
      del tensors[named + "_scale_inv"]
    else:  # one column fewer: the scale no longer covers the weight's blocks
      dtype, (rows, cols), blob = tensors[named]
      width = len(blob) // (rows * cols)
      cut = np.frombuffer(blob, np.uint8).reshape(rows, cols * width)[:, :-width]
      tensors[named] = (dtype, [rows, cols - 1], cut.tobytes())
  rewrite_safetensors(folder / "model.safetensors", edit)
  with pytest.raises(HFConfigError) as err:
    load_hf(folder, meshes["1x2"])
  assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mesh_spec", ["1x8", pytest.param("2x4", marks=pytest.mark.slow)])
def test_an_mxfp4_checkpoint_is_dequantized_exactly(tmp_path, meshes, mesh_spec):
  """GPT-OSS's release format (fixture: the experts' gate_up_proj and down_proj as MXFP4
  ``_blocks`` and ``_scales`` with random codes and exponents): each is bitwise what
  transformers' own ``convert_moe_packed_tensors`` gives, the model gives transformers'
  logits and loss for those weights, and ``save_hf`` writes the float model."""
  from models.hf import to_hf_state_dict
  folder = FIXTURES / "gpt_oss_mxfp4"
  assert json.loads((folder / "config.json").read_text())["quantization_config"][
      "quant_method"] == "mxfp4"
  model = load_hf(folder, meshes[mesh_spec])
  expected = np.load(folder / "expected.npz")
  ours = to_hf_state_dict(nnx.state(model, nnx.Param), model.cfg)
  dequantized = [k for k in expected.files if k.startswith("dequantized:")]
  assert len(dequantized) == 2 * 2  # gate_up and down, two layers
  for key in dequantized:
    assert np.abs(expected[key]).max() > 0
    np.testing.assert_array_equal(ours[key[len("dequantized:"):]], expected[key], err_msg=key)
  ids = jnp.asarray(expected["ids"], jnp.int32)
  # The MXFP4 experts' weights reach 6 * 2**k, so their outputs are larger than the float
  # fixture's and float32 rounding shows more: one device (1x1) is itself 2e-5 from
  # transformers on one token (the meshes agree with 1x1 within 1e-5), hence atol 4e-5.
  np.testing.assert_allclose(jax.jit(lambda t: model(t))(ids), expected["logits"], rtol=1e-5,
                             atol=4e-5)
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
  loss, _ = jax.jit(trainer.loss_and_grads)(trainer.params,
                                            jax.device_put(ids, trainer.batch_sharding))
  np.testing.assert_allclose(loss, expected["loss"], rtol=1e-6)
  save_hf(model, tmp_path / "float")
  assert "quantization_config" not in json.loads((tmp_path / "float" / "config.json").read_text())
  from safetensors.numpy import load_file
  assert set(load_file(tmp_path / "float" / "model.safetensors")) == set(ours)


def test_an_mxfp4_code_table_and_exponent_worked_by_hand():
  """One byte: low nibble 0b0011 (1.5) first, high 0b1110 (-4.0) second, each times
  2 ** (scale - 127); the block's 32 values then run along the input dim."""
  from models.hf import mxfp4_dequantized
  blocks = np.zeros((1, 1, 1, 16), np.uint8)
  blocks[0, 0, 0, 0] = 0b1110_0011
  blocks[0, 0, 0, 15] = 0b0111_1001  # low 0b1001 (-0.5), high 0b0111 (6.0)
  scales = np.full((1, 1, 1), 125, np.uint8)  # 2 ** -2
  out = mxfp4_dequantized(blocks, scales, "w")
  assert out.shape == (1, 32, 1)
  want = np.zeros(32, np.float32)
  want[[0, 1, 30, 31]] = [1.5 / 4, -4.0 / 4, -0.5 / 4, 6.0 / 4]
  np.testing.assert_array_equal(out[0, :, 0], want)
  with pytest.raises(HFConfigError, match="w_blocks"):
    mxfp4_dequantized(blocks[..., :8], scales, "w")


def test_a_family_declares_the_tensors_of_its_layers(monkeypatch):
  """A family's attention and experts builders name its layers' tensors: DeepSeek-V3
  declares its latent attention, GPT-OSS its fused experts, the others Llama's (fused as
  Phi-3's where they say so); a builder swapped in a declaration is what ``tensor_names``
  (which the loader, ``save_hf`` and PEFT read) then names, and a model whose attention the family cannot store is refused naming why."""
  from models.families import FAMILIES, tensor_names
  from models.families.tensors import (
    attention_tensors,
    expert_tensors,
    gpt_oss_expert_tensors,
    latent_attention_tensors,
  )
  assert FAMILIES["deepseek_v3"].attention is latent_attention_tensors
  assert FAMILIES["gpt_oss"].experts is gpt_oss_expert_tensors
  assert all(f.attention is attention_tensors for k, f in FAMILIES.items() if k != "deepseek_v3")
  assert all(f.experts is expert_tensors for k, f in FAMILIES.items() if k != "gpt_oss")
  names = lambda cfg: [t.name for t in tensor_names(cfg)]
  assert "model.layers.0.self_attn.kv_b_proj.weight" in names(read_config(FIXTURES / "deepseek_v3"))
  assert "model.layers.0.self_attn.qkv_proj.weight" in names(read_config(FIXTURES / "phi3"))
  assert "model.layers.1.mlp.experts.gate_up_proj_bias" in names(read_config(FIXTURES / "gpt_oss"))
  mixtral = read_config(FIXTURES / "mixtral")

  def one_tensor(cfg, family, layer, at, experts_fused):
    yield from ()

  monkeypatch.setitem(FAMILIES, "mixtral", dataclasses.replace(FAMILIES["mixtral"],
                                                               experts=one_tensor))
  assert not any(".experts." in n or ".gate." in n for n in names(mixtral))
  latent_llama = dataclasses.replace(read_config(FIXTURES / "deepseek_v3"), family=None,
                                     num_experts=None, moe_layers=None)
  with pytest.raises(HFConfigError, match="attention is latent .* which llama cannot hold"):
    names(latent_llama)


def test_latent_attention_is_written_only_as_deepseek_v3():
  """A model with latent attention has no other family's config; DeepSeek-V3's fields
  read back (the yarn score scale through mscale_all_dim, q without its latent)."""
  import dataclasses
  cfg = read_config(FIXTURES / "deepseek_v3")
  with pytest.raises(HFConfigError, match="kv_lora_rank=10 has no glm4_moe equivalent"):
    config_to_hf(dataclasses.replace(cfg, family="glm4_moe"))
  written = config_to_hf(cfg)
  assert written["head_dim"] == 4 and written["qk_nope_head_dim"] == 6
  assert config_from_hf(written) == cfg
  plain = read_config(FIXTURES / "deepseek_v3_plain")
  assert plain.q_lora_rank is None and plain.attn_dim == 12 and not plain.rope_interleave
  assert config_from_hf(config_to_hf(plain)) == plain


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_a_2026_family_fine_tunes_resumes_exports_and_generates(tmp_path, capsys, name):
  """``train/run.py --init-from`` a DeepSeek-V3 (auxiliary-loss-free balancing on) or a
  GPT-OSS folder on 2x4 with FSDP, SP and scanned layers, resumed on 1x8 from a copied
  checkpoint, ``train/export.py`` read by transformers to the checkpoint's logits, and
  ``train/generate.py`` from the checkpoint."""
  from helpers import logged_losses

  from train import export, generate as cli
  from train.run import main
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg, folder, flags = fine_tune_folder(tmp_path, name)
  if name == "deepseek_v3":
    flags += ["--router-bias-rate", "0.05"]
  ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
  assert main([*flags, "--mesh", "2x4", "--fsdp", "--sequence-parallel", "--scan-layers",
               "--checkpoint-dir", str(ck),
               "--checkpoint-every", "3", "--metrics-file", str(metrics)]) == 0
  losses = logged_losses(metrics)
  assert len(losses) == 6 and losses[-1] < losses[0]
  moved = tmp_path / "moved"
  moved.mkdir()
  shutil.copytree(ck / "3", moved / "3")
  resumed = tmp_path / "r.jsonl"
  assert main([*flags, "--mesh", "1x8", "--resume",
               "--checkpoint-dir", str(moved), "--metrics-file", str(resumed)]) == 0
  np.testing.assert_allclose(logged_losses(resumed)[0], losses[3], rtol=1e-5)
  out = tmp_path / "exported"
  assert export.main(["--checkpoint", str(moved), "--out", str(out), "--mesh", "2x4"]) == 0
  ours = load_hf(out, flax_tp.make_mesh("1x3"))
  assert ours.cfg == dataclasses.replace(cfg, max_seq_len=ours.cfg.max_seq_len)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      out, attn_implementation="eager", experts_implementation="eager").eval()
  with torch.no_grad():
    expected = theirs(torch.as_tensor(ids)).logits.numpy()
  np.testing.assert_allclose(jax.jit(lambda t: ours(t))(jnp.asarray(ids, jnp.int32)),
                             expected, rtol=1e-4, atol=1e-4)
  capsys.readouterr()
  assert cli.main(["--checkpoint", str(moved), "--mesh", "1x3", "--prompt", "def f(",
                   "--max-new-tokens", "5"]) == 0
  assert capsys.readouterr().out.startswith("def f(")


def test_the_deepseek_v3_preset_is_the_released_config():
  """``TransformerConfig.preset("deepseek-v3")`` (the benchmarks' abstract shapes) is what
  ``config_from_hf`` reads from deepseek-ai/DeepSeek-V3's config.json (its fields as
  released, FP8 quantization_config included)."""
  released = {
      "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
      "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
      "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
      "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
      "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
      "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
      "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
      "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
      "rope_theta": 10000, "attention_bias": False, "num_nextn_predict_layers": 1,
      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                       "type": "yarn"},
      "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                              "quant_method": "fp8", "weight_block_size": [128, 128]}}
  preset = TransformerConfig.preset("deepseek-v3", max_seq_len=163840)
  assert config_from_hf(released) == preset


def test_the_gpt_oss_20b_preset_is_the_released_config():
  """``TransformerConfig.preset("gpt-oss-20b")`` is what ``config_from_hf`` reads from
  openai/gpt-oss-20b's config.json (its fields as released, MXFP4 quantization_config
  included), and holds its 21B params."""
  from bench.harness import param_count
  released = {
      "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "attention_bias": True,
      "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
      "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
      "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
      "layer_types": ["sliding_attention", "full_attention"] * 12,
      "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
      "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
      "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
      "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                       "original_max_position_embeddings": 4096, "rope_type": "yarn",
                       "truncate": False},
      "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
      "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
      "vocab_size": 201088,
      "quantization_config": {"modules_to_not_convert": [
          "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
          "lm_head"], "quant_method": "mxfp4"}}
  preset = TransformerConfig.preset("gpt-oss-20b", max_seq_len=131072)
  assert config_from_hf(released) == preset
  assert round(param_count(preset) / 1e8) == 209  # 20.9B


def test_the_olmo3_7b_preset_reads_back_from_its_config_json():
  """``olmo3-7b`` (shapes for the benchmarks) is an OLMo 3 that ``config_to_hf`` writes
  and ``config_from_hf`` reads back unchanged: 7.3B params at allenai/Olmo-3-1025-7B's
  sizes."""
  from bench.harness import param_count
  preset = TransformerConfig.preset("olmo3-7b")
  assert config_from_hf(config_to_hf(preset)) == preset
  assert round(param_count(preset) / 1e8) == 73


@pytest.mark.slow
def test_the_deepseek_v3_preset_holds_671b_params():
  """The model of the preset (the reference's, from abstract shapes) holds DeepSeek-V3's
  671B params: its attention, experts and shared experts as the release counts them.

  Its 61 layers are 3 dense ones, then 58 alike with experts: the models of the preset
  with the dense layers and one or two expert layers are built (61 layers' 15k modules
  take a minute to build, even abstractly), and the total is the first plus 57 times the
  difference."""
  from bench.harness import param_count
  full = TransformerConfig.preset("deepseek-v3")
  dense = [i for i in range(full.num_layers) if not full.is_moe_layer(i)]
  assert dense == [0, 1, 2] and full.num_layers == 61
  first = param_count(TransformerConfig.preset("deepseek-v3", num_layers=4, moe_layers=(3,)))
  layer = param_count(TransformerConfig.preset("deepseek-v3", num_layers=5,
                                               moe_layers=(3, 4))) - first
  assert round((first + 57 * layer) / 1e9) == 671


@pytest.mark.parametrize("live", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_pad_tokens_row_gets_no_gradient_from_its_lookups(tmp_path, meshes, live):
  """transformers builds every family's embedding with ``padding_idx=pad_token_id``, so a
  batch holding the pad id passes that row no gradient. Read from an HF folder, flax_tp
  does the same (OLMo 3's fixture: pad 0, untied head, so the row's gradient is exactly
  zero; without it, not), on an uneven mesh; ``save_hf`` keeps the pad id. Live: the
  embedding gradient is transformers' own."""
  from models.hf import to_hf_state_dict
  name = "olmo3"
  ids = np.load(FIXTURES / name / "expected.npz")["ids"].copy()
  ids[:, [2, 5]] = 0  # the pad id, inside the rows and as a target

  def embedding_grad(model):
    trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
    tokens = jax.device_put(jnp.asarray(ids, jnp.int32), trainer.batch_sharding)
    _, grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
    return to_hf_state_dict(grads, model.cfg)["model.embed_tokens.weight"]

  model = load_hf(FIXTURES / name, meshes["1x3"])
  assert model.cfg.padding_idx == 0
  ours = embedding_grad(model)
  if not live:
    assert not ours[0].any() and np.abs(ours[1:]).max() > 0
    plain = embedding_grad(load_hf(FIXTURES / name, meshes["1x3"], padding_idx=None))
    assert np.abs(plain[0]).max() > 1e-4
    np.testing.assert_array_equal(ours[1:], plain[1:])
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] == 0
    assert read_config(tmp_path).padding_idx == 0
    return
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      FIXTURES / name, attn_implementation="eager")
  batch = torch.as_tensor(ids)
  theirs(batch, labels=batch).loss.backward()
  expected = theirs.model.embed_tokens.weight.grad.numpy()
  assert not expected[0].any()
  np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-6)
