"""LoRA adapters on the parallel dense layers, sharded as their base (PEFT's ``tp_layer``).

``add_lora(layer, rank, alpha)`` gives a ``ColumnParallelDense`` or ``RowParallelDense``
a low-rank update: ``y = base(x) + scaling * (x @ lora_a) @ lora_b``, ``scaling = alpha /
rank`` (rsLoRA: ``alpha / sqrt(rank)``). ``lora_a [in, r]`` and ``lora_b [r, out]`` are
``nnx.LoRAParam``s (a kind of ``nnx.Param``), so ``nnx.Optimizer(..., wrt=nnx.LoRAParam)``
or a filter trains them alone. They are drawn as PEFT draws them by default: ``lora_a``
uniform in ``+-1/sqrt(in)`` (torch's ``kaiming_uniform_(a=sqrt(5))`` of a ``[r, in]``
weight) and ``lora_b`` zero, so a fresh adapter changes nothing.

Where they live (torchtitan's, PEFT's and MaxText's rule):
- column-parallel base (outputs split over ``"model"``): ``lora_a`` replicated, ``lora_b``
  split on its outputs exactly as the kernel is (same layout and padding, kv heads
  replicated where the kernel replicates them);
- row-parallel base (inputs split): ``lora_a`` split on its inputs as the kernel is,
  ``lora_b`` replicated.

And what they send: nothing of their own. In a column layer ``h = x @ lora_a`` is computed
on the replicated input and travels with it through the layer's ``copy_to_parallel``, so
backward sums ``h``'s cotangent in the same all-reduce as the input's (one all-reduce,
``r`` more columns). In a row layer the partial ``h = x_local @ lora_a_local`` is reduced
in the same all-reduce (or, with sequence parallelism, reduce-scatter) as the base's
partial output, and ``lora_b`` is applied after it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_tp.linear import ColumnParallelDense, RowParallelDense, has_lora
from flax_tp.params import sharded_param

Array = jax.Array


def peft_a_init(key: Array, shape: tuple[int, int], dtype: Any = jnp.float32) -> Array:
  """PEFT's default ``lora_A`` draw for a ``[in, r]`` store: uniform in ``+-1/sqrt(in)``
  (torch ``nn.Linear``'s default for a ``[r, in]`` weight)."""
  bound = 1.0 / math.sqrt(shape[0])
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def lora_scaling(rank: int, alpha: float, rslora: bool = False) -> float:
  """PEFT's ``scaling``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""
  return alpha / (math.sqrt(rank) if rslora else rank)


def checked_rank_and_alpha(rank: Any, alpha: Any) -> tuple[int, float | int]:
  """``(rank, alpha)`` as Python numbers; ``ValueError`` naming a rank that is not a
  positive integer or an alpha that is not a positive finite number. A bool is an int to
  Python, but True is no rank: refused, where numpy's numbers are taken."""
  if (not isinstance(rank, (int, np.integer)) or isinstance(rank, (bool, np.bool_))
      or rank < 1):
    raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
  if not (isinstance(alpha, (int, float, np.integer, np.floating))
          and not isinstance(alpha, (bool, np.bool_)) and math.isfinite(alpha) and alpha > 0):
    raise ValueError(f"LoRA alpha must be a positive number, got {alpha!r}")
  return int(rank), (alpha.item() if isinstance(alpha, np.generic) else alpha)


def add_lora(layer: Any, rank: int, alpha: float | None = None, *, rngs: nnx.Rngs,
             rslora: bool = False, a_init: Any = peft_a_init,
             b_init: Any = nnx.initializers.zeros_init(), param_dtype: Any = None) -> Any:
  """Gives ``layer`` (a ``ColumnParallelDense`` or ``RowParallelDense``) a rank-``rank``
  adapter, in place, and returns it. ``alpha`` defaults to ``rank`` (scaling 1).

  ``lora_a [in, r]`` and ``lora_b [r, out]`` are stored padded and split as the module
  docstring says; their padding is zero and stays zero (the layer masks it).
  """
  if not isinstance(layer, (ColumnParallelDense, RowParallelDense)):
    raise TypeError(f"add_lora takes a ColumnParallelDense or RowParallelDense, got "
                    f"{type(layer).__name__}")
  rank, alpha = checked_rank_and_alpha(rank, rank if alpha is None else alpha)
  if has_lora(layer):
    raise ValueError("this layer already has a LoRA adapter")
  column = isinstance(layer, ColumnParallelDense)
  dtype = param_dtype or layer.param_dtype
  common = dict(mesh=layer.mesh, axis_name=layer.axis_name, variable_type=nnx.LoRAParam)
  # Split as the base: a column layer's outputs (lora_b's dim 1), a row layer's inputs
  # (lora_a's dim 0), with the kernel's own layout.
  layer.lora_a = sharded_param(a_init, rngs.params(), (layer.in_features, rank), dtype,
                               dim=None if column else 0,
                               layout=None if column else layer.layout, name="lora_a",
                               **common)
  layer.lora_b = sharded_param(b_init, rngs.params(), (rank, layer.out_features), dtype,
                               dim=1 if column else None,
                               layout=layer.layout if column else None, name="lora_b",
                               **common)
  layer.lora_scaling = lora_scaling(rank, alpha, rslora)
  return layer


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Adapters for a model: rank, alpha, which layers (globs over their dotted module
  paths, e.g. ``blocks.*.attn.[qv]``: every matching column- or row-parallel layer) and
  the scaling (``alpha / rank``, or rsLoRA's ``alpha / sqrt(rank)``)."""

  rank: int = 8
  alpha: float = 8.0
  targets: tuple[str, ...] = ("blocks.*.attn.[qv]",)
  rslora: bool = False
  seed: int = 0  # the adapters' draws (apart from the base's)
  init_weights: bool = True  # PEFT's init_lora_weights: B zero (the adapter starts as a
  # no-op); False: B drawn as A is (torch Linear's default), so it changes the output

  def __post_init__(self):
    rank, alpha = checked_rank_and_alpha(self.rank, self.alpha)
    object.__setattr__(self, "rank", rank)  # JSON and shapes take Python's numbers
    object.__setattr__(self, "alpha", alpha)
    if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
      raise ValueError(f"LoRA targets must be non-empty globs, got {self.targets!r}")

  @property
  def scaling(self) -> float:
    return lora_scaling(self.rank, self.alpha, self.rslora)


def dense_layers(model: nnx.Module) -> list[tuple[str, Any]]:
  """``(dotted path, layer)`` of every column- and row-parallel layer in ``model``."""
  return [(".".join(map(str, path)), module) for path, module in nnx.iter_modules(model)
          if isinstance(module, (ColumnParallelDense, RowParallelDense))]


def add_adapters(model: nnx.Module, config: LoRAConfig) -> list[str]:
  """Adds ``config``'s adapter to each layer of ``model`` its targets match, in place,
  in path order (so the draws do not depend on the mesh). Returns their paths.
  ``ValueError`` naming a target that matches no layer."""
  chosen = _matching(dense_layers(model), config.targets)
  rngs = nnx.Rngs(config.seed)
  b_init = nnx.initializers.zeros_init() if config.init_weights else peft_a_init
  for _, layer in sorted(chosen.items(), key=lambda kv: _path_key(kv[0])):
    add_lora(layer, config.rank, config.alpha, rslora=config.rslora, rngs=rngs,
             b_init=b_init)
  return sorted(chosen, key=_path_key)


def matching_layers(paths: list[str], targets: tuple[str, ...]) -> list[str]:
  """Of the layer ``paths`` (dotted, as ``dense_layers`` gives them), those the globs
  ``targets`` match, in path order: the layers ``add_adapters`` would adapt.
  ``ValueError`` naming a glob that matches none."""
  return sorted(_matching([(p, None) for p in paths], targets), key=_path_key)


def _matching(layers: list[tuple[str, Any]], targets: tuple[str, ...]) -> dict[str, Any]:
  chosen = {}
  for target in targets:
    hits = [(path, layer) for path, layer in layers if fnmatch.fnmatchcase(path, target)]
    if not hits:
      raise ValueError(f"LoRA target {target!r} matches no column- or row-parallel layer; "
                       f"the layers are {', '.join(p for p, _ in layers[:8])}"
                       f"{', ...' if len(layers) > 8 else ''}")
    chosen.update(hits)
  return chosen


def _path_key(path: str) -> tuple:
  """Numeric parts as numbers: ``blocks.10`` after ``blocks.9``."""
  return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))
