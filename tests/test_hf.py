"""HuggingFace Llama / Qwen2 checkpoints against transformers itself.

The default run compares with fixtures that transformers wrote and computed
(tests/fixtures/hf/make_fixtures.py); with the ``hf`` extra installed, live
tests compare with transformers on random configs too.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import logged_losses

import flax_tp
from models.execution import Execution
from models.hf import HFConfigError, config_from_hf, load_hf, save_hf, to_hf_state_dict
from train.step import Trainer, make_optimizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"


def loss_and_hf_grads(model, ids):
  """Mean next-token loss of ``ids [b, s]`` and its gradients, by HF name (labels=ids)."""
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
  tokens = jax.device_put(jnp.asarray(ids, jnp.int32), trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  return float(loss), to_hf_state_dict(grads, model.cfg)


@pytest.mark.parametrize("name,mesh_spec,scan_layers", [
    # (one device and 1x8: the slow lane)
    pytest.param("llama", "1x1", False, marks=pytest.mark.slow), ("llama", "2x4", False),
    pytest.param("llama", "1x8", False, marks=pytest.mark.slow),
    ("llama", "1x3", False), ("qwen2", "2x4", False), ("qwen2", "1x3", True)])
def test_fixture_logits_loss_and_grads(meshes, name, mesh_spec, scan_layers):
  """Stored transformers results; 2 kv heads over 4, 8 and 3 devices are replicated.
  With ``scan_layers`` the blocks' params are loaded into (and their gradients
  exported from) one stacked module."""
  expected = np.load(FIXTURES / name / "expected.npz")
  model = load_hf(FIXTURES / name, meshes[mesh_spec],
                  execution=Execution(scan_layers=scan_layers))
  assert model.execution.scan_layers == scan_layers
  ids = expected["ids"]
  logits = jax.jit(lambda t: model(t))(jnp.asarray(ids, jnp.int32))
  np.testing.assert_allclose(logits, expected["logits"], rtol=1e-5, atol=1e-5)
  loss, grads = loss_and_hf_grads(model, ids)
  np.testing.assert_allclose(loss, expected["loss"], rtol=1e-6)
  hf_grads = {k[len("grad:"):]: expected[k] for k in expected.files if k.startswith("grad:")}
  assert set(hf_grads) <= set(grads) and set(grads) - set(hf_grads) <= {"lm_head.weight"}
  for key, value in hf_grads.items():
    np.testing.assert_allclose(grads[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_save_hf_round_trip(tmp_path, meshes, name):
  """save_hf writes what load_hf (and transformers, below) reads back: same tensors
  (Qwen2's through stacked blocks)."""
  from safetensors.numpy import load_file
  model = load_hf(FIXTURES / name, meshes["2x4"],
                  execution=Execution(scan_layers=name == "qwen2"))
  save_hf(model, tmp_path)
  original = {k: v for k, v in load_file(FIXTURES / name / "model.safetensors").items()}
  written = load_file(tmp_path / "model.safetensors")
  assert set(written) == set(original)
  for key, value in original.items():
    np.testing.assert_array_equal(written[key], value)
  written_cfg = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
  assert written_cfg.identity() == model.cfg.identity()


def _sharded_copy(source, folder):
  """``source``'s checkpoint as HF writes a big one: two files and an index."""
  from safetensors.numpy import load_file, save_file
  tensors = load_file(source / "model.safetensors")
  names = sorted(tensors)
  parts = {"model-00001-of-00002.safetensors": names[::2],
           "model-00002-of-00002.safetensors": names[1::2]}
  for file, keys in parts.items():
    save_file({k: tensors[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}))
  shutil.copy(source / "config.json", folder)
  return tensors


def test_sharded_checkpoint_folder_loads_the_same(tmp_path, meshes):
  """The ``model.safetensors.index.json`` form (several files) gives the same model."""
  _sharded_copy(FIXTURES / "llama", tmp_path)
  one = load_hf(FIXTURES / "llama", meshes["1x3"])
  two = load_hf(tmp_path, meshes["1x3"])
  for a, b in zip(jax.tree.leaves(flax_tp.unshard(one)), jax.tree.leaves(flax_tp.unshard(two)),
                  strict=True):
    np.testing.assert_array_equal(a, b)


def test_save_hf_never_leaves_two_models_in_a_folder(tmp_path, meshes):
  """save_hf refuses a folder holding a sharded checkpoint (it would stay beside the new
  file, and was read first); a folder holding both forms is read as transformers reads it."""
  from safetensors.numpy import save_file
  sharded = tmp_path / "sharded"
  sharded.mkdir()
  tensors = _sharded_copy(FIXTURES / "llama", sharded)
  before = {p.name: p.read_bytes() for p in sharded.iterdir()}
  model = load_hf(FIXTURES / "llama", meshes["1x2"], seed=0)
  with pytest.raises(FileExistsError, match="holds a sharded checkpoint "
                     r"\(model.safetensors.index.json\)"):
    save_hf(model, sharded)
  assert {p.name: p.read_bytes() for p in sharded.iterdir()} == before
  # Both forms in one folder: model.safetensors wins, as in transformers' loader.
  changed = {k: v + 1.0 for k, v in tensors.items()}
  save_file(changed, str(sharded / "model.safetensors"), metadata={"format": "pt"})
  loaded = to_hf_state_dict(nnx.state(load_hf(sharded, meshes["1x2"]), nnx.Param),
                            model.cfg)
  for key, value in loaded.items():
    np.testing.assert_array_equal(value, changed[key], err_msg=key)


def test_a_tied_config_with_its_own_head_is_kept_apart_like_transformers(tmp_path, meshes):
  """tie_word_embeddings: true, but the file's lm_head differs from the embedding:
  transformers 5 keeps them apart (with a warning), so flax_tp does; its stored logits
  (computed by transformers on the untied model) are matched."""
  folder = tmp_path / "tied"
  shutil.copytree(FIXTURES / "llama", folder)
  config = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
  with pytest.warns(UserWarning, match="tie_word_embeddings: true, but .* kept apart"):
    model = load_hf(folder, meshes["2x4"])
  assert not model.cfg.tie_embeddings
  expected = np.load(FIXTURES / "llama" / "expected.npz")
  logits = jax.jit(lambda t: model(t))(jnp.asarray(expected["ids"], jnp.int32))
  np.testing.assert_allclose(logits, expected["logits"], rtol=1e-5, atol=1e-5)
  # A head equal to the embedding (some exporters write both) stays tied, with no warning.
  from safetensors.numpy import load_file, save_file
  tensors = load_file(folder / "model.safetensors")
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
  save_file(tensors, str(folder / "model.safetensors"))
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert load_hf(folder, meshes["1x2"]).cfg.tie_embeddings


def _break(folder, how):
  weights, config = folder / "model.safetensors", folder / "config.json"
  if how == "empty":
    weights.write_bytes(b"")
  elif how == "truncated":
    weights.write_bytes(weights.read_bytes()[:-100])
  elif how == "corrupt header":
    raw = bytearray(weights.read_bytes())
    raw[8:16] = b"\xff" * 8
    weights.write_bytes(bytes(raw))
  elif how == "config not an object":
    config.write_text("[1, 2]")
  else:  # a field set to a bad value
    field, value = how
    config.write_text(json.dumps({**json.loads(config.read_text()), field: value}))
  return weights if how in ("empty", "truncated", "corrupt header") else config


@pytest.mark.parametrize("how,message", [
    ("empty", "is not a readable safetensors file"),
    ("truncated", "safetensors"),
    ("corrupt header", "is not a readable safetensors file"),
    ("config not an object", "config.json holds a list, not an object of fields"),
    (("vocab_size", float("nan")), "field 'vocab_size' is nan; expected a positive integer"),
    (("hidden_size", -24), "field 'hidden_size' is -24; expected a positive integer"),
    (("num_attention_heads", "6"), "field 'num_attention_heads' is '6'"),
    (("rms_norm_eps", -1e-6), "field 'rms_norm_eps' is -1e-06; expected a positive finite"),
    (("tie_word_embeddings", "false"), "field 'tie_word_embeddings' is 'false'; expected true"),
])
def test_broken_hf_folders_are_named(tmp_path, meshes, how, message):
  folder = tmp_path / "m"
  shutil.copytree(FIXTURES / "llama", folder)
  named = _break(folder, how)
  with pytest.raises(HFConfigError) as err:
    load_hf(folder, meshes["1x2"])
  text = str(err.value)
  assert "\n" not in text and message in text and str(named) in text, text


@pytest.mark.parametrize("change,field", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters rope_type 'longrope'"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"sliding_attention": {"rope_theta": 1e4}}}, "per layer type"),
])
def test_configs_it_cannot_honour_are_named(change, field):
  config = json.loads((FIXTURES / "qwen2" / "config.json").read_text())
  with pytest.raises(HFConfigError, match=field):
    config_from_hf({**config, **change})


# -- live, against transformers (pip install -e ".[hf]") ------------------------------

LIVE = dict(vocab_size=61, hidden_size=16, intermediate_size=22, num_hidden_layers=2,
            num_attention_heads=4, head_dim=4, max_position_embeddings=16)


@pytest.mark.parametrize("kind,extra,mesh_spec", [
    pytest.param("llama", dict(num_key_value_heads=1, tie_word_embeddings=True), "1x8",
                 marks=pytest.mark.slow),  # MQA (fast: gemma's fixture, one kv head on 1x8)
    ("llama", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True), "2x4"),
    ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=False), "1x3"),
])
def test_live_against_transformers(tmp_path, meshes, kind, extra, mesh_spec):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  config_cls, model_cls = ((transformers.LlamaConfig, transformers.LlamaForCausalLM)
                           if kind == "llama" else
                           (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
  hf_model = model_cls(config_cls(**LIVE, **extra)).eval()
  with torch.no_grad():
    for n, p in hf_model.named_parameters():
      if n.endswith("bias"):
        p.normal_(0.0, 0.5)
  hf_model.save_pretrained(tmp_path / "in")
  ids = torch.randint(0, LIVE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))
  out = hf_model(ids, labels=ids)
  out.loss.backward()

  model = load_hf(tmp_path / "in", meshes[mesh_spec])
  logits = jax.jit(lambda t: model(t))(jnp.asarray(ids.numpy(), jnp.int32))
  np.testing.assert_allclose(logits, out.logits.detach().numpy(), rtol=1e-5, atol=1e-5)
  loss, grads = loss_and_hf_grads(model, ids.numpy())
  np.testing.assert_allclose(loss, out.loss.item(), rtol=1e-6)
  for n, p in hf_model.named_parameters():
    np.testing.assert_allclose(grads[n], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)

  # generate(do_sample=False): each prompt alone in transformers, one ragged batch here.
  from models.generate import generate
  prompts = [ids[0, :7].tolist(), ids[1, :4].tolist()]
  ours = generate(model, prompts, max_new_tokens=8,
                  eos_id=hf_model.generation_config.eos_token_id)
  for row, prompt in enumerate(prompts):
    p = torch.tensor([prompt])
    theirs = hf_model.generate(p, attention_mask=torch.ones_like(p), do_sample=False,
                               max_new_tokens=8, pad_token_id=0)[0].numpy()
    expected = np.zeros(len(prompt) + 8, np.int64)
    expected[:len(theirs)] = theirs  # transformers stops at eos; generate pads with 0
    np.testing.assert_array_equal(ours[row, :len(prompt) + 8], expected)

  save_hf(model, tmp_path / "out")
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  with torch.no_grad():
    np.testing.assert_array_equal(again(ids).logits.numpy(), hf_model(ids).logits.numpy())


def test_unsupported_layout_is_refused_on_export(meshes):
  from models.config import TransformerConfig
  from models.transformer import Transformer
  model = Transformer(TransformerConfig.tiny(num_layers=1), mesh=meshes["1x2"],
                      rngs=nnx.Rngs(0))
  with pytest.raises(HFConfigError, match="norm='layernorm'"):
    save_hf(model, "/nonexistent/never-written")
  assert flax_tp.make_mesh("1x1")  # the library stays usable after the error


# -- train/run.py --init-from ------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
  """A tiny Llama-style HF folder with its own BPE tokenizer, trained here on real Python."""
  from helpers import bpe_tokenizer, write_small_corpus

  from models.config import TransformerConfig
  from models.transformer import Transformer
  root = tmp_path_factory.mktemp("hf")
  corpus = write_small_corpus(root / "corpus.py")
  tokenizer = bpe_tokenizer(corpus)
  cfg = TransformerConfig.preset("llama-tiny", vocab_size=tokenizer.get_vocab_size() + 5)
  model = Transformer(cfg, mesh=flax_tp.make_mesh("1x1"), rngs=nnx.Rngs(3))
  save_hf(model, root / "model")
  tokenizer.save(str(root / "model" / "tokenizer.json"))
  return root / "model", corpus


@pytest.mark.slow
def test_init_from_fine_tunes_then_resumes_on_another_mesh(tmp_path, hf_folder, capsys):
  from train.run import main
  folder, corpus = hf_folder
  ck = tmp_path / "ck"
  flags = ["--init-from", str(folder), "--batch-size", "8", "--seq-len", "16", "--steps", "8",
           "--lr", "1e-2", "--warmup-steps", "1", "--eval-every", "0", "--sample-length", "5",
           "--data", corpus]
  metrics = tmp_path / "m.jsonl"
  assert main([*flags, "--mesh", "2x4", "--checkpoint-dir", str(ck), "--checkpoint-every",
               "4", "--metrics-file", str(metrics)]) == 0
  out = capsys.readouterr().out
  assert f"model: from {str(folder)!r}" in out and "tokens (hf-" in out
  losses = logged_losses(metrics)
  assert len(losses) == 8 and losses[-1] < losses[0] - 0.5  # it learns
  moved = tmp_path / "moved"
  moved.mkdir()
  shutil.copytree(ck / "4", moved / "4")
  resumed = tmp_path / "r.jsonl"
  assert main([*flags, "--mesh", "1x8", "--resume", "--checkpoint-dir", str(moved),
               "--metrics-file", str(resumed)]) == 0
  again = logged_losses(resumed)
  # The restore is exact (the first resumed loss); after it, Adam at lr 1e-2 amplifies
  # the other mesh's summation order (kv-gradient sums over 8 instead of 4 devices).
  np.testing.assert_allclose(again[0], losses[4], rtol=1e-6)
  np.testing.assert_allclose(again, losses[4:], rtol=1e-3)
  # train/generate.py finds the run's tokenizer through the --init-from folder.
  from train import generate as cli
  capsys.readouterr()
  assert cli.main(["--checkpoint", str(moved), "--mesh", "1x3", "--prompt", "def f(",
                   "--max-new-tokens", "6"]) == 0
  out = capsys.readouterr()
  assert out.out.startswith("def f(") and "6 tokens on mesh 1x3" in out.err


def test_generate_cli_streams_an_hf_folder(hf_folder, capsys):
  """train/generate.py --hf on 2x4 prints what generate() gives on 1x1, through the
  folder's tokenizer.json."""
  from models.generate import generate
  from train import generate as cli
  from train.data import HFTokenizer
  from train.hf_folder import eos_ids
  folder, _ = hf_folder
  assert cli.main(["--hf", str(folder), "--mesh", "2x4", "--prompt", "def f(x):",
                   "--max-new-tokens", "8"]) == 0
  out = capsys.readouterr().out
  tokenizer = HFTokenizer(folder / "tokenizer.json")
  prompt = tokenizer.encode(b"def f(x):", special_tokens=True).tolist()
  model = load_hf(folder, flax_tp.make_mesh("1x1"))
  new = generate(model, [prompt], max_new_tokens=8, eos_id=eos_ids(folder))
  assert out == "def f(x):" + tokenizer.decode(new[0, len(prompt):]) + "\n"


def test_init_from_bad_folders_exit_2(tmp_path, hf_folder, capsys):
  from train.run import main
  folder, corpus = hf_folder
  base = ["--batch-size", "8", "--seq-len", "16", "--steps", "1", "--data", corpus]
  no_tokenizer = tmp_path / "no_tok"
  shutil.copytree(folder, no_tokenizer)
  (no_tokenizer / "tokenizer.json").unlink()
  big_vocab = tmp_path / "big"
  shutil.copytree(folder, big_vocab)
  config = json.loads((big_vocab / "config.json").read_text())
  (big_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
  empty_weights = tmp_path / "empty"
  shutil.copytree(folder, empty_weights)
  (empty_weights / "model.safetensors").write_bytes(b"")
  nan_config = tmp_path / "nan"
  shutil.copytree(folder, nan_config)
  (nan_config / "config.json").write_text(json.dumps({**config, "rope_theta": float("nan")}))
  for argv, message in [
      (["--init-from", str(empty_weights)], "model.safetensors' is not a readable safetensors"),
      (["--init-from", str(nan_config)], "field 'rope_theta' is nan"),
      (["--init-from", str(no_tokenizer)], "has no tokenizer.json"),
      (["--init-from", str(big_vocab)], "more than the model's vocab_size 100"),
      (["--init-from", str(folder), "--preset", "tiny"], "--preset and --init-from"),
      (["--init-from", str(tmp_path)], "not a HuggingFace model folder"),
  ]:
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_init_from_a_checkpoint_missing_a_tensor_exits_2(tmp_path, hf_folder, capsys):
  from safetensors.numpy import load_file, save_file

  from train.run import main
  folder, corpus = hf_folder
  broken = tmp_path / "broken"
  shutil.copytree(folder, broken)
  tensors = load_file(broken / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(broken / "model.safetensors"))
  assert main(["--init-from", str(broken), "--batch-size", "8", "--seq-len", "16", "--steps",
               "1", "--data", corpus]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "lacks tensor 'model.layers.1.mlp.up_proj.weight'" in err
