"""LoRA against peft + transformers themselves on the HF fixtures (Qwen2: 6 query and 2 kv
heads, FFN 38, uneven over 3, 4 and 8): an adapter peft made (random nonzero B; its
outputs stored beside it) gives flax_tp peft's logits, adapter gradients and greedy
continuation; adapters flax_tp writes read in ``peft.PeftModel`` to the same logits,
and merged into the base transformers alone reads them (live: skipped without peft)."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_tp
from models.execution import Execution
from models.generate import generate
from models.hf import load_hf, save_hf
from models.peft import PeftError, load_peft_adapter, merged, read_adapter, save_peft_adapter
from tests.helpers import logical_arrays
from train.step import Trainer, make_optimizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BASE = FIXTURES / "hf" / "qwen2"
MADE = FIXTURES / "peft" / "qwen2_lora"  # made by peft itself: fixtures/peft/make_fixtures.py
IDS = np.random.default_rng(0).integers(0, 67, (4, 11))


def live():
  """peft, transformers and torch, for the tests that run them (skipped without)."""
  return (pytest.importorskip("torch"), pytest.importorskip("transformers"),
          pytest.importorskip("peft"))


def theirs_base(transformers):
  return transformers.AutoModelForCausalLM.from_pretrained(BASE, attn_implementation="eager"
                                                           ).eval()


@pytest.fixture(scope="module")
def peft_made():
  """The adapter peft made: rank 4, alpha 7, rsLoRA, on q, v (column) and down (row),
  init_lora_weights=False so B is random and the adapter changes everything; with
  peft's logits, loss, adapter gradients and greedy continuation."""
  expected = np.load(MADE / "expected.npz")
  assert np.array_equal(expected["ids"], IDS)
  grads = {}
  for key in expected.files:
    if key.startswith("grad:"):
      module, _, part = key[len("grad:"):].rpartition(".lora_")
      grads[(module, part)] = expected[key].T  # torch's [r, in] / [out, r] -> ours
  return MADE, expected["logits"], float(expected["loss"]), grads, expected["generated"]


@pytest.mark.parametrize("mesh_spec,execution", [
    ("2x4", Execution()),
    pytest.param("1x3", Execution(scan_layers=True, sequence_parallel=True),
                 marks=pytest.mark.slow),
    pytest.param("1x1", Execution(), marks=pytest.mark.slow),
    pytest.param("1x8", Execution(fsdp=True), marks=pytest.mark.slow)])
def test_a_peft_adapter_gives_peft_logits_gradients_and_generation(meshes, peft_made,
                                                                   mesh_spec, execution):
  folder, logits, loss, grads, generated = peft_made
  model = load_peft_adapter(BASE, folder, meshes[mesh_spec], execution=execution)
  assert model.lora.rank == 4 and model.lora.rslora and model.lora.scaling == 7 / 2
  assert len(model.lora_targets) == 3 * 2
  np.testing.assert_allclose(model(jnp.asarray(IDS)), logits, rtol=1e-5, atol=1e-5)
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
  tokens = jax.device_put(jnp.asarray(IDS), trainer.batch_sharding)
  ours_loss, ours = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  np.testing.assert_allclose(ours_loss, loss, rtol=1e-5)
  from models.peft import module_names
  names = module_names(model.cfg)
  ours = logical_arrays(ours)
  assert len(ours) == len(grads)
  for target in model.lora_targets:
    for part, name in (("A", "lora_a"), ("B", "lora_b")):
      theirs = grads[(names[target], part)]
      np.testing.assert_allclose(ours[f"{target}.{name}"], theirs, rtol=1e-4,
                                 atol=1e-5 * np.abs(theirs).max(), err_msg=target)
  out = generate(model, IDS[:2, :5], max_new_tokens=8)
  np.testing.assert_array_equal(out, generated)


@pytest.mark.parametrize("mesh_spec", ["2x4", pytest.param("1x8", marks=pytest.mark.slow)])
def test_flax_tp_adapters_read_in_peft_and_merge_for_transformers(tmp_path, meshes, mesh_spec):
  """Adapters on every projection, B random: the PEFT folder flax_tp writes reads in
  ``PeftModel.from_pretrained`` to flax_tp's logits; merged and saved with ``save_hf``,
  transformers alone reads the same logits; the round trip back is exact."""
  torch, transformers, peft = live()
  lora = flax_tp.LoRAConfig(rank=3, alpha=5.0, init_weights=False,
                            targets=("blocks.*.attn.[qkvo]", "blocks.*.mlp.*"))
  model = load_hf(BASE, meshes[mesh_spec], lora=lora)
  ours = np.asarray(model(jnp.asarray(IDS)))
  with pytest.raises(ValueError, match="has LoRA adapters"):
    save_hf(model, tmp_path / "refused")
  modules = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(BASE))
  assert "model.layers.1.mlp.down_proj" in modules and len(modules) == 14
  theirs = peft.PeftModel.from_pretrained(theirs_base(transformers), tmp_path / "adapter"
                                          ).eval()
  with torch.no_grad():
    np.testing.assert_allclose(theirs(torch.as_tensor(IDS)).logits.numpy(), ours, rtol=1e-5,
                               atol=1e-5)
  save_hf(merged(model), tmp_path / "merged")
  alone = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  with torch.no_grad():
    np.testing.assert_allclose(alone(torch.as_tensor(IDS)).logits.numpy(), ours, rtol=1e-5,
                               atol=1e-5)
  again = load_peft_adapter(BASE, tmp_path / "adapter", meshes["1x3"])
  want = logical_arrays(nnx.state(model, nnx.LoRAParam))
  got = logical_arrays(nnx.state(again, nnx.LoRAParam))
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


def test_what_is_not_plain_lora_is_refused_by_name(tmp_path, peft_made):
  import json
  import shutil

  from models.hf import read_config
  cfg = read_config(BASE)
  folder = tmp_path / "a"
  shutil.copytree(peft_made[0], folder)
  config = json.loads((folder / "adapter_config.json").read_text())
  for key, value, message in (("use_dora", True, "use_dora True is not plain LoRA"),
                              ("bias", "all", "bias 'all' is not plain LoRA"),
                              ("lora_dropout", 0.1, "lora_dropout 0.1")):
    (folder / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(PeftError, match=message):
      read_adapter(folder, cfg)
  (folder / "adapter_config.json").write_text(json.dumps(config))
  from safetensors.numpy import load_file, save_file
  tensors = load_file(folder / "adapter_model.safetensors")
  tensors["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 24),
                                                                                      np.float32)
  save_file(tensors, folder / "adapter_model.safetensors")
  with pytest.raises(PeftError, match="layers.7.self_attn.q_proj.lora_A.weight' adapts no"):
    read_adapter(folder, cfg)


def test_a_config_is_read_by_what_it_means(tmp_path, peft_made):
  """Every field that changes what peft computes or which layers it adapts is refused by
  name unless plain (aLoRA, excluded modules, layer replication, a fractional r, a field
  flax_tp does not know, PiSSA's init); target_modules is honoured as peft matches it:
  tensors it does not reach (peft ignores them) and layers it reaches with no tensors
  (peft draws them) are refused, a regex reaching exactly the tensors' layers reads as the
  list does. A config that is no object or lacks r or lora_alpha, and a weights file cut
  short, empty or garbage, are PeftErrors naming the file."""
  import json
  import shutil

  from models.hf import read_config
  cfg = read_config(BASE)
  folder = tmp_path / "a"
  shutil.copytree(peft_made[0], folder)
  path = folder / "adapter_config.json"
  config = json.loads(path.read_text())
  _, plain = read_adapter(folder, cfg)

  def refused(changes, message, drop=()):
    edited = {k: v for k, v in {**config, **changes}.items() if k not in drop}
    path.write_text(json.dumps(edited))
    with pytest.raises(PeftError, match=message):
      read_adapter(folder, cfg)

  refused({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens \\[1, 2\\] is not plain")
  refused({"exclude_modules": ["model.layers.0.self_attn.q_proj"]}, "exclude_modules")
  refused({"layer_replication": [[0, 1]]}, "layer_replication")
  refused({"r": 4.7}, "r 4.7 is not a positive integer")
  refused({"r": True}, "r True is not a positive integer")
  refused({"lora_alpha": "7"}, "lora_alpha '7' is not a positive number")
  refused({"use_dora": 0}, "use_dora 0 is not plain")  # 0 == False, but not a bool
  refused({"init_lora_weights": "pissa"}, "init_lora_weights 'pissa'")
  refused({"a_later_peft_field": 1}, "field 'a_later_peft_field' is not one flax_tp knows")
  refused({"target_modules": ["q_proj", "v_proj"]},
          "mlp.down_proj.lora_[AB].weight' adapts model.layers.[01].mlp.down_proj, which")
  refused({"target_modules": ["q_proj", "v_proj", "down_proj", "k_proj"]},
          "reaches model.layers.0.self_attn.k_proj, for which")
  refused({"target_modules": "all-linear"}, "reaches model.layers.0.mlp.gate_proj")
  refused({}, "has no 'r'", drop=("r",))
  refused({}, "has no 'lora_alpha'", drop=("lora_alpha",))
  path.write_text(json.dumps([config]))
  with pytest.raises(PeftError, match="holds a JSON list, not an object"):
    read_adapter(folder, cfg)
  path.write_text(json.dumps({**config, "target_modules": r".*\.(q_proj|v_proj|down_proj)"}))
  _, by_regex = read_adapter(folder, cfg)
  assert set(by_regex) == set(plain)
  for target, (a, b) in plain.items():
    np.testing.assert_array_equal(by_regex[target][0], a)
    np.testing.assert_array_equal(by_regex[target][1], b)
  path.write_text(json.dumps(config))
  weights = folder / "adapter_model.safetensors"
  whole = weights.read_bytes()
  for broken in (whole[:len(whole) // 2], b"", b"not safetensors at all"):
    weights.write_bytes(broken)
    with pytest.raises(PeftError, match="adapter_model.safetensors cannot be read"):
      read_adapter(folder, cfg)


@pytest.mark.slow
def test_a_new_user_fine_tunes_with_lora_resumes_exports_and_peft_reads_it(tmp_path, capsys):
  """README's path: ``train/run.py --init-from`` a Qwen2 folder with LoRA on 2x4 (FSDP and
  remat too), resumed on 1x8 from a copied checkpoint that holds the adapters alone,
  ``train/export.py`` of the adapter, which ``peft.PeftModel.from_pretrained`` reads to
  the logits of the checkpoint's model, and ``--merge``, which transformers reads alone
  to the same logits; ``train/generate.py --hf --adapter`` continues a prompt."""
  torch, transformers, peft = live()
  from helpers import fine_tune_folder, logged_losses

  import flax_tp
  from train import export, generate as cli
  from train.run import main
  cfg, folder, flags = fine_tune_folder(tmp_path, "qwen2")
  lora = ["--lora-rank", "4", "--lora-alpha", "8",
          "--lora-targets", "blocks.*.attn.[qkvo],blocks.*.mlp.*"]
  ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
  assert main([*flags, *lora, "--mesh", "2x4", "--fsdp", "--remat", "block",
               "--checkpoint-dir", str(ck), "--checkpoint-every", "3",
               "--metrics-file", str(metrics)]) == 0
  assert "lora: rank 4, alpha / rank = 2, on 14 layers" in capsys.readouterr().out
  losses = logged_losses(metrics)
  assert len(losses) == 6 and losses[-1] < losses[0]
  moved = tmp_path / "moved"
  moved.mkdir()
  shutil.copytree(ck / "3", moved / "3")
  held = sum(f.stat().st_size for f in (moved / "3").glob("shards.*.bin"))
  resumed = tmp_path / "r.jsonl"
  assert main([*flags, *lora, "--mesh", "1x8", "--resume", "--checkpoint-dir", str(moved),
               "--metrics-file", str(resumed)]) == 0
  np.testing.assert_allclose(logged_losses(resumed)[0], losses[3], rtol=1e-5)
  assert main([*flags, "--lora-rank", "8", "--mesh", "1x8", "--resume", "--checkpoint-dir",
               str(moved)]) == 2  # other adapters than the run's: refused, naming them
  assert "lora.rank 4 there, 8 here" in capsys.readouterr().err

  out = tmp_path / "adapter"
  assert export.main(["--checkpoint", str(moved), "--out", str(out), "--mesh", "2x4"]) == 0
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 12))
  args = type("Args", (), dict(checkpoint=str(moved), step=None, dtype=None))()
  ours, _, _ = cli.load_from_checkpoint(args, flax_tp.make_mesh("1x3"))
  expected = np.asarray(jax.jit(lambda t: ours(t))(jnp.asarray(ids, jnp.int32)))
  adapters = sum(v.size for v in jax.tree.leaves(flax_tp.unshard(nnx.state(ours,
                                                                            nnx.LoRAParam))))
  # the adapters and their two Adam moments in float32 (and a few scalars): no base weight
  assert 3 * 4 * adapters <= held <= 3 * 4 * adapters + 64
  theirs = peft.PeftModel.from_pretrained(
      transformers.AutoModelForCausalLM.from_pretrained(folder), out).eval()
  with torch.no_grad():
    np.testing.assert_allclose(theirs(torch.as_tensor(ids)).logits.numpy(), expected,
                               rtol=1e-4, atol=1e-4)
  capsys.readouterr()
  assert cli.main(["--hf", str(folder), "--adapter", str(out), "--mesh", "2x4", "--prompt",
                   "def f(", "--max-new-tokens", "5"]) == 0
  assert capsys.readouterr().out.startswith("def f(")
  merged_out = tmp_path / "merged"
  assert export.main(["--checkpoint", str(moved), "--out", str(merged_out), "--merge"]) == 0
  alone = transformers.AutoModelForCausalLM.from_pretrained(merged_out).eval()
  with torch.no_grad():
    np.testing.assert_allclose(alone(torch.as_tensor(ids)).logits.numpy(), expected,
                               rtol=1e-4, atol=1e-4)

  # The base's weights replaced under the same name: the adapters are not its.
  from safetensors.numpy import load_file, save_file
  weights = load_file(folder / "model.safetensors")
  weights["model.norm.weight"] = weights["model.norm.weight"] * 2
  save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
  capsys.readouterr()
  assert main([*flags, *lora, "--mesh", "1x8", "--resume", "--checkpoint-dir", str(moved),
               "--steps", "7"]) == 2
  assert "lora_base_sha256" in capsys.readouterr().err
  assert export.main(["--checkpoint", str(moved), "--out", str(tmp_path / "again")]) == 2
  assert "weights changed since" in capsys.readouterr().err


def test_lora_on_latent_attention_reads_in_peft(tmp_path, meshes):
  """DeepSeek-V3's attention (the transformers-made fixture): adapters on its parallel
  projections (q_b, kv_b, o), B random, read in ``peft.PeftModel`` to flax_tp's logits on
  2x4; q_b's interleaved rotary rows (held half-split) go back to the checkpoint's order
  in B, and come back exactly."""
  torch, transformers, peft = live()
  base = FIXTURES / "hf" / "deepseek_v3"
  lora = flax_tp.LoRAConfig(rank=3, alpha=5.0, init_weights=False,
                            targets=("blocks.*.attn.q_b", "blocks.*.attn.kv_b",
                                     "blocks.*.attn.o"))
  model = load_hf(base, meshes["2x4"], lora=lora)
  ids = IDS % model.cfg.vocab_size
  ours = np.asarray(model(jnp.asarray(ids)))
  modules = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base))
  assert "model.layers.1.self_attn.q_b_proj" in modules and len(modules) == 6
  plain = transformers.AutoModelForCausalLM.from_pretrained(
      base, attn_implementation="eager", experts_implementation="eager").eval()
  theirs = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
  with torch.no_grad():
    np.testing.assert_allclose(theirs(torch.as_tensor(ids)).logits.numpy(), ours, rtol=1e-5,
                               atol=1e-5)
  again = load_peft_adapter(base, tmp_path / "adapter", meshes["1x3"])
  want = logical_arrays(nnx.state(model, nnx.LoRAParam))
  got = logical_arrays(nnx.state(again, nnx.LoRAParam))
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


def test_lora_on_gpt_oss_attention_reads_in_peft(tmp_path, meshes):
  """GPT-OSS (the transformers-made fixture: sinks, biased q/k/v/o, sliding and full
  layers, biased clamped experts): adapters on its biased attention projections, B random,
  read in ``peft.PeftModel`` to flax_tp's logits on 2x4, and back exactly on 1x3."""
  torch, transformers, peft = live()
  base = FIXTURES / "hf" / "gpt_oss"
  lora = flax_tp.LoRAConfig(rank=3, alpha=5.0, init_weights=False,
                            targets=("blocks.*.attn.q", "blocks.*.attn.v", "blocks.*.attn.o"))
  model = load_hf(base, meshes["2x4"], lora=lora)
  ids = IDS % model.cfg.vocab_size
  ours = np.asarray(model(jnp.asarray(ids)))
  modules = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base))
  assert "model.layers.1.self_attn.o_proj" in modules
  assert len(modules) == 3 * model.cfg.num_layers
  plain = transformers.AutoModelForCausalLM.from_pretrained(
      base, attn_implementation="eager", experts_implementation="eager").eval()
  theirs = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
  with torch.no_grad():
    np.testing.assert_allclose(theirs(torch.as_tensor(ids)).logits.numpy(), ours, rtol=1e-5,
                               atol=1e-5)
  again = load_peft_adapter(base, tmp_path / "adapter", meshes["1x3"])
  want = logical_arrays(nnx.state(model, nnx.LoRAParam))
  got = logical_arrays(nnx.state(again, nnx.LoRAParam))
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
