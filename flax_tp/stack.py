"""Layers stacked on a leading axis (scanned models): one param holds the same param of
every layer. ``unshard``, ``load_unsharded`` and checkpoints name and store such a param as
one param per layer, so stacked and unstacked models share names and checkpoints."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from flax_tp.param_info import ParamInfo, record
from flax_tp.params import place


def stacked_layers(var: Any) -> int | None:
  """How many layers a stacked param holds; None for an ordinary param."""
  return ParamInfo.of(var).layers


def layer_path(path: tuple, var: nnx.Variable, layer: int) -> tuple:
  """The per-layer path of layer ``layer`` of the stacked param ``var`` at ``path``.

  ``path`` may carry any prefix (``("params", ...)``, an optimizer state's
  ``(0, "mu", ...)``): the layer number goes before the param's path inside the
  stacked module, which is counted from the end.
  """
  info = ParamInfo.of(var)
  at = len(path) + info.layer_at
  if info.first_layer is not None:  # one run of several: its index in the list of runs
    # (just before the stacked module's own path) becomes the layer's number
    return tuple(path[:at - 1]) + (info.first_layer + layer,) + tuple(path[at:])
  return tuple(path[:at]) + (layer,) + tuple(path[at:])


def per_layer_paths(path: tuple, var: Any) -> list[tuple]:
  """``[path]`` for an ordinary param; each layer's path for a stacked one."""
  layers = stacked_layers(var)
  return [path] if layers is None else [layer_path(path, var, i) for i in range(layers)]


@functools.cache
def _stacker(sharding: NamedSharding) -> Callable[..., jax.Array]:
  return jax.jit(lambda *values: jnp.stack(values), out_shardings=sharding)


def stack_layers(modules: Sequence[nnx.Module], first_layer: int | None = None) -> nnx.Module:
  """One module whose params hold ``modules``' params stacked on a new leading axis.

  ``modules`` have one structure and live on one mesh (every param carries its
  ``mesh`` and ``out_sharding``, as parallel layers' and ``replicate_on_mesh``'s
  do). The first module is reused: each of its params becomes ``[layers, ...]``,
  its spec gains a leading ``None`` and its split dim moves by one. A
  ``jax.lax.scan`` over the stacked state then runs the layers in order, and the
  optimizer sees one array per kind of param, not one per layer.
  ``first_layer``: the modules are layers ``first_layer ..`` of a model whose runs of
  layers are stacked apart (``stack_layer_runs``).
  Returns the first module.
  """
  if not modules:
    raise ValueError("stack_layers needs at least one module")
  flats = [dict(nnx.to_flat_state(nnx.state(m, nnx.Param))) for m in modules]
  for path, var in flats[0].items():
    info = ParamInfo.of(var)
    if info.mesh is None or info.names is None:
      raise ValueError(f"param {path} is not on a mesh (see replicate_on_mesh)")
    if info.is_stacked:
      raise ValueError(f"param {path} is already stacked")
    names = (None,) + info.names
    var.set_value(_stacker(NamedSharding(info.mesh, P(*names)))(
        *[flat[path][...] for flat in flats]))
    record(var, names=names, splits=tuple(s.shifted(1) for s in info.splits),
           layers=len(modules), layer_at=-len(path), first_layer=first_layer)
  return modules[0]


def stack_layer_runs(modules: Sequence[nnx.Module], kinds: Sequence[Any]) -> nnx.Module:
  """``modules`` (a model's layers in order) stacked for scanning, by runs of one kind.

  ``kinds[i]`` says which structure layer ``i`` has (a dense or a mixture-of-experts
  block). Layers of one kind throughout: one ``stack_layers`` module. Else an
  ``nnx.List`` of one stacked module per run of consecutive layers of one kind, each
  scanned in turn (``layer_runs``); per-layer names and checkpoints stay those of the
  unstacked layers.
  """
  if len(kinds) != len(modules):
    raise ValueError(f"{len(kinds)} kinds for {len(modules)} layers")
  starts = [i for i in range(len(modules)) if i == 0 or kinds[i] != kinds[i - 1]]
  if len(starts) == 1:
    return stack_layers(modules)
  ends = starts[1:] + [len(modules)]
  return nnx.List([stack_layers(modules[a:b], first_layer=a)
                   for a, b in zip(starts, ends, strict=True)])


def layer_runs(stacked: nnx.Module) -> list[tuple[nnx.Module, int, int]]:
  """``(module, first layer, layers)`` of each run of ``stack_layer_runs``'s result."""
  runs = list(stacked) if isinstance(stacked, nnx.List) else [stacked]
  out = []
  for run in runs:
    info = ParamInfo.of(next(v for _, v in nnx.to_flat_state(nnx.state(run, nnx.Param))))
    out.append((run, info.first_layer or 0, info.layers))
  return out


@functools.partial(jax.jit, donate_argnums=0)
def _update_layer(stacked: jax.Array, value: jax.Array, layer: jax.Array) -> jax.Array:
  return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), layer, 0)


def set_layer(var: nnx.Variable, layer: int, logical: Any, name: Any = "") -> None:
  """Sets layer ``layer`` of the stacked param ``var`` to ``logical`` (its whole,
  unpadded per-layer value), in place; the host holds one layer's value.

  ``ValueError`` naming ``name`` on a shape that does not fit.
  """
  info = ParamInfo.of(var)
  one = info.per_layer()
  stacked = var[...]
  expected = list(one.logical_shape(stacked.shape[1:]))
  value = np.asarray(logical).astype(stacked.dtype)
  if list(value.shape) != expected:
    raise ValueError(
        f"param {name}: got shape {tuple(value.shape)}, expected {tuple(expected)}")
  value = one.pad(value)
  sharding = NamedSharding(info.mesh, P(*one.names))
  var.set_value(_update_layer(stacked, place(value, sharding), jnp.int32(info.slot_of(layer))))
