"""Checkpoint geometry: which logical boxes a device block of a stored array holds.

A stored (padded) array's device block covers a range of stored positions on each
dimension; on a padded dimension (the one split over ``"model"``, and a mixture of
experts' experts split over ``"data"``) each padded shard in it holds its layout's
logical runs, padding none. ``boxes`` turns one block into the logical boxes
it holds: what the writer writes (each logical element once: ``first_copies``) and the
reader fills.
"""

from __future__ import annotations

from flax_tp.partition import ShardLayout


def stored_runs(stored: slice, layout: ShardLayout | None,
          first_copies: bool = False) -> list[tuple[int, int, int]]:
  """``[(stored_start, stored_stop, logical_start)]``: the logical data in a stored range.

  Without a layout the stored range is logical. With one, each padded shard
  ``i`` of the range contributes its logical runs (``layout.runs(i)``: its first
  ``sizes[i]`` elements, or one slot per segment of a ``SegmentedLayout``); padding
  none. ``first_copies`` keeps only elements no earlier shard holds (a
  ``KVHeadLayout`` stores some kv heads on several shards; a checkpoint writes each once).
  """
  if layout is None:
    return [(stored.start, stored.stop, stored.start)]
  q, runs = layout.padded_size, []
  for i in range(stored.start // q, -(-stored.stop // q)):
    shard_runs = layout.first_copy_runs(i) if first_copies else layout.runs(i)
    for local, size, logical in shard_runs:
      lo = max(stored.start, i * q + local)
      hi = min(stored.stop, i * q + local + size)
      if hi > lo:
        runs.append((lo, hi, logical + lo - (i * q + local)))
  return runs


def logical_boxes(index: tuple[slice, ...], shape: tuple[int, ...],
                  layouts: dict[int, ShardLayout], first_copies: bool = False
                  ) -> list[tuple[tuple[slice, ...], tuple[int, ...], tuple[int, ...]]]:
  """The logical boxes inside one device block of a stored array.

  ``index`` is the block's place in the stored array; ``layouts`` the layout of each
  padded dimension (by dimension; the others are logical). Returns
  ``[(slices into the block, logical start, box shape)]``; empty when the block
  holds only padding.
  """
  index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
  per_dim = [stored_runs(s, layouts.get(d), first_copies) for d, s in enumerate(index)]
  boxes = [((), (), ())]
  for d, runs in enumerate(per_dim):
    base = index[d].start
    boxes = [(sl + (slice(a - base, b - base),), st + (c,), sh + (b - a,))
             for sl, st, sh in boxes for a, b, c in runs]
  return boxes
