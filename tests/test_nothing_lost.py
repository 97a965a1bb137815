"""Nothing lost: checkpoint directories that belong to one run, signals that save,
one-line errors, sharded checkpoints, streamed data, pickling, the masked loss."""

import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import TINY_RUN_FLAGS, write_small_corpus

import flax_tp
from flax_tp.checkpoint import Checkpointer, CheckpointError, CheckpointSaveError
from models.config import TransformerConfig
from models.transformer import Transformer
from train.data import TokenCorpus
from train.run import main
from train.step import LossOptions, Trainer, make_optimizer

ROOT = Path(__file__).resolve().parent.parent
FLAGS = TINY_RUN_FLAGS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_small_corpus(tmp_path_factory.mktemp("data") / "corpus.py")


def steps_in(ck):
  return sorted(int(p.name) for p in Path(ck).iterdir() if p.name.isdigit())


def test_a_fresh_run_never_touches_another_runs_checkpoints(tmp_path, corpus, capsys):
  ck = tmp_path / "ck"
  base = [*FLAGS, "--mesh", "1x2", "--data", corpus, "--checkpoint-dir", str(ck)]
  assert main([*base, "--steps", "4", "--checkpoint-every", "2"]) == 0
  # Every checkpoint file (the folder's run lock is each run's: it names its holder).
  before = {p: p.stat().st_mtime_ns for p in ck.rglob("*") if p.name != ".flax_tp-run.lock"}
  capsys.readouterr()
  # The repro: another seed, saving every step, into the same folder.
  assert main([*base, "--steps", "4", "--checkpoint-every", "1", "--seed", "7"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "holds checkpoints of an earlier run (steps 2, 4)" in err
  assert "--resume" in err and "--overwrite" in err
  assert {p: p.stat().st_mtime_ns for p in ck.rglob("*")
          if p.name != ".flax_tp-run.lock"} == before  # untouched
  # --resume of it with another seed is refused, naming the difference.
  assert main([*base, "--steps", "6", "--resume", "--seed", "7"]) == 2
  assert "belong to another run (seed 0 there, 7 here)" in capsys.readouterr().err
  # Only an explicit --overwrite deletes them.
  assert main([*base, "--steps", "3", "--checkpoint-every", "1", "--seed", "7",
               "--overwrite", "--keep-checkpoints", "0"]) == 0
  assert steps_in(ck) == [1, 2, 3]
  assert Checkpointer(ck).read_meta()["run"]["seed"] == 7


def _run_until(argv, metrics, at_least, sig, env):
  """Starts train/run.py, sends ``sig`` once ``metrics`` has a step >= at_least."""
  proc = subprocess.Popen([sys.executable, str(ROOT / "train" / "run.py"), *argv],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists():
      steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
               if line.endswith("}")]
      if steps and max(steps) >= at_least:
        break
    time.sleep(0.05)
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=120)
  return proc.returncode, err


def test_signals_save_the_last_step_and_resume_exactly(tmp_path, corpus):
  """SIGINT, then SIGTERM on resume, then a resume to the end: the losses of an
  uninterrupted run, each step once in the metrics file."""
  steps = "120"  # more than the runs get to before their signals (they stop near 3 and 6)
  common = [*FLAGS, "--mesh", "2x4", "--data", corpus, "--steps", steps]
  env = {**os.environ}
  env.pop("XLA_FLAGS")
  ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
  argv = [*common, "--checkpoint-dir", str(ck), "--metrics-file", str(metrics)]
  code, err = _run_until(argv, metrics, 3, signal.SIGINT, env)
  assert code == 130, err
  last = steps_in(ck)[-1]
  assert last >= 3 and f"SIGINT: stopped after step {last}; checkpoint of step {last}" in err
  code, err = _run_until([*argv, "--resume"], metrics, last + 3, signal.SIGTERM, env)
  assert code == 143, err
  second = steps_in(ck)[-1]
  assert second >= last + 3 and f"SIGTERM: stopped after step {second}" in err
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == list(range(1, second + 1))  # once each
  # The uninterrupted run, same flags, in-process.
  ref = tmp_path / "ref.jsonl"
  assert main([*common, "--metrics-file", str(ref)]) == 0
  ref_losses = [r["loss"] for r in map(json.loads, ref.read_text().splitlines()) if "loss" in r]
  assert [r["loss"] for r in records if "loss" in r] == ref_losses[:second]


def test_second_signal_aborts_at_once(monkeypatch, capfd):
  from train import loop

  class Aborted(Exception):
    pass

  def fake_exit(code):
    raise Aborted(code)

  monkeypatch.setattr(loop.os, "_exit", fake_exit)
  with loop.Interrupts() as interrupts:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs in the main thread, between bytecodes
    assert interrupts.requested() and interrupts.exit_status == 143
    with pytest.raises(Aborted) as aborted:
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.05)
  assert aborted.value.args == (128 + signal.SIGINT,)
  assert "second signal (SIGINT): aborting without saving" in capfd.readouterr().err
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_during_start_up_is_one_line(signals):
  """Ctrl-C while the script imports JAX (and a second one): one line, status 130."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen([sys.executable, str(ROOT / "train" / "run.py"), "--mesh", "2x4"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  time.sleep(0.5)  # python is up (the handler is set first thing), JAX is being imported
  for _ in range(signals):
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130 and err == "train/run.py: interrupted\n", err


def test_no_blank_line_before_an_error_on_a_cold_cache(tmp_path, monkeypatch, capsys):
  """Tokenizing into an empty cache shows no progress bar off a terminal (rich's transient
  bar left an empty line before the error)."""
  monkeypatch.setenv("FLAX_TP_CACHE", str(tmp_path / "cache"))
  data = tmp_path / "tiny.txt"
  data.write_text("abc\n")
  assert main([*FLAGS, "--mesh", "1x2", "--data", str(data)]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert captured.err.startswith("train/run.py: error: --data") and captured.err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["--seed", "-1"], "--seed must be an integer in [0, 2**32), got -1"),
    (["--seed", "99999999999999999999"], "--seed must be an integer in [0, 2**32)"),
    (["--grad-clip", "nan"], "--grad-clip must be a number >= 0 (0: off), got nan"),
    (["--weight-decay", "nan"], "--weight-decay must be a number >= 0, got nan"),
    (["--lr", "inf"], "--lr must be a positive number, got inf"),
    (["--z-loss", "nan"], "--z-loss must be a number >= 0, got nan"),
    (["--steps", "99999999999"], "--steps must be an integer in [1, 2147483647]"),
    (["--checkpoint-dir", "/proc/foo"], "--checkpoint-dir '/proc/foo' cannot be created"),
    (["--checkpoint-dir", __file__], "is a file, not a folder"),
    (["--metrics-file", "/proc/nope/m.jsonl"], "folder '/proc/nope' does not exist"),
    (["--metrics-file", "/"], "--metrics-file '/' is a folder, not a file"),
    (["--overwrite"], "--overwrite needs --checkpoint-dir"),
    (["--mesh", "100000x100000"], "'100000x100000' needs 10000000000 devices"),
])
def test_more_bad_values_exit_2_with_one_line(capsys, argv, message):
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err and err.startswith("train/run.py: error: ")


def test_huge_mesh_in_a_fresh_process_is_one_line():
  """Without XLA_FLAGS the script would ask XLA for the devices; it refuses first."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, str(ROOT / "train" / "run.py"), "--mesh",
                        "100000x100000"], capture_output=True, text=True, env=env, timeout=120)
  assert out.returncode == 2 and out.stderr.count("\n") == 1
  assert "at most 1024 per process can be simulated" in out.stderr


def test_a_failing_save_exits_1_with_one_line(tmp_path, corpus, capsys, monkeypatch):
  def disk_full(*_):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(Checkpointer, "_commit", disk_full)
  assert main([*FLAGS, "--mesh", "1x2", "--data", corpus, "--steps", "2",
               "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "cannot write checkpoint step 1" in err
  assert "No space left on device" in err


# -- sharded checkpoints -------------------------------------------------------

def _trainer(spec, seed, cfg=TransformerConfig.tiny()):
  return Trainer(Transformer(cfg, mesh=flax_tp.make_mesh(spec), rngs=nnx.Rngs(seed)),
                 make_optimizer(lr=1e-2, steps=10))


def test_checkpoint_writes_each_logical_element_once_and_async(tmp_path):
  """6 heads / vocab 259 over 4 devices (padded); async save; bytes on disk == logical bytes."""
  cfg = TransformerConfig.tiny(vocab_size=259)
  trainer = _trainer("2x4", 0, cfg)
  state = {"params": trainer.params, "opt_state": trainer.init_opt_state(trainer.params)}
  ck = Checkpointer(tmp_path / "ck", asynchronous=True)
  ck.save(1, state, {"step": 1})
  ck.wait()
  params = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(
      flax_tp.unshard(state["params"])))
  is_var = lambda x: isinstance(x, nnx.Variable)
  plain = sum(x.nbytes for x in jax.tree.leaves(state["opt_state"], is_leaf=is_var)
              if not is_var(x))  # the step counters
  stored = (tmp_path / "ck" / "1" / "shards.0.bin").stat().st_size
  assert stored == 3 * params + plain  # params, Adam's mu and nu: unpadded, each once
  target = _trainer("1x3", 5, cfg)
  restored, meta = Checkpointer(tmp_path / "ck").restore(
      {"params": target.params, "opt_state": target.init_opt_state(target.params)})
  for a, b in zip(jax.tree.leaves(flax_tp.unshard(restored["params"])),
                  jax.tree.leaves(flax_tp.unshard(state["params"])), strict=True):
    np.testing.assert_array_equal(a, b)


def test_broken_checkpoints_are_one_line_errors_and_keep_the_last_good(tmp_path):
  trainer = _trainer("1x2", 0)
  state = {"params": trainer.params}
  ck = Checkpointer(tmp_path / "ck")
  ck.save(1, state, {"step": 1})
  # A save that died half-way leaves only its temporary folder: step 1 stays latest.
  (tmp_path / "ck" / ".tmp-2").mkdir()
  (tmp_path / "ck" / ".tmp-2" / "shards.0.bin").write_bytes(b"partial")
  assert ck.latest_step() == 1
  ck.restore({"params": trainer.params})
  data = tmp_path / "ck" / "1" / "shards.0.bin"
  data.write_bytes(data.read_bytes()[:100])  # truncated
  with pytest.raises(CheckpointError, match="truncated") as err:
    ck.restore({"params": trainer.params})
  assert "\n" not in str(err.value)



def test_checkpoints_never_delete_what_flax_tp_did_not_write(tmp_path, corpus, capsys):
  """A user's file in a step folder, or a numbered folder that is not a checkpoint, is never
  deleted: a save over it and --overwrite refuse naming it; rotation keeps it."""
  state = {"params": {"w": jnp.arange(6.0)}}
  ck_dir = tmp_path / "ck"
  ck = Checkpointer(ck_dir, max_to_keep=2)
  ck.save(1, state, {})
  thesis = ck_dir / "1" / "thesis.tex"
  thesis.write_text("years of work")
  with pytest.raises(CheckpointSaveError, match="refusing to save step 1: .*thesis.tex' was "
                     "not written by flax_tp") as err:
    ck.save(1, state, {})
  assert "\n" not in str(err.value) and thesis.read_text() == "years of work"
  mine = ck_dir / "12"
  mine.mkdir()
  (mine / "notes.txt").write_text("mine")
  assert ck.steps() == [1] and ck.not_ours() == [thesis, mine]
  with pytest.raises(CheckpointError, match="refusing to delete the checkpoints: .*thesis.tex"):
    ck.delete_all()
  assert ck.steps() == [1] and (mine / "notes.txt").is_file()  # nothing deleted
  # Rotation deletes flax_tp's files of step 1 and keeps the user's.
  ck.save(2, state, {})
  with pytest.warns(UserWarning, match=r"rotated out; kept \['thesis.tex'\]"):
    ck.save(3, state, {})
  assert ck.steps() == [2, 3] and sorted(os.listdir(ck_dir / "1")) == ["thesis.tex"]
  # The CLI refuses up front, before any step, naming the folder; nothing is touched.
  thesis.unlink()
  (ck_dir / "1").rmdir()
  capsys.readouterr()
  base = [*FLAGS, "--mesh", "1x2", "--data", corpus, "--checkpoint-dir", str(ck_dir),
          "--steps", "2"]
  for extra in (["--overwrite"], ["--resume", "--steps", "4"]):
    assert main([*base, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{str(mine)!r} is not a flax_tp checkpoint" in err
  assert ck.steps() == [2, 3] and (mine / "notes.txt").read_text() == "mine"


def test_a_flipped_byte_is_refused_on_restore(tmp_path):
  """Each piece carries a CRC-32 (and meta.json those of the index files)."""
  trainer = _trainer("1x2", 0)
  ck = Checkpointer(tmp_path / "ck")
  ck.save(1, {"params": trainer.params}, {"step": 1})
  ck.restore({"params": trainer.params})
  for name, match in (("shards.0.bin", r"corrupt: the bytes of 'params\..*' in shards.0.bin "
                       "do not match their checksum"),
                      ("index.0.json", "corrupt: index.0.json does not match its checksum")):
    path = tmp_path / "ck" / "1" / name
    good = path.read_bytes()
    at = len(good) // 2
    flipped = good[:at] + bytes([good[at] ^ (1 if name.endswith("bin") else 2)]) + good[at + 1:]
    path.write_bytes(flipped)
    with pytest.raises(CheckpointError, match=match) as err:
      ck.restore({"params": trainer.params})
    assert "\n" not in str(err.value)
    path.write_bytes(good)
  ck.restore({"params": trainer.params})  # put back: restores again

# -- the loss ------------------------------------------------------------------

def test_labels_outside_the_vocabulary_give_nan_like_optax():
  logits = jax.random.normal(jax.random.key(0), (2, 4, 10))
  labels = jnp.array([[0, 10, 3, -1], [9, 2, 11, -100]])
  mine = flax_tp.vocab_parallel_cross_entropy(logits, labels)
  ref = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.clip(labels, 0, 9))
  bad = (labels < 0) | (labels >= 10)
  assert np.isnan(np.asarray(mine)[np.asarray(bad)]).all()
  np.testing.assert_allclose(np.asarray(mine)[~np.asarray(bad)],
                             np.asarray(ref)[~np.asarray(bad)], rtol=1e-6)
  assert np.isnan(optax.softmax_cross_entropy_with_integer_labels(logits, labels)[0, 1])


@pytest.mark.parametrize("spec", ["1x1", "2x4"])
def test_ignore_index_mean_over_global_kept_tokens(spec):
  """-100 labels, all in the first data shard's rows: the mean is over the kept tokens
  of the whole batch (a per-shard mean would weigh the shards' tokens differently)."""
  cfg = TransformerConfig.tiny()
  tokens = jax.random.randint(jax.random.key(1), (4, cfg.max_seq_len + 1), 0, cfg.vocab_size)
  labels = tokens[:, 1:].at[:2, :-3].set(-100)  # rows 0-1: only the last 3 tokens kept
  trainer = Trainer(Transformer(cfg, mesh=flax_tp.make_mesh(spec), rngs=nnx.Rngs(0)),
                    make_optimizer(lr=1e-2, steps=10), LossOptions(ignore_index=-100))
  sharding = trainer.batch_sharding
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, jax.device_put(tokens, sharding), None,
                                       jax.device_put(labels, sharding))

  def reference(params):
    logits = nnx.merge(trainer.graphdef, params)(tokens[:, :-1])
    kept = labels != -100
    per = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(kept, labels, 0))
    return jnp.sum(jnp.where(kept, per, 0.0)) / jnp.sum(kept)

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(trainer.params)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(flax_tp.unshard(grads)),
                  jax.tree.leaves(flax_tp.unshard(ref_grads)), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# -- data ------------------------------------------------------------------------

def test_data_is_streamed_sniffed_uncapped_and_cached(tmp_path):
  folder = tmp_path / "data"
  folder.mkdir()
  big = b"print('hello')\n" * (18 * 2**20 // 15)  # > the 16 MiB the old reader cut at
  (folder / "big.py").write_bytes(big)
  with open(folder / "huge.bin", "wb") as f:  # 2 GiB, sparse: binary from its first byte
    f.write(b"\0" * 16)
    f.truncate(2 * 2**30)
  cache = tmp_path / "cache"
  tracemalloc.start()
  corpus = TokenCorpus.load(str(folder), seq_len=16, cache=cache)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert peak < 64 * 2**20  # neither file was read whole
  assert len(corpus.train) + len(corpus.eval) == len(big)
  assert isinstance(corpus.tokens, np.memmap)
  assert "1 binary file(s)" in corpus.describe() and f"{len(big):,} tokens" in corpus.describe()
  built = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
  again = TokenCorpus.load(str(folder), seq_len=16, cache=cache)  # from the cache
  assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == built
  assert again.fingerprint == corpus.fingerprint
  (folder / "more.py").write_text("x = 1\n" * 100)  # a new source: a new token file
  assert TokenCorpus.load(str(folder), seq_len=16, cache=cache).fingerprint != corpus.fingerprint


def test_a_binary_file_alone_is_named_as_such(tmp_path):
  (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 1000)
  with pytest.raises(ValueError, match=r"has no text: 1 binary file\(s\)"):
    TokenCorpus.load(str(tmp_path / "blob.bin"), seq_len=16, cache=tmp_path / "cache")


# -- pickling --------------------------------------------------------------------

def test_layers_and_models_pickle_onto_their_mesh(meshes):
  mesh = meshes["2x4"]
  model = Transformer(TransformerConfig.tiny(), mesh=mesh, rngs=nnx.Rngs(0))
  layer = flax_tp.RowParallelDense(6, 5, mesh=meshes["1x3"], rngs=nnx.Rngs(1))
  ids = jnp.ones((2, 8), jnp.int32)
  forward = nnx.jit(lambda m, x: m(x))
  again = pickle.loads(pickle.dumps(model))
  np.testing.assert_array_equal(forward(again, ids), forward(model, ids))
  for (_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(again)),
                            nnx.to_flat_state(nnx.state(model)), strict=True):
    assert a[...].sharding.is_equivalent_to(b[...].sharding, a[...].ndim)
  layer2 = pickle.loads(pickle.dumps(layer))
  x = jnp.ones((3, 6))
  np.testing.assert_array_equal(forward(layer2, x), forward(layer, x))
  assert layer2.kernel[...].sharding == layer.kernel[...].sharding
  from flax_tp.mesh import _rebuild_mesh
  with pytest.raises(ValueError, match=r"devices \[999\].*Checkpointer"):
    _rebuild_mesh(("data", "model"), [0, 999], (1, 2), tuple(mesh.axis_types))


def _write_legacy(directory, step, trees, meta):
  """A checkpoint as flax_tp 0.1.0 wrote it: orbax, whole logical arrays keyed by path."""
  import orbax.checkpoint as ocp

  from flax_tp.checkpoint.keys import is_leaf, key_of
  from flax_tp.state import logical_value
  state = {}
  for name, tree in trees.items():
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    state[name] = {key_of(path): logical_value(leaf) for path, leaf in flat}
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True),
                                  item_names=("state", "meta"))
  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()
  manager.close()


def test_checkpoints_of_the_previous_version_still_resume(tmp_path, corpus, capsys):
  """A 0.1.0 (orbax) checkpoint resumes on another mesh with the losses of a new-format one."""
  new = tmp_path / "new"
  base = [*FLAGS, "--data", corpus, "--steps", "4"]
  assert main([*base, "--mesh", "1x2", "--checkpoint-dir", str(new), "--checkpoint-every",
               "2"]) == 0
  trainer = _trainer("1x2", 9)
  like = {"params": trainer.params, "opt_state": trainer.init_opt_state(trainer.params)}
  state, meta = Checkpointer(new).restore(like, step=2)
  run = meta["run"]
  old = tmp_path / "old"
  _write_legacy(old, 2, state, {k: run[k] for k in ("config", "seed", "batch_size", "seq_len")}
                | {"steps": 4, "step": 2})
  assert Checkpointer(old).steps() == [2] and Checkpointer(old).read_meta()["step"] == 2
  for later in Checkpointer(new).steps()[1:]:  # both folders now end at step 2
    shutil.rmtree(new / str(later))
  capsys.readouterr()
  resumed = []
  for folder in (new, old):
    metrics = tmp_path / f"{folder.name}.jsonl"
    assert main([*base, "--mesh", "2x4", "--resume", "--checkpoint-dir", str(folder),
                 "--metrics-file", str(metrics)]) == 0
    resumed.append([r["loss"] for r in map(json.loads, metrics.read_text().splitlines())
                    if "loss" in r])
  assert len(resumed[0]) == 2 and resumed[0] == resumed[1]
  assert "checkpoint of flax_tp 0.1.0" in capsys.readouterr().out


def test_a_token_cache_of_another_version_is_rebuilt(tmp_path):
  """A report missing a field (written by an older flax_tp) is a cache miss, not a crash."""
  source = tmp_path / "a.py"
  source.write_text("x = 1\n" * 50)
  cache = tmp_path / "cache"
  corpus = TokenCorpus.load(str(source), seq_len=8, cache=cache)
  (report,) = cache.glob("tokens-*.json")
  old = json.loads(report.read_text())
  del old["token_counts"]
  report.write_text(json.dumps(old))
  again = TokenCorpus.load(str(source), seq_len=8, cache=cache)
  assert again.unigram_entropy() == corpus.unigram_entropy()
  assert "token_counts" in json.loads(report.read_text())
