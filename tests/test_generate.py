"""Generation with the sharded KV cache: against transformers' generate, against
recomputing the whole sequence, across meshes, and its compiled communication."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_tp
from flax_tp import hlo
from models.config import TransformerConfig
from models.execution import Execution
from models.generate import Sampling, decoder_for, generate, stream
from models.hf import load_hf
from models.transformer import Transformer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
PROMPTS = [[5, 17, 200, 3, 9, 44, 12, 250, 1], [7, 8, 9, 60]]  # lengths 9 and 4


@pytest.mark.parametrize("name,mesh_spec,options", [
    # (one device, 1x8 and 2x4: the slow lane)
    pytest.param("llama", "1x1", {}, marks=pytest.mark.slow), ("llama", "1x3", {}),
    pytest.param("llama", "1x8", {}, marks=pytest.mark.slow),
    pytest.param("llama", "2x4", {}, marks=pytest.mark.slow),
    ("qwen2", "1x3", dict(scan_layers=True, sequence_parallel=True))])
def test_greedy_equals_transformers_generate(meshes, name, mesh_spec, options):
  """transformers' generate(do_sample=False) on each prompt alone (stored by
  make_fixtures.py) equals one batched call with prompts of different lengths.
  A model set up for training's memory options (stacked blocks, SP) decodes too."""
  expected = np.load(FIXTURES / name / "generate.npz")
  ids = np.load(FIXTURES / name / "expected.npz")["ids"]
  model = load_hf(FIXTURES / name, meshes[mesh_spec], execution=Execution(**options))
  eos = int(expected["eos_id"])
  out = generate(model, ids, lengths=expected["lengths"], max_new_tokens=16,
                 eos_id=None if eos < 0 else eos)
  np.testing.assert_array_equal(out, expected["ids"])


def recompute_greedy(model, prompt, new_tokens, window):
  """Greedy decoding the slow way: the whole sequence through the model per token."""
  forward = jax.jit(lambda t: model(t))
  rows = model.mesh.shape[flax_tp.DATA_AXIS]
  ids = list(prompt)
  for _ in range(new_tokens):
    tokens = np.zeros((rows, window), np.int32)
    tokens[:, :len(ids)] = ids  # causal: what follows position len-1 cannot change it
    ids.append(int(jnp.argmax(forward(jnp.asarray(tokens))[0, len(ids) - 1])))
  return ids


@pytest.mark.parametrize("preset,mesh_spec", [
    ("tiny", "1x3"),  # multi-head, 6 heads over 3
    ("llama-tiny", "1x2"),  # each device's query heads are whole groups of its kv head
    ("llama-tiny", "2x4"),  # kv heads replicated across group boundaries
])
def test_cached_decoding_equals_recomputation(meshes, preset, mesh_spec):
  cfg = TransformerConfig.preset(preset, max_seq_len=32)
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0))
  out = generate(model, PROMPTS, max_new_tokens=12)
  for row, prompt in enumerate(PROMPTS):
    expected = recompute_greedy(model, prompt, 12, cfg.max_seq_len)
    np.testing.assert_array_equal(out[row, :len(expected)], expected)
    assert (out[row, len(expected):] == 0).all()  # the shorter row's tail is padding


def test_sampling_is_the_same_on_every_mesh():
  cfg = TransformerConfig.preset("llama-tiny", max_seq_len=32)
  runs = {}
  for spec in ("1x1", "1x4", "2x4"):
    model = Transformer(cfg, mesh=flax_tp.make_mesh(spec), rngs=nnx.Rngs(0))
    runs[spec] = generate(model, PROMPTS, max_new_tokens=12, seed=7, temperature=0.8,
                          top_k=20, top_p=0.9)
  np.testing.assert_array_equal(runs["1x4"], runs["1x1"])
  np.testing.assert_array_equal(runs["2x4"], runs["1x1"])
  assert not np.array_equal(runs["1x1"], generate(model, PROMPTS, max_new_tokens=12))


@pytest.mark.parametrize("preset,mesh_spec,options", [
    ("llama-tiny", "1x3x2", {}),  # 16-token prompt bucket over 2C = 6 chunks: padded
    pytest.param("llama-tiny", "2x2x2", dict(context_parallel="ring", scan_layers=True),
                 marks=pytest.mark.slow),
    pytest.param("moe-tiny", "1x4x2", dict(sequence_parallel=True), marks=pytest.mark.slow),
    # the experts over data x context: the prompt's tokens dispatched over both; a decode
    # step's tokens, the same on each context device, run through each one's experts
    pytest.param("moe-tiny", "2x2x2", dict(expert_axes=("data", "context")),
                 marks=pytest.mark.slow),
])
def test_a_prompt_split_over_context_generates_as_one_device(preset, mesh_spec, options):
  """The prefill split over "context" (each device its chunks, the cache gathered
  whole), then decoding: greedy and sampled tokens equal one device's for prompts of
  different lengths, and the compiled prefill holds each block's k and v all-gathered
  over "context"."""
  cfg = TransformerConfig.preset(preset, max_seq_len=32)
  mesh = flax_tp.make_mesh(mesh_spec)
  one = Transformer(cfg, mesh=flax_tp.make_mesh("1x1"), rngs=nnx.Rngs(0))
  model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0), execution=Execution(**options))
  for kwargs in (dict(), dict(seed=3, temperature=0.8, top_k=20)):
    np.testing.assert_array_equal(generate(model, PROMPTS, max_new_tokens=10, **kwargs),
                                  generate(one, PROMPTS, max_new_tokens=10, **kwargs))
  dec = decoder_for(model)
  put = lambda x: jax.device_put(x, dec.row_sharding)
  sampling = Sampling()
  rows = mesh.shape["data"]
  text = dec.prefill.lower(nnx.state(model), put(np.ones((rows, 16), np.int32)),
                           put(np.full(rows, 9, np.int32)), jax.random.key(0),
                           sampling.values(), cache_len=32,
                           sampling=sampling.static()).compile().as_text()
  gathers = [c for c in hlo.collectives(text, mesh)
             if c.kind == "all-gather" and c.axes == ("context",)]
  assert len(gathers) >= 2 * cfg.num_layers, gathers


def decode_collectives(model, sampling):
  dec = decoder_for(model)
  put = lambda x: jax.device_put(x, dec.row_sharding)
  state = nnx.state(model)
  lengths = put(np.full(2, 3, np.int32))
  token, cache = dec.prefill(state, put(np.ones((2, 16), np.int32)), lengths,
                             jax.random.key(0), sampling.values(), cache_len=32,
                             sampling=sampling.static())
  text = dec.decode.lower(state, cache, token, lengths, put(np.zeros(2, bool)),
                          jax.random.key(0), np.int32(1), np.zeros(0, np.int32), np.int32(0),
                          sampling.values(), sampling=sampling.static()).compile().as_text()
  return hlo.collectives(text, model.mesh)


def test_decode_step_communicates_like_megatron(meshes):
  """Per token: one [b, 1, d] all-reduce after the embedding and two per block, then
  [b]-sized reductions to pick the token; no gathers of logits or anything else."""
  cfg = TransformerConfig.preset("llama-tiny", max_seq_len=32)
  model = Transformer(cfg, mesh=meshes["2x4"], rngs=nnx.Rngs(0))
  local_rows = 1  # batch 2 over a 2-way data axis
  for sampling in (Sampling(), Sampling(0.8, top_k=5, top_p=0.9)):
    found = decode_collectives(model, sampling)
    assert {c.kind for c in found} == {"all-reduce"}, found
    assert all(c.axes == ("model",) for c in found), found
    activations = [c for c in found if c.operands == (("f32", (local_rows, 1, cfg.d_model)),)]
    assert len(activations) == 2 * cfg.num_layers + 1
    small = [c for c in found if c not in activations]
    assert all(shape == (local_rows,) for c in small for _, shape in c.operands), small
    if sampling.greedy:
      assert len(small) == 2  # the best value (max), then the lowest id holding it (min)


def test_no_recompilation_per_token_or_prompt_length_in_a_bucket(meshes):
  model = Transformer(TransformerConfig.tiny(max_seq_len=64), mesh=meshes["1x2"],
                      rngs=nnx.Rngs(0))
  generate(model, [[1, 2, 3]], max_new_tokens=5)  # prompt bucket 16, cache 16
  dec = decoder_for(model)
  compiled = dec.prefill._cache_size(), dec.decode._cache_size()
  generate(model, [[4, 5, 6, 7, 8, 9, 10, 11, 12]], max_new_tokens=7)  # the same buckets
  assert (dec.prefill._cache_size(), dec.decode._cache_size()) == compiled
  # Sampling compiles its own steps once; its numbers (temperature, seed) are arguments.
  generate(model, [[4, 5, 6, 7, 8]], max_new_tokens=11, temperature=0.5, seed=3)
  generate(model, [[4, 5]], max_new_tokens=3, temperature=0.9, seed=4)
  assert (dec.prefill._cache_size(), dec.decode._cache_size()) == (compiled[0] + 1,
                                                                    compiled[1] + 1)
  generate(model, [[4] * 17], max_new_tokens=2)  # a longer prompt: the next buckets
  assert dec.prefill._cache_size() == compiled[0] + 2


def test_eos_ends_a_row_and_streaming_yields_the_same_tokens(meshes):
  model = Transformer(TransformerConfig.tiny(max_seq_len=32), mesh=meshes["1x3"],
                      rngs=nnx.Rngs(0))
  free = generate(model, PROMPTS, max_new_tokens=10)
  streamed = np.stack(list(stream(model, PROMPTS, max_new_tokens=10)), axis=1)
  for row, prompt in enumerate(PROMPTS):
    np.testing.assert_array_equal(streamed[row], free[row, len(prompt):len(prompt) + 10])
  eos = int(free[0, len(PROMPTS[0]) + 3])  # row 0's fourth new token
  ended = generate(model, PROMPTS, max_new_tokens=10, eos_id=[eos, 255], pad_id=258)
  first = list(free[0, len(PROMPTS[0]):]).index(eos) + len(PROMPTS[0])
  np.testing.assert_array_equal(ended[0, :first + 1], free[0, :first + 1])
  assert (ended[0, first + 1:] == 258).all()
  other = free[1, len(PROMPTS[1]):len(PROMPTS[1]) + 10]
  if eos not in other and 255 not in other:
    np.testing.assert_array_equal(ended[1, :len(PROMPTS[1]) + 10],
                                  free[1, :len(PROMPTS[1]) + 10])


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt_ids=[[1, 2, 259]]), "token id 259, outside the model's vocabulary"),
    (dict(prompt_ids=[[]]), "each prompt needs 1 to"),
    (dict(prompt_ids=np.ones((2, 3), np.int32), lengths=[3, 4]), "prompt row 1 has length 4"),
    (dict(prompt_ids=np.ones((1, 3), np.float32)), "integer array"),
    (dict(max_new_tokens=14), "past the model's max_seq_len 16"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(temperature=float("nan")), r"temperature must be 0 \(greedy\) or a number in"),
    (dict(temperature=1e-40), r"float32.s normal range\), got 1e-40"),
    (dict(temperature=1.0, top_k=0), "top_k must be an integer >= 1"),
    (dict(temperature=1.0, top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(eos_id=-3), "eos_id must be a token id"),
])
def test_bad_input_is_named(meshes, kwargs, message):
  model = Transformer(TransformerConfig.tiny(), mesh=meshes["1x1"], rngs=nnx.Rngs(0))
  args = {"prompt_ids": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
  with pytest.raises(ValueError, match=message):
    generate(model, args.pop("prompt_ids"), **args)


# -- train/generate.py ------------------------------------------------------------------

def test_cli_continues_a_training_checkpoint_on_another_mesh(tmp_path, capsys):
  """Sampling through the CLI on 1x3 prints what generate() gives on 1x1 from the
  same checkpoint (bytes tokenizer of the built-in presets)."""
  from helpers import TINY_RUN_FLAGS, write_small_corpus

  from flax_tp.checkpoint import Checkpointer
  from train import generate as cli
  from train.data import ByteTokenizer
  from train.run import main as train_main
  corpus = write_small_corpus(tmp_path / "corpus.py", files=3)
  ck = tmp_path / "ck"
  assert train_main([*TINY_RUN_FLAGS, "--mesh", "1x2", "--steps", "1", "--data", corpus,
                     "--checkpoint-dir", str(ck)]) == 0
  capsys.readouterr()
  sampling = dict(temperature=0.8, top_k=50, top_p=0.95, seed=5)
  assert cli.main(["--checkpoint", str(ck), "--mesh", "1x3", "--prompt", "def ",
                   "--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "50",
                   "--top-p", "0.95", "--seed", "5"]) == 0
  out = capsys.readouterr()
  cfg = TransformerConfig.tiny(max_seq_len=16)
  model = Transformer(cfg, mesh=flax_tp.make_mesh("1x1"), rngs=nnx.Rngs(0))
  params, _ = Checkpointer(ck).restore({"params": nnx.state(model, nnx.Param)})
  nnx.update(model, params["params"])
  prompt = list(b"def ")
  tokens = generate(model, [prompt], max_new_tokens=12, **sampling)[0, len(prompt):]
  assert out.out == "def " + ByteTokenizer().decode(tokens) + "\n"
  assert "12 tokens on mesh 1x3" in out.err


@pytest.mark.parametrize("argv,message", [
    ([], "one of the arguments --hf --checkpoint is required"),
    (["--hf", "no/such/folder"], "--hf .no/such/folder. is not a folder"),
    (["--hf", str(FIXTURES / "llama")], "has no tokenizer.json"),
    (["--checkpoint", str(FIXTURES)], "--checkpoint: no checkpoint found"),
    (["--hf", str(FIXTURES / "llama"), "--top-p", "0"], r"--top-p must be a number in \(0, 1\]"),
    (["--hf", str(FIXTURES / "llama"), "--temperature", "nan"], "--temperature must be"),
    # Logits / temperature in float32: below the smallest normal it overflows, above the
    # largest float32 it is inf itself.
    (["--hf", str(FIXTURES / "llama"), "--temperature", "1e-40"],
     r"--temperature must be 0 \(greedy\) or a number in \[1.175e-38, 3.403e\+38\].*1e-40"),
    (["--hf", str(FIXTURES / "llama"), "--temperature", "1e39"], "got 1e\\+39"),
    (["--hf", str(FIXTURES / "llama"), "--prompt", "def \udcff"],
     r"--prompt: it is not valid UTF-8 \(byte 'ff' at character 4\)"),
    (["--hf", str(FIXTURES / "llama"), "--max-new-tokens", "0"], "--max-new-tokens must be"),
    (["--hf", str(FIXTURES / "llama"), "--mesh", "1x0"], "mesh"),
    (["--hf", str(FIXTURES / "llama"), "--step", "3"], "--step needs --checkpoint"),
])
def test_cli_bad_input_exits_2_with_one_line(capsys, argv, message):
  from train import generate as cli
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("train/generate.py: error: ") and len(err.strip().splitlines()) == 1
  assert re.search(message, err), err
