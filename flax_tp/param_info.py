"""The one reader and writer of a param's flax_tp metadata.

A parallel parameter is an ``nnx.Param`` holding a global ``jax.Array`` in its stored
(padded) form, with metadata (nnx's own keys, then flax_tp's):

- ``out_sharding``: its partition spec as axis names (what ``nnx.get_partition_spec``
  reads), e.g. ``(None, "model")``; ``mesh``: the mesh it lives on;
- its **splits**: each dimension split over mesh axes by one kind of parallelism, as a
  ``Split(kind, dim, layout)``; ``ParamInfo.splits`` holds them as one tuple, whatever
  their kind, so padding, shapes and checkpoints treat every kind alike. Each kind is
  stored under its own keys (``SPLIT_KEYS``), which other code and users read:

  - ``"model"`` (``tp_layout`` / ``tp_dim``): tensor parallelism, the ``ShardLayout``
    of the dimension split over ``"model"``, so that its padding can be stripped;
  - ``"experts"`` (``ep_layout`` / ``ep_dim``): a mixture of experts' expert weights,
    the ``ShardLayout`` of the experts' dimension split over ``"data"`` (expert
    parallelism, ``flax_tp.moe``): each data shard holds its experts, padded with zero
    experts where the axis does not divide their number. Such a param is never gathered
    over ``"data"`` nor has its gradient summed over it;
  - ``"fsdp"`` (``fsdp_dim``): the dimension split over ``"data"`` too (FSDP), evenly
    (no layout); ``fsdp_per_block``: that a block gathers it (``flax_tp.data_parallel``);
- ``tp_layers`` / ``tp_layer_at``: only on a param holding the same param of several
  layers stacked on a new leading axis (``stack_layers``): how many, and where the
  layer number goes in its per-layer path; ``tp_first_layer`` on a run of a model's
  layers stacked apart from the others (``stack_layer_runs``): its first layer's number;
  ``tp_layer_slots`` on stacked layers split into pipeline stages (``flax_tp.pipeline``):
  which layer each slot of the leading axis holds, in stored order (None: an identity
  layer, all zeros, padding the layers to a multiple of the stages).

Nothing of this is written to a checkpoint (which holds logical values), so the keys
are only ever read and written here: ``ParamInfo.of(var)`` reads them all, ``record``
writes some (``None`` removes one). Everywhere else asks ``ParamInfo``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flax_tp.partition import ShardLayout

# The kinds of split (a param has at most one of each), and the metadata keys each is
# stored under: (its layout's key or None: an even split with no padding, its dim's key).
MODEL_SPLIT, EXPERT_SPLIT, FSDP_SPLIT = "model", "experts", "fsdp"
FSDP_DIM, FSDP_PER_BLOCK = "fsdp_dim", "fsdp_per_block"
SPLIT_KEYS = {MODEL_SPLIT: ("tp_layout", "tp_dim"), EXPERT_SPLIT: ("ep_layout", "ep_dim"),
              FSDP_SPLIT: (None, FSDP_DIM)}
# flax_tp's other metadata keys, by ParamInfo field.
KEYS = {"layers": "tp_layers", "layer_at": "tp_layer_at", "first_layer": "tp_first_layer",
        "layer_slots": "tp_layer_slots", "fsdp_per_block": FSDP_PER_BLOCK}
# Every key flax_tp writes on its params; a user's metadata may not set them.
FLAX_TP_KEYS = tuple(k for keys in SPLIT_KEYS.values() for k in keys if k) + tuple(KEYS.values())
# nnx's keys that say where a param lives.
NAMES_KEY, MESH_KEY = "out_sharding", "mesh"


@dataclasses.dataclass(frozen=True)
class Split:
  """One dimension of a stored param split over mesh axes by one kind of parallelism.

  ``kind``: ``"model"`` (tensor parallelism), ``"experts"`` (expert parallelism) or
  ``"fsdp"``; ``dim``: which dimension of the stored array; ``layout``: the
  ``ShardLayout`` that pads it to the axes' shards (None for FSDP's even split). The
  axes themselves are the param's ``names[dim]``.
  """

  kind: str
  dim: int
  layout: ShardLayout | None = None

  def __post_init__(self):
    if self.kind not in SPLIT_KEYS:
      raise ValueError(f"split kind must be one of {tuple(SPLIT_KEYS)}, got {self.kind!r}")
    if (self.layout is None) != (SPLIT_KEYS[self.kind][0] is None):
      raise ValueError(f"a {self.kind!r} split {'needs' if self.layout is None else 'has no'} "
                       f"layout, got {self.layout!r}")

  def shifted(self, by: int) -> Split:
    """The split of the same dimension after ``by`` leading axes are added (stacked
    layers: 1) or removed (one layer's slice: -1)."""
    return dataclasses.replace(self, dim=self.dim + by)


def _one_kind(kind: str, field: str, doc: str) -> property:
  """A ``ParamInfo`` property: ``field`` of its split of ``kind``, None without one."""
  return property(lambda info: getattr(info.split(kind), field, None), doc=doc)


@dataclasses.dataclass(frozen=True)
class ParamInfo:
  """What flax_tp knows of one param (all fields None/empty on a plain param)."""

  mesh: Mesh | None = None
  names: tuple | None = None  # out_sharding: an axis name (or names, or None) per dim
  splits: tuple[Split, ...] = ()  # each dim split over mesh axes, one per kind
  layers: int | None = None  # stacked: how many layers on the leading axis
  layer_at: int | None = None  # stacked: where the layer goes in its per-layer path
  first_layer: int | None = None  # stacked as one run of a model's layers (stack_layer_runs):
  # the number of its first layer, which replaces the run's index in the per-layer path
  layer_slots: tuple | None = None  # pipelined: the layer each stored slot holds (None:
  # an identity layer); None: slot i holds layer i
  fsdp_per_block: bool = False  # FSDP: gathered by its block, not by gather_for_step

  @classmethod
  def of(cls, leaf: Any) -> ParamInfo:
    """The record of ``leaf`` (an ``nnx.Variable``; anything else: the empty record)."""
    if not isinstance(leaf, nnx.Variable):
      return cls()
    meta = leaf.get_metadata()
    names = meta.get(NAMES_KEY)
    splits = tuple(Split(kind, meta[dim_key], meta[layout_key] if layout_key else None)
                   for kind, (layout_key, dim_key) in SPLIT_KEYS.items() if dim_key in meta)
    return cls(mesh=meta.get(MESH_KEY), names=None if names is None else tuple(names),
               splits=splits,
               **{field: meta[key] for field, key in KEYS.items() if key in meta})

  def split(self, kind: str) -> Split | None:
    """The param's split of ``kind`` (``SPLIT_KEYS``), None if it has none."""
    return next((s for s in self.splits if s.kind == kind), None)

  def with_split(self, split: Split) -> tuple[Split, ...]:
    """``splits`` with ``split`` added (replacing one of its kind)."""
    return self.without_split(split.kind) + (split,)

  def without_split(self, kind: str) -> tuple[Split, ...]:
    return tuple(s for s in self.splits if s.kind != kind)

  # One kind's dim and layout (None without that split), for code about that kind alone.
  layout = _one_kind(MODEL_SPLIT, "layout", "The layout of the dim split over \"model\".")
  dim = _one_kind(MODEL_SPLIT, "dim", "The dim split over \"model\" (tensor parallelism).")
  expert_layout = _one_kind(EXPERT_SPLIT, "layout", "The layout of the experts' dim.")
  expert_dim = _one_kind(EXPERT_SPLIT, "dim", "The experts' dim (expert parallelism).")
  fsdp_dim = _one_kind(FSDP_SPLIT, "dim", "The dim FSDP splits over \"data\" too.")

  @property
  def padded(self) -> tuple[Split, ...]:
    """The splits with a layout: the dims whose stored size holds padding."""
    return tuple(s for s in self.splits if s.layout is not None)

  @property
  def is_split(self) -> bool:
    """Whether the param is split over any axis ("model" and/or "data")."""
    return any(self.names or ())

  @property
  def is_stacked(self) -> bool:
    return self.layers is not None

  def slot_of(self, layer: int) -> int:
    """Where layer ``layer`` of a stacked param sits on its leading axis."""
    return layer if self.layer_slots is None else self.layer_slots.index(layer)

  @property
  def over_data(self) -> bool:
    """Whether FSDP splits the param over "data"."""
    return self.fsdp_dim is not None

  @property
  def over_experts(self) -> bool:
    """Whether expert parallelism splits the param's experts over "data"."""
    return self.expert_layout is not None

  @property
  def sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(*self.names))

  def logical_shape(self, stored_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape without padding of a param stored as ``stored_shape``."""
    shape = list(stored_shape)
    for split in self.padded:
      shape[split.dim] = split.layout.size
    if self.layer_slots is not None:  # pipeline stages' identity layers are not the model's
      shape[0] = self.layers
    return tuple(shape)

  def per_layer(self) -> ParamInfo:
    """A stacked param's record as one layer's slice of it has it: no layer axis, so
    each split dim one lower."""
    return dataclasses.replace(self, names=None if self.names is None else self.names[1:],
                               splits=tuple(s.shifted(-1) for s in self.splits),
                               layers=None, layer_at=None, first_layer=None,
                               layer_slots=None)

  def unpad(self, stored: Any) -> Any:
    """The logical value of the whole stored array ``stored`` (padding stripped from
    each padded dim)."""
    for split in self.padded:
      stored = split.layout.unpad(stored, split.dim)
    if self.layer_slots is not None:  # the model's layers in order, no identity layers
      stored = stored[np.array([self.slot_of(i) for i in range(self.layers)])]
    return stored

  def pad(self, logical: Any) -> Any:
    """The whole stored form of the logical value ``logical`` (inverse of ``unpad``)."""
    for split in self.padded:
      logical = split.layout.pad(logical, split.dim)
    if self.layer_slots is not None:  # each layer in its slot, identity layers zero
      xp = jnp if isinstance(logical, jax.Array) else np
      zero = xp.zeros((1,) + tuple(logical.shape[1:]), logical.dtype)
      rows = np.array([self.layers if at is None else at for at in self.layer_slots])
      logical = xp.concatenate([logical, zero])[rows]
    return logical


def record(var: nnx.Variable, *, names: tuple | None = None,
           splits: tuple[Split, ...] | None = None, **fields: Any) -> None:
  """Writes ``fields`` (``ParamInfo`` field names) onto ``var``'s metadata, ``names``
  as its ``out_sharding`` and ``splits`` as all of its splits (the kinds left out are
  removed); a field given as None (or ``fsdp_per_block`` False) is removed."""
  if names is not None:
    var.set_metadata(**{NAMES_KEY: tuple(names)})
  if splits is not None:
    for key, value in _split_entries(splits).items():
      _set(var, key, value)
  for field, value in fields.items():
    _set(var, KEYS[field], value)


def _set(var: nnx.Variable, key: str, value: Any) -> None:
  if value is None or value is False:
    if key in var.get_metadata():
      var.del_metadata(key)
  else:
    var.set_metadata(**{key: value})


def _split_entries(splits: tuple[Split, ...]) -> dict[str, Any]:
  """The metadata entries of ``splits``: each kind's keys, None for a kind absent."""
  kinds = [s.kind for s in splits]
  if len(set(kinds)) != len(kinds):
    raise ValueError(f"a param has at most one split of each kind, got {kinds}")
  entries = {key: None for keys in SPLIT_KEYS.values() for key in keys if key}
  for split in splits:
    layout_key, dim_key = SPLIT_KEYS[split.kind]
    entries[dim_key] = split.dim
    if layout_key:
      entries[layout_key] = split.layout
  return entries


def keys_of(fields: dict[str, Any]) -> dict[str, Any]:
  """``ParamInfo`` fields (``splits`` among them) -> the metadata entries they are stored
  as (for building a new ``nnx.Param`` with its metadata at once); None values are left
  out."""
  out = {}
  for field, value in fields.items():
    out.update(_split_entries(value) if field == "splits" else {KEYS[field]: value})
  return {k: v for k, v in out.items() if v is not None}
