"""Auditing the collectives of a compiled computation.

``collectives(compiled.as_text(), mesh)`` lists every all-reduce, all-gather,
reduce-scatter, collective-permute and all-to-all in optimized HLO, with the
bytes it moves per device and the mesh axes it spans, so that a test or a
benchmark can check that a step communicates exactly what Megatron's scheme
says and nothing more.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re

import numpy as np
from jax.sharding import Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_OP = re.compile(r"=\s*(?P<shape>.*?)\s(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str
  operands: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each result
  bytes: int  # result bytes per device
  axes: tuple[str, ...]  # mesh axes the replica groups span ("?" if unknown)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
  bits = _BITS.get(dtype) or int(dtype[1:])
  return int(np.prod(shape, dtype=np.int64)) * bits // 8


def _groups(line: str) -> list[tuple[int, ...]] | None:
  explicit = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
  if explicit:
    return [tuple(int(i) for i in g.split(",") if i)
            for g in re.findall(r"\{([\d,]*)\}", explicit[1])]
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if iota:
    dims = [int(d) for d in iota[3].split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota[4]:
      ids = ids.transpose([int(p) for p in iota[4].split(",")])
    return [tuple(g) for g in ids.reshape(int(iota[1]), int(iota[2])).tolist()]
  pairs = re.search(r"source_target_pairs=\{(\{[\d,{}]*\})\}", line)
  if pairs:  # a collective-permute: the devices its pairs connect, as groups
    return _connected([tuple(int(i) for i in p.split(","))
                       for p in re.findall(r"\{(\d+,\d+)\}", pairs[1])])
  named = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                    r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line)
  if named:  # a mesh of named axes over iota device ids; groups span the listed axes
    sizes = [int(n) for n in re.findall(r"=(\d+)", named[1])]
    names = re.findall(r"'([^']+)'=", named[1])
    dims = [int(d) for d in named[2].split(",")] if named[2] else sizes
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if named[3]:
      ids = ids.transpose([int(p) for p in named[3].split(",")])
    ids = ids.reshape(sizes)
    spanned = [names.index(a) for a in re.findall(r"'([^']+)'", named[4])]
    kept = [a for a in range(len(sizes)) if a not in spanned]
    ids = np.moveaxis(ids, kept, list(range(len(kept))))
    return [tuple(g.ravel().tolist())
            for g in ids.reshape(-1, int(np.prod([sizes[a] for a in spanned])))]
  return None


def _connected(pairs: list[tuple[int, int]]) -> list[tuple[int, ...]]:
  """The groups of devices that ``pairs`` (source, target) link, each sorted."""
  group = {}
  for a, b in pairs:
    merged = group.get(a, {a}) | group.get(b, {b})
    for i in merged:
      group[i] = merged
  return sorted({tuple(sorted(g)) for g in group.values()})


def _axes(groups: list[tuple[int, ...]] | None, mesh: Mesh) -> tuple[str, ...]:
  """Which mesh axes a set of replica groups spans (positions in ``mesh.devices``)."""
  if groups is None:
    return ("?",)
  wanted = {frozenset(g) for g in groups}
  index = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  names = mesh.axis_names
  for r in range(1, len(names) + 1):
    for axes in itertools.combinations(range(len(names)), r):
      others = [a for a in range(len(names)) if a not in axes]
      moved = np.moveaxis(index, others, list(range(len(others))))
      expected = {frozenset(g.ravel().tolist())
                  for g in moved.reshape(-1, *[mesh.devices.shape[a] for a in axes])}
      if expected == wanted:
        return tuple(names[a] for a in axes)
  return ("?",)


def collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
  """Every collective in optimized HLO text (``jax.jit(f).lower(...).compile().as_text()``)."""
  found = []
  for line in hlo_text.splitlines():
    match = _OP.search(line)
    if not match or "-done(" in line:
      continue
    operands = tuple((dtype, tuple(int(d) for d in dims.split(",") if d))
                     for dtype, dims in _ARRAY.findall(match["shape"]))
    found.append(Collective(match["kind"], operands, sum(_nbytes(*o) for o in operands),
                            _axes(_groups(line), mesh)))
  return found


def sent_bytes(c: Collective, mesh: Mesh) -> float:
  """The bytes each device sends for ``c`` as a ring (or a direct exchange) moves it over
  the ``n`` devices of its axes: an all-gather or all-to-all of a result of ``b`` bytes
  ``(n - 1) / n * b`` (each block but its own), a reduce-scatter ``(n - 1) * b``, an
  all-reduce ``2 (n - 1) / n * b``, a collective-permute ``b``."""
  n = math.prod(mesh.shape[a] for a in c.axes if a in mesh.shape) if "?" not in c.axes \
      else mesh.size
  if n <= 1:
    return 0.0
  factor = {"all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
            "reduce-scatter": n - 1, "all-reduce": 2 * (n - 1) / n}.get(c.kind, 1.0)
  return c.bytes * factor


def tally(found: list[Collective]) -> dict[str, dict[str, int]]:
  """Per ``"kind@axes"``: ops, and tensors/bytes split into arrays and scalars.

  XLA packs independent collectives over the same devices into one op, so ops
  undercount; tensors count each reduced array once. Scalars are kept apart:
  in a train step they are bookkeeping (gradient clipping's partial norms, the
  loss), not activations or gradients.
  """
  out: dict[str, dict[str, int]] = {}
  for c in found:
    row = out.setdefault(f"{c.kind}@{'+'.join(c.axes)}", dict.fromkeys(
        ("ops", "tensors", "bytes", "scalars", "scalar_bytes"), 0))
    row["ops"] += 1
    for dtype, shape in c.operands:
      kind = "scalar" if shape == () else "tensor"
      row["scalars" if kind == "scalar" else "tensors"] += 1
      row["scalar_bytes" if kind == "scalar" else "bytes"] += _nbytes(dtype, shape)
  return out


def arrays_sent(found: list[Collective],
                by_elements: tuple[tuple[str, ...], ...] = ()) -> collections.Counter:
  """How many times each array is sent: ``(kind, axes, dtype, shape)`` per array of
  every collective, leading 1s of the shape dropped (a ``shard_map``'s per-device
  axis), so that two programs' traffic compares array by array whatever packed it.

  ``by_elements``: the axes (``(("data",),)``) whose collectives' arrays, scalars
  apart, are counted by their elements under one key ``(kind, axes, dtype,
  "elements")``: a step that sends its gradient sums packed into flat arrays
  (``flax_tp.copy_all_to_parallel``) then compares with one that sends them one by one.
  """
  out: collections.Counter = collections.Counter()
  for c in found:
    for dtype, shape in c.operands:
      while shape and shape[0] == 1:
        shape = shape[1:]
      if shape and c.axes in by_elements:
        out[(c.kind, c.axes, dtype, "elements")] += math.prod(shape)
      else:
        out[(c.kind, c.axes, dtype, shape)] += 1
  return out
