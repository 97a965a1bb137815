"""A tensor-parallel plan inferred from how a model computes (``parallelize(plan=None)``).

The forward pass is traced once, abstractly (``jax.make_jaxpr``: no FLOPs), with
every ``nnx.Linear`` / ``nnx.Embed`` call marked where its input enters and its
output leaves. Following the data from each layer's output to the layer inputs
it reaches gives the pairs Megatron would choose:

- a group of linear layers whose outputs reach exactly one linear layer R (not
  the model's output, not any other layer), where R's input comes from that group
  alone (no residual mixed in), is a column group feeding row layer R: q, k, v ->
  o through attention; gate, up -> down through SwiGLU; up -> down through GELU;
- where a column output is reshaped ``[..., F] -> [..., H, D]`` the split keeps
  heads whole (``shard_unit=D``), and so does its row layer's;
- where a column output is first split into parts (``jnp.split``: a fused q/k/v
  projection's ``[q | k | v]``), each part is split over the devices on its own
  (``SegmentedLayout``), so every device holds whole heads of each part and the
  split needs no communication; so too where it is reshaped ``[..., F] -> [..., P,
  H, D]`` and the model then picks from the ``P`` axis (``t[:, :, 0]``, ``unstack``,
  ``split``, after transposes too); picked from the ``H`` axis instead (a per-head
  ``[..., H, 3, D]`` layout), each head's ``3 * D`` block stays whole. A reshape of
  that kind whose picking the trace cannot follow is reported by ``explain_plan``;
- embeddings are split over their vocabulary;
- a layer whose params the model also reads outside the layer's own call
  (``h @ self.up.kernel[...]``) stays whole: split, that code would see the
  padded, sharded param instead of the one it was written for;
- every other linear layer stays replicated, with the reason reported.

Names and shapes are never guessed from. Because the swapped layers are exact
in their standalone form, an inferred plan can cost communication but cannot
change a result.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx
from jax.extend import core as jcore

_mark_p = jcore.Primitive("flax_tp_plan_mark")
_mark_p.def_impl(lambda x, **_: x)
_mark_p.def_abstract_eval(lambda x, **_: x)

_OUTPUT = "<model output>"


def _mark(x: jax.Array, kind: str, path: str) -> jax.Array:
  return _mark_p.bind(x, kind=kind, path=path)


@dataclass
class Trace:
  """What the traced forward pass says about each marked layer."""

  reaches: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
  feeds: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
  pure_input: dict[str, bool] = field(default_factory=dict)  # input from layers only
  head_dim: dict[str, int] = field(default_factory=dict)  # column path -> D of its reshape
  called: set[str] = field(default_factory=set)
  direct: set[str] = field(default_factory=set)  # layers whose params are read outside them
  # column path -> sizes of the parts its output is split into on the last axis (None:
  # split in two different ways)
  segments: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
  # column path -> (P, H, D) of a reshape of its output to [..., P, H, D], and which of
  # P ("parts") or H ("heads") the model picks from (None: not seen, or both)
  grouped: dict[str, tuple[tuple[int, int, int], str | None]] = field(default_factory=dict)
  # column path -> how the model takes its parts apart: "concat" (jnp.split) or "stacked"
  # (a reshape to [..., P, H, D]); the column's standalone output is built to match
  parts_form: dict[str, str] = field(default_factory=dict)
  # column path -> the block its own split keeps whole when it is more than a head
  # (a per-head [..., H, P, D] layout: each head's P * D outputs)
  block: dict[str, int] = field(default_factory=dict)
  # values of such a reshape (or its transposes) -> (column path, axis of P, axis of H)
  _group_axes: dict[Any, tuple[str, int, int]] = field(default_factory=dict)


_PARAM = "<param>"  # taint prefix: a layer's param read as a value


def _key_part(entry: Any) -> Any:
  for attr in ("key", "idx"):
    if hasattr(entry, attr):
      return getattr(entry, attr)
  return None  # GetAttrKey('value'): the Variable's own value


def trace(model: nnx.Module, layer_paths: Sequence[str], inputs: Sequence[Any]) -> Trace:
  """Traces ``model(*inputs)`` with each layer in ``layer_paths`` marked where its input
  enters, its output leaves and its params are read, and follows the data between them.

  The model's state enters the trace as arguments (``nnx.split``), so a param read
  anywhere else than inside its layer's call is seen too."""
  originals = {(cls, name): getattr(cls, name)
               for cls, name in ((nnx.Linear, "__call__"), (nnx.Embed, "__call__"),
                                 (nnx.Embed, "attend"))}
  wanted = set(layer_paths)
  graphdef, state = nnx.split(model)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  owners = []  # each state leaf's layer path, when it is a marked layer's param
  for path, _ in flat:
    parts = [p for p in map(_key_part, path) if p is not None]
    owner = ".".join(str(p) for p in parts[:-1])
    owners.append(owner if owner in wanted else None)
  paths: dict[int, str] = {}  # id(module of the traced model) -> path

  def marked(original):
    def call(self, x, *args, **kwargs):
      path = paths.get(id(self))
      if path is None:
        return original(self, x, *args, **kwargs)
      params = {name: v for name, v in vars(self).items() if isinstance(v, nnx.Param)}
      held = {name: v[...] for name, v in params.items()}
      try:
        for name, v in params.items():  # the layer's own reads of its params
          v[...] = _mark(held[name], "param", path)
        return _mark(original(self, _mark(x, "in", path), *args, **kwargs), "out", path)
      finally:
        for name, v in params.items():
          v[...] = held[name]
    return call

  def forward(leaves, *xs):
    traced = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
    paths.update({id(m): p for p, m in ((".".join(str(q) for q in parts), m)
                                        for parts, m in nnx.iter_modules(traced))
                  if p in wanted})
    return traced(*xs)

  try:
    for (cls, name), original in originals.items():
      setattr(cls, name, marked(original))
    closed = jax.make_jaxpr(forward)([leaf for _, leaf in flat], *inputs)
  finally:
    for (cls, name), original in originals.items():
      setattr(cls, name, original)
  result = Trace()
  taints: dict[Any, frozenset] = {}
  outer = frozenset({"<input>"})
  invars = closed.jaxpr.invars
  for v, owner in zip(invars[:len(owners)], owners, strict=True):
    taints[v] = frozenset() if owner is None else frozenset({_PARAM + owner})
  for v in invars[len(owners):]:
    taints[v] = outer
  _propagate(closed.jaxpr, taints, result)
  for source, ((parts, heads, dim), picked) in result.grouped.items():
    if picked == "parts":  # [..., P, H, D]: P parts of H heads each
      sizes = (heads * dim,) * parts
      known = result.segments.get(source, sizes)
      result.segments[source] = sizes if known == sizes else None
      result.head_dim.setdefault(source, dim)
      result.parts_form.setdefault(source, "stacked")
    elif picked == "heads":  # [..., H, P, D]: each head's P * D block together
      result.head_dim.setdefault(source, dim)
      result.block.setdefault(source, heads * dim)
  for v in closed.jaxpr.outvars:
    for source in _taint(v, taints):
      if source in paths.values():
        result.reaches[source].add(_OUTPUT)
  return result


def _taint(v: Any, taints: dict) -> frozenset:
  return frozenset() if isinstance(v, jcore.Literal) else taints.get(v, frozenset())


def _sub_jaxpr(eqn) -> Any:
  """The one inner jaxpr of a call-like equation whose inputs map one to one, or None."""
  subs = [p for p in eqn.params.values() if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]
  if len(subs) != 1:
    return None
  sub = subs[0].jaxpr if isinstance(subs[0], jcore.ClosedJaxpr) else subs[0]
  if len(sub.invars) != len(eqn.invars) or len(sub.outvars) != len(eqn.outvars):
    return None
  return sub


def _propagate(jaxpr, taints: dict, result: Trace) -> None:
  """Forward pass over ``jaxpr``: each value's taint is the set of marked layers whose
  output it depends on (reset at every layer's output; "<input>" for model inputs)."""
  for eqn in jaxpr.eqns:
    ins = [_taint(v, taints) for v in eqn.invars]
    if eqn.primitive is _mark_p:
      path, kind = eqn.params["path"], eqn.params["kind"]
      if kind == "param":  # the layer reading its own param: not a direct read
        taints[eqn.outvars[0]] = frozenset()
      elif kind == "in":
        result.called.add(path)
        for source in ins[0]:
          result.reaches[source].add(path)
          result.feeds[path].add(source)
        result.pure_input[path] = result.pure_input.get(path, True) and bool(ins[0]) and all(
            source != "<input>" for source in ins[0])
        taints[eqn.outvars[0]] = ins[0]
      else:
        taints[eqn.outvars[0]] = frozenset({path})
      continue
    sub = _sub_jaxpr(eqn)
    if sub is not None:  # a nested jit, custom_jvp/vjp or call: look inside
      inner = {iv: t for iv, t in zip(sub.invars, ins, strict=True)}
      axes = result._group_axes
      axes.update({iv: axes[v] for iv, v in zip(sub.invars, eqn.invars, strict=True)
                   if not isinstance(v, jcore.Literal) and v in axes})
      _propagate(sub, inner, result)
      for ov, iv in zip(eqn.outvars, sub.outvars, strict=True):
        taints[ov] = _taint(iv, inner)
        if not isinstance(iv, jcore.Literal) and iv in axes:
          axes[ov] = axes[iv]
      continue
    union = frozenset().union(*ins) if ins else frozenset()
    result.direct.update(t[len(_PARAM):] for t in union if t.startswith(_PARAM))
    for ov in eqn.outvars:
      taints[ov] = union
    if eqn.primitive.name == "split" and len(ins[0]) == 1:
      (source,) = ins[0]
      if eqn.params["axis"] == eqn.invars[0].aval.ndim - 1:
        sizes = tuple(int(n) for n in eqn.params["sizes"])
        known = result.segments.get(source, sizes)
        result.segments[source] = sizes if known == sizes else None
        result.parts_form[source] = "concat"
    if eqn.primitive.name == "reshape" and len(ins[0]) == 1:
      (source,) = ins[0]
      before, after = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
      # [..., F] -> [..., H, D]: the heads of source's output (whole heads stay on a device)
      if (len(after) == len(before) + 1 and after[:-2] == before[:-1]
          and after[-2] * after[-1] == before[-1] and source not in result.head_dim):
        result.head_dim[source] = after[-1]
      # [..., F] -> [..., P, H, D]: parts of heads, or heads of parts: what the model
      # picks from next tells (_note_pick)
      if (len(after) == len(before) + 2 and after[:-3] == before[:-1]
          and after[-3] * after[-2] * after[-1] == before[-1]):
        result.grouped.setdefault(source, (tuple(after[-3:]), None))
        result._group_axes[eqn.outvars[0]] = (source, len(after) - 3, len(after) - 2)
    _note_pick(eqn, result)


def _note_pick(eqn, result: Trace) -> None:
  """Follows a ``[..., P, H, D]`` reshape of a column output through transposes to the
  op that picks from it: along the ``P`` axis the output is ``P`` parts of heads, along
  the ``H`` axis heads of ``P`` parts each (``Trace.grouped``)."""
  x = eqn.invars[0] if eqn.invars else None
  if x is None or isinstance(x, jcore.Literal) or x not in result._group_axes:
    return
  source, axis_p, axis_h = result._group_axes[x]
  name, shape = eqn.primitive.name, x.aval.shape
  if name == "transpose":
    perm = list(eqn.params["permutation"])
    result._group_axes[eqn.outvars[0]] = (source, perm.index(axis_p), perm.index(axis_h))
    return
  if name in ("split", "unstack"):
    axes = {eqn.params["axis"] % len(shape)}
  elif name == "slice":
    axes = {i for i, (lo, hi, n) in enumerate(zip(eqn.params["start_indices"],
                                                  eqn.params["limit_indices"], shape,
                                                  strict=True)) if (lo, hi) != (0, n)}
  else:
    return
  picked = "parts" if axes == {axis_p} else "heads" if axes == {axis_h} else None
  if picked is None:
    return
  sizes, seen = result.grouped[source]
  result.grouped[source] = (sizes, picked if seen in (None, picked) else "both")


def unfollowed(found: Trace, path: str) -> str | None:
  """``[..., P, H, D]`` when the column output at ``path`` is reshaped so and the trace
  did not see whether the model picks parts or heads from it; else None."""
  grouped = found.grouped.get(path)
  if grouped is None or grouped[1] in ("parts", "heads"):
    return None
  return f"[..., {', '.join(map(str, grouped[0]))}]"


def infer(entries_by_path: dict[str, nnx.Module], found: Trace) -> dict[str, tuple]:
  """``{path: (style, unit, reason, segments)}`` for every layer from the traced data
  flow (``segments``: see ``segments_of``)."""
  plan: dict[str, tuple] = {}
  linears = {p for p, m in entries_by_path.items() if type(m) is nnx.Linear}
  direct = "kept whole: the model reads its params outside its call (split, they would be padded)"
  for path in found.direct:
    plan[path] = ("replicate", 1, direct, None)
  for path, module in entries_by_path.items():
    if type(module) is nnx.Embed and path not in found.direct:
      plan[path] = ("vocab", 1, "embedding: split over its vocabulary", None)
  for row in sorted(linears - found.direct):
    group = found.feeds.get(row, set())
    if not group or not group <= linears - found.direct or not found.pure_input.get(row, False):
      continue
    if any(found.reaches.get(col, set()) != {row} for col in group):
      continue
    unit = head_unit(found, group)
    names = ", ".join(sorted(group))
    for col in group:
      col_unit = column_unit(found, col, group, entries_by_path[col].out_features)
      parts = segments_of(found, col, entries_by_path[col].out_features, col_unit)
      plan[col] = ("column", col_unit,
                   f"feeds only {row}" + (f" (heads of {unit})" if unit > 1 else "")
                   + (f"; its output is split into {len(parts)} parts, each split on its own"
                      if parts else ""), parts)
    row_unit = head_unit(found, group, entries_by_path[row].in_features)
    plan[row] = ("row", row_unit, f"reads only {names}: one all-reduce", None)
  for path in entries_by_path:
    if path in plan:
      continue
    reached = found.reaches.get(path, set())
    if path not in found.called:
      why = "not called in the traced forward pass"
    elif _OUTPUT in reached:
      why = "its output leaves the model"
    elif len(reached) > 1:
      why = f"its output reaches several layers ({', '.join(sorted(reached))})"
    else:
      why = "its reader also reads other values (e.g. a residual)"
    plan[path] = ("replicate", 1, f"kept whole: {why}", None)
  return {path: plan[path] for path in entries_by_path}  # in the model's order


def head_unit(found: Trace, columns: Any, features: int | None = None) -> int:
  """The head size the trace saw on the outputs of ``columns`` (1 unless they agree),
  kept only where it divides ``features``."""
  units = {found.head_dim.get(col, 1) for col in columns}
  unit = units.pop() if len(units) == 1 else 1
  return unit if features is None or features % unit == 0 else 1


def column_unit(found: Trace, path: str, group: Any, features: int) -> int:
  """The unit a column layer is split in: the block its own output is grouped in
  (``Trace.block``), else the head size its group agrees on (``head_unit``)."""
  block = found.block.get(path)
  if block and features % block == 0:
    return block
  return head_unit(found, group, features)


def segments_of(found: Trace, path: str, features: int, unit: int) -> tuple[int, ...] | None:
  """The parts a column's output is split into, when the trace saw one consistent split
  of all its features into parts of whole ``unit`` blocks; else None."""
  parts = found.segments.get(path)
  if not parts or len(parts) < 2 or sum(parts) != features or any(p % unit for p in parts):
    return None
  return parts
