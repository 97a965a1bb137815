"""flax_tp.checkpoint: each logical element written once, broken and foreign folders
named, a flipped byte refused; and its geometry (flax_tp.checkpoint.boxes) on its own."""

import errno
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SHORT_RUN_FLAGS, TINY_RUN_FLAGS, tiny_state, write_small_corpus

import flax_tp
from flax_tp import KVHeadLayout, SegmentedLayout, ShardLayout
from flax_tp.checkpoint import Checkpointer, CheckpointError, CheckpointSaveError
from models.config import TransformerConfig
from models.transformer import Transformer
from train.run import main
from train.step import Trainer, make_optimizer

ROOT = Path(__file__).resolve().parent.parent


FLAGS = TINY_RUN_FLAGS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_small_corpus(tmp_path_factory.mktemp("data") / "corpus.py")


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


def test_state_holding_nan_or_infinity_is_never_saved(tmp_path):
  """Checkpointer.save refuses, in one line naming the arrays, a sharded param or a host
  value holding NaN or infinity; nothing is written, the last good step stays the last."""
  trainer = _trainer("1x2", 0)
  ck = Checkpointer(tmp_path / "ck")
  ck.save(1, {"params": trainer.params}, {"step": 1})
  flat = list(nnx.to_flat_state(trainer.params))
  path, var = flat[0]
  bad = nnx.from_flat_state([(path, var.replace(var[...].at[0].set(jnp.nan)))] + flat[1:])
  for trees in ({"params": bad}, {"params": trainer.params, "lr": np.float32(np.inf)}):
    with pytest.raises(CheckpointSaveError, match="refusing to save step 2") as err:
      ck.save(2, trees, {"step": 2})
    assert "hold NaN or infinity" in str(err.value) and "\n" not in str(err.value)
  assert ck.steps() == [1] and not (tmp_path / "ck" / ".tmp-2").exists()


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


@pytest.mark.slow
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


# -- the geometry of pieces (flax_tp.checkpoint.boxes) ------------------------------

def test_a_padded_block_holds_its_shards_logical_data_only():
  """sizes 3, 3, 2, 2 of 10 over 4, stored padded to 3 each: the block of stored rows 3..8
  (shards 1 and 2) holds logical rows 3..5 and 6..7; the padding row 8 is in no box."""
  from flax_tp.checkpoint.boxes import logical_boxes
  layout = ShardLayout(10, 4)
  assert logical_boxes((slice(3, 9), slice(None)), (12, 5), {0: layout}) == [
      ((slice(0, 3), slice(0, 5)), (3, 0), (3, 5)),
      ((slice(3, 5), slice(0, 5)), (6, 0), (2, 5))]
  assert logical_boxes((slice(0, 5), slice(8, 9)), (5, 12), {1: layout}) == []  # padding


@pytest.mark.parametrize("layout", [
    ShardLayout(10, 4), ShardLayout(12, 3, unit=2), ShardLayout(8, 2),
    KVHeadLayout(2 * 4, 4, 4, num_heads=6), SegmentedLayout(16, 3, 4, (8, 4, 4)),
], ids=["uneven", "unit", "even", "kv-replicated", "segmented"])
@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_boxes_rebuild_the_logical_array_and_write_each_element_once(layout, blocks):
  """Device blocks of any size over the stored array: their boxes put every logical
  element back where it belongs, and with first_copies (what the writer writes) each
  logical element is in exactly one box, padding in none."""
  from flax_tp.checkpoint.boxes import logical_boxes
  logical = np.arange(layout.size * 3).reshape(layout.size, 3)
  stored = np.asarray(layout.pad(logical, 0))
  rebuilt = np.full_like(logical, -1)
  written = np.zeros(logical.shape, int)
  step = stored.shape[0] // blocks if stored.shape[0] % blocks == 0 else stored.shape[0]
  for start in range(0, stored.shape[0], step):
    where = (slice(start, start + step), slice(None))
    block = stored[where]
    for first_copies in (False, True):
      for sl, at, box in logical_boxes(where, stored.shape, {0: layout}, first_copies):
        target = tuple(slice(a, a + n) for a, n in zip(at, box, strict=True))
        if first_copies:
          written[target] += 1
        else:
          np.testing.assert_array_equal(block[sl], logical[target])
          rebuilt[target] = block[sl]
  np.testing.assert_array_equal(rebuilt, logical)
  np.testing.assert_array_equal(written, 1)




@pytest.mark.parametrize("step", [-1, 5.0, True, "08", "7", None, np.float32(3)])
def test_save_refuses_a_step_that_is_not_a_non_negative_integer(tmp_path, step):
  ck = Checkpointer(tmp_path)
  with pytest.raises(ValueError, match=r"checkpoint step must be an integer >= 0, got"):
    ck.save(step, tiny_state(), {})
  assert list(tmp_path.iterdir()) == []


def test_numpy_integer_steps_save_list_restore_and_rotate(tmp_path):
  ck = Checkpointer(tmp_path, max_to_keep=2)
  for step in (np.int64(7), np.int32(8), 9):
    ck.save(step, tiny_state(), {"n": int(step)})
  assert ck.steps() == [8, 9] and sorted(p.name for p in tmp_path.iterdir()) == ["8", "9"]
  restored, meta = ck.restore(tiny_state(), step=np.int64(8))
  np.testing.assert_array_equal(restored["params"]["w"], tiny_state()["params"]["w"])
  assert ck.read_meta(np.int64(9)) == {"n": 9}


def test_a_linked_step_folder_is_never_followed_nor_fails_a_save(tmp_path, corpus, capsys):
  """flax_tp writes no links: a run refuses to start where a step is one (a save or
  --overwrite would delete through it); one made while a run rotates is left alone
  (not a step), and a step that cannot be rotated out is a warning, not a failed save."""
  elsewhere = tmp_path / "elsewhere"
  ck = Checkpointer(tmp_path / "ck", max_to_keep=1)
  ck.save(4, tiny_state(), {})
  (tmp_path / "ck" / "4").rename(elsewhere)
  (tmp_path / "ck" / "4").symlink_to(elsewhere, target_is_directory=True)
  assert ck.steps() == []  # a link is not a step: nothing rotates it or restores from it
  ck.save(16, tiny_state(), {})
  ck.save(17, tiny_state(), {})
  assert ck.steps() == [17] and (tmp_path / "ck" / "4").is_symlink()
  assert sorted(p.name for p in elsewhere.iterdir()) == ["index.0.json", "meta.json",
                                                         "shards.0.bin"]
  with pytest.raises(CheckpointSaveError, match="is a symbolic link, which flax_tp did not"):
    ck.save(4, tiny_state(), {})
  assert main([*SHORT_RUN_FLAGS, "--checkpoint-dir", str(tmp_path / "ck"), "--overwrite"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "/ck/4' is a symbolic link" in err, err
  assert elsewhere.is_dir()

  (tmp_path / "ck" / "4").unlink()
  import flax_tp.checkpoint.checkpointer as checkpoint

  def busy(folder):
    raise OSError(errno.EBUSY, "Device or resource busy", str(folder))
  original, checkpoint.rotate_out = checkpoint.rotate_out, busy
  try:
    with pytest.warns(UserWarning, match="checkpoint step 18 saved in .*, but older step 17 "
                                         "could not be deleted: Device or resource busy"):
      ck.save(18, tiny_state(), {})
  finally:
    checkpoint.rotate_out = original
  assert ck.steps() == [17, 18]
