"""Tensor parallelism for a Flax NNX model written without flax_tp: ``parallelize``.

A *plan* maps glob patterns over dot-joined module paths (``"blocks.*.attn.q"``,
matched against the whole path) to a style:

- ``"column"`` (HF's ``"colwise"``): an ``nnx.Linear`` split over its outputs
  (``ColumnParallelDense``, output left split: ``gather_output=False``);
- ``"row"`` (``"rowwise"``): an ``nnx.Linear`` split over its inputs (``RowParallelDense``);
- ``"vocab"``: an ``nnx.Embed`` split over its rows (``VocabParallelEmbedding``);
- ``"embed_features"``: an ``nnx.Embed`` split over its features (``ParallelEmbedding``);
- ``"replicate"``: left as it is, its params replicated on the mesh.

``parallelize`` swaps the planned modules for flax_tp layers holding the same
values (nothing is re-initialised) and puts every other param on the mesh,
replicated. Each swapped layer runs in its standalone form (its own
``shard_map``), so the model is called exactly as before and gives what it gave.
Under ``jax.jit``, a column layer's output stays split over the model axis (the
partitioner carries the split through elementwise and reshaping code) and the
row layer that consumes it reads it in place: with sizes the axis divides, a
column -> row pair costs Megatron's one all-reduce. Column layers that read one
input (q, k, v; gate, up) share one backward all-reduce of its gradient, a param
used twice (a tied embedding) is summed over ``"data"`` once
(``flax_tp.layer.per_device_copies``), and a tied head's logits stay split over
the vocabulary, so the plain loss reduces ``[b, s]`` sums across devices instead
of gathering ``[b, s, vocab]``.

``plan=None`` infers the plan from the traced data flow (``plan_inference``). A
given plan with ``inputs`` gets the same trace: heads kept whole, a column output
the model splits into parts (a fused q/k/v) split part by part, and a refusal for a
split layer whose params the model reads outside its call.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from flax_tp import plan_inference
from flax_tp.embedding import ParallelEmbedding, VocabParallelEmbedding
from flax_tp.linear import ColumnParallelDense, RowParallelDense
from flax_tp.logical import load_unsharded
from flax_tp.mesh import MODEL_AXIS
from flax_tp.params import replicate_on_mesh, user_metadata
from flax_tp.partition import SegmentedLayout, ShardLayout

STYLES = ("column", "row", "vocab", "embed_features", "replicate")
ALIASES = {"colwise": "column", "rowwise": "row"}  # HF transformers' tp_plan names
_FITS = {"column": nnx.Linear, "row": nnx.Linear, "vocab": nnx.Embed,
         "embed_features": nnx.Embed}


@dataclass(frozen=True)
class _Entry:
  """One planned module: its path, the module, its style and what chose it (a plan
  pattern, or the inference's reason); ``unit`` splits the features in whole heads."""

  path: str
  parts: tuple  # the path as nnx gives it: attribute names and list indices
  module: nnx.Module
  style: str
  pattern: str | None
  unit: int = 1
  reason: str = ""
  segments: tuple[int, ...] | None = None  # a column output split into these parts
  regrouped: str | None = None  # a reshape of a column output the trace could not follow
  parts_form: str = "concat"  # how the model takes the segments apart (ColumnParallelDense)


def _style(name: Any, pattern: str) -> str:
  style = ALIASES.get(name, name)
  if style not in STYLES:
    raise ValueError(f"plan pattern {pattern!r}: unknown style {name!r}; expected one of "
                     f"{STYLES} (or {tuple(ALIASES)})")
  return style


def _resolve(model: nnx.Module, plan: dict[str, str]) -> list[_Entry]:
  """Every ``nnx.Linear`` / ``nnx.Embed`` of ``model`` (and every other planned module)
  with its style; unplanned layers are ``"replicate"`` with no pattern."""
  if not isinstance(plan, dict) or not plan:
    raise ValueError(f"plan must be a non-empty dict of glob pattern -> style, got {plan!r}")
  styles = {pattern: _style(name, pattern) for pattern, name in plan.items()}
  used: set[str] = set()
  entries = []
  for parts, module in nnx.iter_modules(model):
    if not parts:
      continue
    path = ".".join(str(p) for p in parts)
    matches = [p for p in styles if fnmatch.fnmatchcase(path, p)]
    used.update(matches)
    chosen = {styles[p] for p in matches}
    if len(chosen) > 1:
      raise ValueError(f"module {path!r} is matched by patterns with different styles: "
                       + ", ".join(f"{p!r} -> {styles[p]!r}" for p in matches))
    if chosen:
      style = chosen.pop()
      fits = _FITS.get(style)
      if fits is not None and type(module) is not fits:
        raise ValueError(f"style {style!r} (pattern {matches[0]!r}) does not fit module "
                         f"{path!r}, a {type(module).__name__}: it needs an "
                         f"nnx.{fits.__name__}")
      entries.append(_Entry(path, parts, module, style, matches[0]))
    elif type(module) in (nnx.Linear, nnx.Embed):
      entries.append(_Entry(path, parts, module, "replicate", None))
  unused = [p for p in styles if p not in used]
  if unused:
    raise ValueError(f"plan patterns match no module: {unused} (module paths look like "
                     f"{[e.path for e in entries[:3]]})")
  return entries


def _parallel_layer(entry: _Entry, mesh: Mesh, axis_name: str) -> nnx.Module | None:
  """The flax_tp layer for ``entry`` with the module's own values; None to keep it."""
  m = entry.module
  if entry.style in ("column", "row"):
    kwargs = dict(mesh=mesh, axis_name=axis_name, use_bias=m.use_bias, dtype=m.dtype,
                  param_dtype=m.param_dtype, precision=m.precision,
                  dot_general=m.dot_general, promote_dtype=m.promote_dtype,
                  preferred_element_type=m.preferred_element_type,
                  kernel_metadata=user_metadata(m.kernel),
                  bias_metadata=user_metadata(m.bias) if m.use_bias else {},
                  rngs=nnx.Rngs(0))
    if entry.style == "column" and entry.segments:
      layout = SegmentedLayout(m.out_features, mesh.shape[axis_name], entry.unit,
                               entry.segments)
      layer = ColumnParallelDense(m.in_features, m.out_features, gather_output=False,
                                  layout=layout, parts_output=entry.parts_form, **kwargs)
    elif entry.style == "column":
      layer = ColumnParallelDense(m.in_features, m.out_features, gather_output=False,
                                  shard_unit=entry.unit, **kwargs)
    else:
      layer = RowParallelDense(m.in_features, m.out_features, shard_unit=entry.unit, **kwargs)
  elif entry.style in ("vocab", "embed_features"):
    cls = VocabParallelEmbedding if entry.style == "vocab" else ParallelEmbedding
    layer = cls(m.num_embeddings, m.features, mesh=mesh, axis_name=axis_name, dtype=m.dtype,
                param_dtype=m.param_dtype, promote_dtype=m.promote_dtype,
                embedding_metadata=user_metadata(m.embedding), rngs=nnx.Rngs(0))
  else:
    return None
  load_unsharded(layer, m)  # the module's values, padded and sharded: no re-initialisation
  return layer


def _set_module(model: nnx.Module, parts: tuple, layer: nnx.Module) -> None:
  """Puts ``layer`` where ``parts`` (attribute names, list indices) lead in ``model``."""
  node: Any = model
  for part in parts[:-1]:
    node = node[part] if isinstance(part, int) else getattr(node, part)
  if isinstance(parts[-1], int):
    node[parts[-1]] = layer
  else:
    setattr(node, parts[-1], layer)


def _entries(model: nnx.Module, plan: dict[str, str] | None,
             inputs: Sequence[Any] | None) -> list[_Entry]:
  """The given plan resolved, or (``plan=None``) one inferred by tracing ``model(*inputs)``."""
  if plan is not None:
    entries = _resolve(model, plan)
    split = [e.path for e in entries if e.style not in ("replicate",)]
    if inputs is None or not split:
      return entries
    # The trace checks that the model uses them only through their calls, and finds what
    # the inference would: heads (kept whole), column outputs split into parts.
    found = plan_inference.trace(model, split, tuple(inputs))
    for e in entries:
      if e.path in found.direct:
        raise ValueError(f"plan pattern {e.pattern!r}: the model reads the params of "
                         f"{e.path!r} outside its call, where a {e.style!r} split would "
                         "hand it the padded, sharded param; plan it 'replicate'")
    return [_with_heads(e, found) for e in entries]
  if inputs is None:
    raise ValueError("plan=None infers the plan by tracing the forward pass: pass "
                     "inputs=(example arguments or jax.ShapeDtypeStructs, as model(*inputs))")
  found_layers = [(parts, m) for parts, m in nnx.iter_modules(model)
                  if type(m) in (nnx.Linear, nnx.Embed)]
  layers = {".".join(str(p) for p in parts): m for parts, m in found_layers}
  parts_of = {".".join(str(p) for p in parts): parts for parts, _ in found_layers}
  if not layers:
    raise ValueError("the model has no nnx.Linear or nnx.Embed to parallelize")
  found = plan_inference.trace(model, list(layers), tuple(inputs))
  inferred = plan_inference.infer(layers, found)
  return [_Entry(path, parts_of[path], layers[path], style, None, unit, reason, segments,
                 plan_inference.unfollowed(found, path) if style == "column" else None,
                 found.parts_form.get(path, "concat") if segments else "concat")
          for path, (style, unit, reason, segments) in inferred.items()]


def _with_heads(entry: _Entry, found: plan_inference.Trace) -> _Entry:
  """A planned column or row layer with the head size and parts the trace saw."""
  if entry.style == "column":
    unit = plan_inference.column_unit(found, entry.path, [entry.path],
                                      entry.module.out_features)
    segments = plan_inference.segments_of(found, entry.path, entry.module.out_features, unit)
    return replace(entry, unit=unit, segments=segments,
                   regrouped=plan_inference.unfollowed(found, entry.path),
                   parts_form=found.parts_form.get(entry.path, "concat") if segments
                   else "concat")
  if entry.style == "row":
    return replace(entry, unit=plan_inference.head_unit(
        found, found.feeds.get(entry.path, ()), entry.module.in_features))
  return entry


def parallelize(model: nnx.Module, mesh: Mesh, plan: dict[str, str] | None = None, *,
                inputs: Sequence[Any] | None = None, axis_name: str = MODEL_AXIS
                ) -> nnx.Module:
  """``model`` with the planned layers tensor-parallel over ``axis_name`` of ``mesh``.

  Swaps the modules ``plan`` names (see the module docstring for the styles) for
  flax_tp layers holding the same values, in place, and replicates every other
  param on the mesh. Returns ``model``, called as before (standalone, under
  ``jax.jit``/``nnx.jit``, with ``nnx.Optimizer``), with equal outputs and
  gradients. A pattern that matches no module, or a style that does not fit the
  module it matches, is a ``ValueError`` naming them.

  ``plan=None``: the plan is inferred by tracing ``model(*inputs)`` abstractly
  (``flax_tp.plan_inference``); ``explain_plan`` shows it with its reasons. A layer
  whose params the model reads outside the layer's call is kept whole. With a given
  plan, ``inputs`` (optional) has the same trace check that no split layer's params
  are read that way (a ``ValueError`` naming it); without them it cannot be seen.
  """
  if not isinstance(mesh, Mesh) or axis_name not in mesh.axis_names:
    raise ValueError(f"mesh must be a jax.sharding.Mesh with a {axis_name!r} axis "
                     f"(see flax_tp.make_mesh), got {mesh!r}")
  for entry in _entries(model, plan, inputs):
    layer = _parallel_layer(entry, mesh, axis_name)
    if layer is not None:
      _set_module(model, entry.parts, layer)
  replicate_on_mesh(model, mesh)
  return model


def _shape(shape: tuple[int, ...], layout: ShardLayout | None, dim: int | None) -> str:
  """``[a, b]``; the split dim as each device stores it, with its most padding."""
  dims = [str(n) for n in shape]
  if layout is not None:
    pad = layout.padded_size - min(layout.sizes)
    dims[dim] = f"{layout.padded_size}" + (f" (up to {pad} padding)" if pad else "")
  return "[" + ", ".join(dims) + "]"


def explain_plan(model: nnx.Module, mesh: Mesh, plan: dict[str, str] | None = None, *,
                 inputs: Sequence[Any] | None = None, axis_name: str = MODEL_AXIS) -> str:
  """A table of what ``parallelize(model, mesh, plan)`` would do, module by module:
  style, split dimension, each device's kernel / table shape (padding shown), the
  collectives of one call, and why (the plan's pattern or the inference's reason).
  Changes nothing."""
  parts = mesh.shape[axis_name]
  rows = [("module", "style", "split", "per device", "collectives per call", "why")]
  for e in _entries(model, plan, inputs):
    m = e.module
    if isinstance(m, nnx.Linear):
      shape, what = (m.in_features, m.out_features), "kernel"
    elif isinstance(m, nnx.Embed):
      shape, what = (m.num_embeddings, m.features), "table"
    else:
      shape, what = None, "module"
    dim = {"column": 1, "row": 0, "vocab": 0, "embed_features": 1}.get(e.style)
    if dim is None or shape is None:
      local = _shape(shape, None, None) if shape else "-"
      split, comm = "-", "none (replicated)"
    else:
      layout = (SegmentedLayout(shape[dim], parts, e.unit, e.segments) if e.segments
                else ShardLayout(shape[dim], parts, e.unit))
      local = _shape(shape, layout, dim)
      split = f"{('in', 'out')[dim] if what == 'kernel' else ('rows', 'features')[dim]}"
      if e.segments:
        split += f" ({len(e.segments)} parts, each split)"
      comm = {"column": "none forward (output stays split); backward: all-reduce of the "
                        "input gradient, one for all columns reading that input"
                        if e.regrouped is None else
                        f"none in the layer, but the model reshapes its output to "
                        f"{e.regrouped} in a way the trace could not follow: its contiguous "
                        "split may be resharded there (all-gathers, all-to-alls)",
              "row": "all-reduce of the output forward",
              "vocab": "all-reduce of the looked-up rows forward",
              "embed_features": "all-gather of the features forward"}[e.style]
    why = e.reason or (f"plan: {e.pattern!r}" if e.pattern else "not in the plan")
    rows.append((e.path, e.style, split, f"{what} {local}", comm, why))
  widths = [max(len(r[i]) for r in rows) for i in range(5)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5]
           for r in rows]
  lines.insert(1, "-" * len(lines[0]))
  lines.append(f"({parts} devices on {axis_name!r}; every other param replicated)")
  return "\n".join(lines)
