"""Training through the CLI's main(): mesh independence, dropout, resume, checkpoints."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_tp
from flax_tp.checkpoint import Checkpointer
from models.config import FLAT_FIELDS, TransformerConfig
from models.transformer import Transformer
from train.run import main
from train.step import Trainer, make_optimizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A small text file (a few stdlib modules): quick to load, real Python."""
  from helpers import write_small_corpus
  return write_small_corpus(tmp_path_factory.mktemp("data") / "corpus.py")


def train(tmp_path, corpus, name, *flags):
  """Runs train/run.py in-process; returns the metrics records of the run."""
  metrics = tmp_path / f"{name}.jsonl"
  argv = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "16", "--eval-every", "0",
          "--sample-length", "0", "--lr", "1e-2", "--warmup-steps", "1", "--data", corpus,
          "--metrics-file", str(metrics), *flags]
  assert main(argv) == 0
  return [json.loads(line) for line in metrics.read_text().splitlines()]


def losses(records, key="loss"):
  return [r[key] for r in records if key in r]


def test_same_losses_at_1x1_and_2x4(tmp_path, corpus):
  one = train(tmp_path, corpus, "1x1", "--mesh", "1x1", "--steps", "4")
  eight = train(tmp_path, corpus, "2x4", "--mesh", "2x4", "--steps", "4")
  assert len(losses(one)) == 4
  np.testing.assert_allclose(losses(eight), losses(one), rtol=1e-5)
  np.testing.assert_allclose(losses(eight, "eval_loss"), losses(one, "eval_loss"), rtol=1e-5)
  assert losses(one)[-1] < losses(one)[0]  # it trains


# 13-token sequences (a multiple of neither 2, 4 nor 8), dropout on, 4 steps.
DROPOUT_RUN = ["--seq-len", "13", "--dropout", "0.1", "--steps", "4"]


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory, corpus):
  """Losses of the plain DROPOUT_RUN per mesh, each trained once for the whole module."""
  cache = {}

  def get(mesh_spec):
    if mesh_spec not in cache:
      cache[mesh_spec] = losses(train(tmp_path_factory.mktemp("plain"), corpus, "plain",
                                      "--mesh", mesh_spec, *DROPOUT_RUN))
    return cache[mesh_spec]
  return get


@pytest.mark.parametrize("spec", ["2x4", pytest.param("1x8", marks=pytest.mark.slow)])
def test_dropout_is_mesh_independent(tmp_path, corpus, dropout_runs, spec):
  np.testing.assert_allclose(dropout_runs(spec), dropout_runs("1x1"), rtol=1e-5)


def test_dropout_changes_the_loss(tmp_path, corpus, dropout_runs):
  plain = train(tmp_path, corpus, "nodrop", "--mesh", "1x1", *DROPOUT_RUN, "--dropout", "0",
                "--steps", "1")  # its first loss is all that is compared
  assert abs(dropout_runs("1x1")[0] - losses(plain)[0]) > 1e-3  # dropout did change the loss


@pytest.mark.slow
def test_resume_after_interrupt_equals_uninterrupted(tmp_path, corpus):
  full_dir = tmp_path / "full"
  full = train(tmp_path, corpus, "full", "--mesh", "2x4", "--steps", "6",
               "--checkpoint-every", "3", "--checkpoint-dir", str(full_dir))
  assert sorted(p.name for p in full_dir.iterdir() if p.name.isdigit()) == ["3", "6"]
  # A run killed after its step-3 checkpoint leaves exactly this folder behind.
  stopped = tmp_path / "stopped"
  stopped.mkdir()
  shutil.copytree(full_dir / "3", stopped / "3")
  resumed = train(tmp_path, corpus, "resumed", "--mesh", "2x4", "--steps", "6", "--resume",
                  "--checkpoint-dir", str(stopped))
  assert [r["step"] for r in resumed if "loss" in r] == [4, 5, 6]
  assert losses(resumed) == losses(full)[3:]  # exactly

  other = tmp_path / "other_mesh"
  other.mkdir()
  shutil.copytree(full_dir / "3", other / "3")
  moved = train(tmp_path, corpus, "moved", "--mesh", "1x8", "--steps", "6", "--resume",
                "--checkpoint-dir", str(other))
  np.testing.assert_allclose(losses(moved), losses(full)[3:], rtol=1e-5)


def test_checkpoint_moves_across_meshes_exactly(tmp_path, meshes):
  """2x4 -> 1x8 -> 4x2 -> 1x1: params and optimizer state identical after each restore."""
  cfg = TransformerConfig.tiny()
  tokens = jax.random.randint(jax.random.key(0), (8, cfg.max_seq_len + 1), 0, cfg.vocab_size)
  tx = make_optimizer(lr=1e-2, steps=10)

  def trainer_on(spec, seed):
    mesh = meshes.get(spec) or flax_tp.make_mesh(spec)
    return Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(seed)), tx)

  first = trainer_on("2x4", 0)
  params, opt_state = first.params, first.init_opt_state(first.params)
  params, opt_state, _ = first.train_step(params, opt_state,
                                          jax.device_put(tokens, first.batch_sharding), None)
  expected = {"params": flax_tp.unshard(params),
              "mu": flax_tp.unshard(opt_state[1][0].mu)}
  state = {"params": params, "opt_state": opt_state}
  for step, spec in enumerate(["1x8", "4x2", "1x1"], start=1):
    Checkpointer(tmp_path / "ck").save(step, state, {"step": step})
    target = trainer_on(spec, seed=step + 10)  # different init: everything must be restored
    like = {"params": target.params, "opt_state": target.init_opt_state(target.params)}
    state, meta = Checkpointer(tmp_path / "ck").restore(like)
    assert meta["step"] == step
    got = {"params": flax_tp.unshard(state["params"]),
           "mu": flax_tp.unshard(state["opt_state"][1][0].mu)}
    for name in expected:
      for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(expected[name]), strict=True):
        np.testing.assert_array_equal(a, b)
    model_axis = target.mesh.shape["model"]
    kernel = state["params"]["blocks"][0]["mlp"]["up"]["kernel"][...]
    assert kernel.sharding.mesh == target.mesh
    assert kernel.shape[1] == -(-cfg.d_ff // model_axis) * model_axis
  # And it trains on the last mesh.
  _, _, out = target.train_step(state["params"], state["opt_state"],
                                jax.device_put(tokens, target.batch_sharding), None)
  assert np.isfinite(float(out["loss"]))


@pytest.mark.parametrize("flags,what,last", [
    (["--preset", "tiny", "--steps", "6", "--grad-clip", "0", "--warmup-steps", "0"], "loss", 1),
    # the run: clipped (the default), the gradient norm goes first, the loss finite
    (["--preset", "llama-tiny", "--steps", "3"], "gradient norm", 2),
    (["--preset", "tiny", "--steps", "6", "--eval-every", "1"], "eval loss", 1)])
def test_a_non_finite_step_stops_and_nothing_non_finite_is_saved(tmp_path, corpus, capsys,
                                                                 monkeypatch, flags, what, last):
  """lr 1e30: the run stops with exit 1 at the first non-finite loss, gradient norm or eval
  loss, before that step is applied or saved; every checkpoint left holds finite params,
  the last stays the last good one, and the metrics file is strict JSON (a non-finite
  number is null)."""
  ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
  argv = ["--mesh", "1x2", "--batch-size", "8", "--seq-len", "16", "--lr", "1e30",
          "--eval-every", "0", "--sample-length", "0", "--data", corpus, "--checkpoint-dir",
          str(ck), "--checkpoint-every", "1", "--metrics-file", str(metrics), *flags]
  assert main(argv) == 1
  err = capsys.readouterr().err
  assert re.search(rf"error: {what} is (nan|inf|-inf) at step {last + 1}; stopping", err), err
  checkpointer = Checkpointer(ck)
  assert checkpointer.latest_step() == last and f"last good checkpoint: step {last}" in err
  for step in checkpointer.steps():
    assert all(np.isfinite(p).all() for p in _saved_params(ck, step)), step
  records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
             for line in metrics.read_text().splitlines()]
  assert records[-1]["error"].startswith("non-finite") and None in records[-1].values()
  if what != "loss":
    return
  # A checkpoint holding NaN (as one saved before this check could) is refused by export.
  from train import export
  meta = checkpointer.read_meta(last)
  config = {k: v for k, v in meta["run"]["config"].items() if k in FLAT_FIELDS}
  model = Transformer(TransformerConfig.from_identity(config), mesh=flax_tp.make_mesh("1x2"),
                      rngs=nnx.Rngs(0))
  flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  path, var = flat[0]
  flat[0] = (path, var.replace(var[...].at[0].set(jnp.nan)))
  with monkeypatch.context() as patched:
    patched.setattr("flax_tp.checkpoint.checkpointer.non_finite", lambda _: [])
    checkpointer.save(last + 1, {"params": nnx.from_flat_state(flat)}, meta)
  assert export.main(["--checkpoint", str(ck), "--out", str(tmp_path / "hf")]) == 2
  err = capsys.readouterr().err
  assert "holds NaN or infinity" in err and "use an earlier --step" in err, err
  assert not (tmp_path / "hf").exists()


def _saved_params(ck, step) -> list[np.ndarray]:
  """The params of checkpoint ``step`` (read through ``Checkpointer.restore``)."""
  config = Checkpointer(ck).read_meta(step)["run"]["config"]
  cfg = TransformerConfig.from_identity({k: v for k, v in config.items() if k in FLAT_FIELDS})
  model = Transformer(cfg, mesh=flax_tp.make_mesh("1x2"), rngs=nnx.Rngs(0))
  restored, _ = Checkpointer(ck).restore({"params": nnx.state(model, nnx.Param)}, step)
  return [np.asarray(v[...]) for _, v in nnx.to_flat_state(restored["params"])]


@pytest.mark.slow
def test_bad_checkpoints_exit_2(tmp_path, corpus, capsys):
  ck = tmp_path / "ck"
  train(tmp_path, corpus, "a", "--mesh", "1x2", "--steps", "1", "--checkpoint-dir", str(ck))
  capsys.readouterr()
  base = ["--mesh", "1x2", "--batch-size", "8", "--seq-len", "16", "--steps", "2",
          "--sample-length", "0", "--lr", "1e-2", "--warmup-steps", "1", "--data", corpus,
          "--resume", "--checkpoint-dir", str(ck)]
  at_end = [a if a != "2" else "1" for a in base]  # --steps 1: nothing left to train
  assert main(["--preset", "tiny", *at_end]) == 2
  assert "already at --steps 1" in capsys.readouterr().err
  assert main(["--preset", "small", *base]) == 2  # written for another model
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "belong to another run (config." in err

  (ck / "1" / "shards.0.bin").write_bytes(b"garbage")
  assert main(["--preset", "tiny", *base]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "checkpoint step 1 is truncated" in err

  assert main(["--preset", "tiny", *base[:-1], str(tmp_path / "empty")]) == 2
  assert "no checkpoint" in capsys.readouterr().err


def test_data_folder_and_split(tmp_path):
  from train.data import TokenCorpus
  (tmp_path / "a.py").write_text("x = 1\n" * 300)
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "b.txt").write_text("y = 2\n" * 300)
  (tmp_path / "blob.bin").write_bytes(b"\0" * 1000)  # not text: skipped
  corpus = TokenCorpus.load(str(tmp_path), seq_len=16)
  assert len(corpus.train) + len(corpus.eval) == 2 * 1800 + 2
  assert b"y = 2" in corpus.eval.tobytes() and b"\0" not in corpus.train.tobytes()
  first = corpus.batch("train", seed=3, step=7, batch_size=4, seq_len=16)
  again = corpus.batch("train", seed=3, step=7, batch_size=4, seq_len=16)
  assert first.shape == (4, 17) and (first == again).all()
  assert not (first == corpus.batch("train", seed=3, step=8, batch_size=4, seq_len=16)).all()


OPTIONS = ["--sequence-parallel", "--remat", "dots_saveable", "--scan-layers"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["1x8", "2x4"])
def test_memory_options_change_no_loss(tmp_path, corpus, dropout_runs, mesh_spec):
  """Sequence parallelism, recomputation and scanned layers together give the plain
  run's losses over 4 steps (uneven sequence: 13 positions over 8 and over 4; dropout
  on); on 1x8 the options' checkpoint resumes without them. (Each option alone:
  test_transformer.py.)"""
  options = OPTIONS
  ck = tmp_path / "ck"
  run = train(tmp_path, corpus, "options", "--mesh", mesh_spec, *DROPOUT_RUN, *options,
              *(["--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
                if mesh_spec == "1x8" else []))
  np.testing.assert_allclose(losses(run), dropout_runs(mesh_spec), rtol=2e-6)
  if mesh_spec == "1x8":
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copytree(ck / "2", moved / "2")
    resumed = train(tmp_path, corpus, "resumed", "--mesh", mesh_spec, *DROPOUT_RUN,
                    "--resume", "--checkpoint-dir", str(moved))
    np.testing.assert_allclose(losses(resumed), dropout_runs(mesh_spec)[2:], rtol=2e-6)


def test_loss_and_grads_called_eagerly_is_one_compiled_program(meshes, caplog):
  """Outside any jit, Trainer.loss_and_grads compiles its step once (an eager shard_map
  would dispatch it op by op, each op compiled: 93 s for moe-tiny on 2x4), and gives what
  it gives under the caller's jit."""
  import logging
  cfg = TransformerConfig.preset("moe-tiny")
  trainer = Trainer(Transformer(cfg, mesh=meshes["2x4"], rngs=nnx.Rngs(0)),
                    make_optimizer(lr=1e-3, steps=1))
  tokens = jax.device_put(
      jax.random.randint(jax.random.key(0), (4, 9), 0, cfg.vocab_size), trainer.batch_sharding)
  with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
    loss, grads = trainer.loss_and_grads(trainer.params, tokens)
  compiled = [r for r in caplog.records if "Compiling" in r.getMessage()]
  assert len(compiled) == 1, [r.getMessage()[:80] for r in compiled[:5]]
  jit_loss, jit_grads = jax.jit(trainer.loss_and_grads)(trainer.params, tokens)
  np.testing.assert_array_equal(loss, jit_loss)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(jit_grads), strict=True):
    np.testing.assert_array_equal(a, b)


def test_held_steps_equal_the_train_step(meshes):
  """The loop's steps on state held as lists of arrays (``Trainer.held``) give bit for
  bit what ``train_step`` gives on ``nnx.State``, on an uneven mesh; the state comes back
  as ``nnx.State`` of the same structure and shardings, and a non-finite step is not
  applied there either."""
  cfg = TransformerConfig.tiny()
  trainer = Trainer(Transformer(cfg, mesh=meshes["1x3"], rngs=nnx.Rngs(0)),
                    make_optimizer(lr=1e-2, steps=4))
  tokens = jax.device_put(jax.random.randint(jax.random.key(1), (4, 17), 0, cfg.vocab_size),
                          trainer.batch_sharding)
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # train_step donates its inputs
  params, opt_state = copy(trainer.params), trainer.init_opt_state(trainer.params)
  held = trainer.held(copy(params), copy(opt_state))
  for _ in range(2):
    params, opt_state, out = trainer.train_step(params, opt_state, tokens, None)
    held_out = held.step(tokens, None)
    assert float(held_out["loss"]) == float(out["loss"])
  held_params, held_opt = held.state()
  assert jax.tree.structure(held_params) == jax.tree.structure(params)
  assert jax.tree.structure(held_opt) == jax.tree.structure(opt_state)
  for ours, theirs in zip(jax.tree.leaves((held_params, held_opt)),
                          jax.tree.leaves((params, opt_state)), strict=True):
    assert ours.sharding == theirs.sharding
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
  assert held.state()[0] is held_params  # rebuilt once per step
  bad = jax.device_put(jnp.full_like(tokens, cfg.vocab_size + 5), trainer.batch_sharding)
  bad_out = held.step(bad, None)  # out-of-range ids: NaN embeddings, NaN loss
  assert not np.isfinite(float(bad_out["loss"]))
  for ours, theirs in zip(jax.tree.leaves(held.state()), jax.tree.leaves((params, opt_state)),
                          strict=True):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
