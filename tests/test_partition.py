import jax.numpy as jnp
import numpy as np
import pytest

from flax_tp import KVHeadLayout, SegmentedLayout, ShardLayout, split_tensor_for_parallelism


def test_reference_rows_10_over_3():
  t = np.arange(10).reshape(10, 1)
  shards = [split_tensor_for_parallelism(t, i, 3, 0)[:, 0].tolist() for i in range(3)]
  assert shards == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_reference_11x2_over_4():
  t = jnp.arange(22).reshape(11, 2)
  assert [split_tensor_for_parallelism(t, i, 4, 0).shape[0] for i in range(4)] == [3, 3, 3, 2]


def test_last_dim_negative():
  t = np.arange(30).reshape(2, 5, 3)
  shards = [split_tensor_for_parallelism(t, i, 3, -1) for i in range(3)]
  assert [s.shape for s in shards] == [(2, 5, 1)] * 3
  np.testing.assert_array_equal(np.concatenate(shards, axis=-1), t)


@pytest.mark.parametrize("n,k", [(10, 4), (7, 3), (257, 4), (8, 8), (3, 4), (0, 2)])
@pytest.mark.parametrize("xp", [np, jnp])
def test_concatenation_restores_and_matches_array_split(n, k, xp):
  t = xp.arange(n * 2).reshape(n, 2)
  shards = [split_tensor_for_parallelism(t, i, k, 0) for i in range(k)]
  assert all(type(s) is type(t) or isinstance(s, type(t)) for s in shards)
  for mine, ref in zip(shards, np.array_split(np.asarray(t), k, axis=0), strict=True):
    np.testing.assert_array_equal(mine, ref)
  np.testing.assert_array_equal(np.concatenate(shards, axis=0), t)


def test_more_devices_than_rows_gives_empty_shards():
  t = np.arange(3)
  assert [split_tensor_for_parallelism(t, i, 4, 0).shape for i in range(4)] == [(1,)] * 3 + [(0,)]


@pytest.mark.parametrize("index,count,dim,match", [
    (0, 0, 0, "device_count"), (0, -1, 0, "device_count"), (3, 3, 0, "index"),
    (-1, 3, 0, "index"), (0, 2, 2, "dim 2"), (0, 2, -3, "dim -3"),
])
def test_errors(index, count, dim, match):
  with pytest.raises(ValueError, match=match):
    split_tensor_for_parallelism(np.zeros((4, 4)), index, count, dim)


def test_layout_uneven():
  layout = ShardLayout(10, 4)
  assert layout.sizes == (3, 3, 2, 2) and layout.offsets == (0, 3, 6, 8)
  assert layout.padded_size == 3 and layout.padded_total == 12 and not layout.is_even
  x = np.arange(20.0).reshape(2, 10)
  stored = layout.pad(x, -1)
  assert stored.shape == (2, 12)
  np.testing.assert_array_equal(stored[:, ~layout.valid_mask()], 0)
  np.testing.assert_array_equal(layout.unpad(stored, -1), x)
  np.testing.assert_array_equal(layout.unpad(layout.pad(jnp.asarray(x), 1), 1), x)


def test_layout_whole_units():
  # 6 heads of width 2 over 4 devices: 2, 2, 1, 1 heads; a head never straddles.
  layout = ShardLayout(12, 4, unit=2)
  assert layout.sizes == (4, 4, 2, 2) and layout.padded_size == 4
  stored = layout.pad(np.arange(12), 0)
  np.testing.assert_array_equal(stored, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 10, 11, 0, 0])
  with pytest.raises(ValueError, match="multiple of unit"):
    ShardLayout(7, 2, unit=2)


def test_layout_even_is_identity():
  layout = ShardLayout(8, 4)
  x = np.arange(8)
  assert layout.is_even and layout.pad(x, 0) is x and layout.unpad(x, 0) is x


def test_segmented_layout_holds_whole_heads_of_each_part():
  """[q | k | v] of 3, 1 and 1 heads of 2 over 2 shards: each shard holds its own heads
  of every part, each part's slot padded on its own; pad/unpad and runs agree."""
  from flax_tp import SegmentedLayout
  layout = SegmentedLayout(10, 2, 2, (6, 2, 2))
  # q heads 0-1 | 2; k head 0 | none; v head 0 | none: slots of 4, 2 and 2.
  assert layout.slot_offsets == (0, 4, 6) and layout.padded_size == 8
  assert layout.sizes == (8, 2) and not layout.is_even
  x = np.arange(10)
  stored = layout.pad(x, 0)
  np.testing.assert_array_equal(stored, [0, 1, 2, 3, 6, 7, 8, 9,  4, 5, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(layout.unpad(stored, 0), x)
  np.testing.assert_array_equal(stored[layout.valid_indices()], x)
  np.testing.assert_array_equal(stored[~layout.valid_mask()], 0)
  np.testing.assert_array_equal(layout.local_mask(1), [1, 1, 0, 0, 0, 0, 0, 0])
  assert layout.runs(0) == ((0, 4, 0), (4, 2, 6), (6, 2, 8)) and layout.runs(1)[0] == (0, 2, 4)
  with pytest.raises(TypeError, match="use runs"):
    _ = layout.offsets
  with pytest.raises(ValueError, match="whole heads"):
    SegmentedLayout(9, 2, 2, (5, 2, 2))


@pytest.mark.parametrize("layout", [
    ShardLayout(10, 4), ShardLayout(12, 3, unit=2),
    KVHeadLayout(2 * 4, 4, 4, num_heads=6),  # kv heads 0, 0-1, 1, 1: replicated
    KVHeadLayout(4 * 2, 2, 2, num_heads=8),  # lines up: no copies
    SegmentedLayout(16, 3, 4, (8, 4, 4)),
], ids=["plain", "unit", "kv-replicated", "kv-even", "segmented"])
def test_every_layout_answers_the_same_questions(layout):
  """Callers never ask which layout they hold: each one's first-copy runs cover every
  logical element exactly once, its replica weights make each count once, and
  ``replicated`` says whether any element is stored twice."""
  table = layout.stored_positions()
  held = np.zeros(layout.size, int)
  for i in range(layout.parts):
    for at, length, start in layout.first_copy_runs(i):
      np.testing.assert_array_equal(table[i, at:at + length], start + np.arange(length))
      held[start:start + length] += 1
  np.testing.assert_array_equal(held, 1)
  copies = np.bincount(table[table < layout.size], minlength=layout.size)
  assert layout.replicated == bool((copies > 1).any())
  weights = layout.replica_weights()
  if weights is None:
    assert not layout.replicated
    weights = (table < layout.size).astype(float)
  counted = np.zeros(layout.size)
  np.add.at(counted, table[table < layout.size], weights[table < layout.size])
  np.testing.assert_allclose(counted, 1.0)
