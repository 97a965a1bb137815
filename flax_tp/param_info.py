"""The one reader and writer of a param's flax_tp metadata.

A parallel parameter is an ``nnx.Param`` holding a global ``jax.Array`` in its stored
(padded) form, with metadata (nnx's own keys, then flax_tp's):

- ``out_sharding``: its partition spec as axis names (what ``nnx.get_partition_spec``
  reads), e.g. ``(None, "model")``; ``mesh``: the mesh it lives on;
- ``tp_layout`` / ``tp_dim``: the ``ShardLayout`` of its dimension split over
  ``"model"``, so that its padding can be stripped. Absent on replicated params;
- ``tp_layers`` / ``tp_layer_at``: only on a param holding the same param of several
  layers stacked on a new leading axis (``stack_layers``): how many, and where the
  layer number goes in its per-layer path; ``tp_first_layer`` on a run of a model's
  layers stacked apart from the others (``stack_layer_runs``): its first layer's number;
  ``tp_layer_slots`` on stacked layers split into pipeline stages (``flax_tp.pipeline``):
  which layer each slot of the leading axis holds, in stored order (None: an identity
  layer, all zeros, padding the layers to a multiple of the stages);
- ``fsdp_dim``: the dimension split over ``"data"`` too (FSDP), and ``fsdp_per_block``:
  that a block gathers it (``flax_tp.data_parallel``);
- ``ep_layout`` / ``ep_dim``: on a mixture of experts' expert weights, the
  ``ShardLayout`` of the experts' dimension, split over ``"data"`` (expert
  parallelism, ``flax_tp.moe``): each data shard holds its experts, padded with zero
  experts where the axis does not divide their number. Such a param is never gathered
  over ``"data"`` nor has its gradient summed over it.

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

# flax_tp's own metadata keys, by ParamInfo field; a user's metadata may not set them.
FSDP_DIM, FSDP_PER_BLOCK = "fsdp_dim", "fsdp_per_block"
KEYS = {"layout": "tp_layout", "dim": "tp_dim", "layers": "tp_layers",
        "layer_at": "tp_layer_at", "first_layer": "tp_first_layer",
        "layer_slots": "tp_layer_slots", "fsdp_dim": FSDP_DIM, "fsdp_per_block": FSDP_PER_BLOCK,
        "expert_layout": "ep_layout", "expert_dim": "ep_dim"}
FLAX_TP_KEYS = tuple(KEYS.values())
# nnx's keys that say where a param lives.
NAMES_KEY, MESH_KEY = "out_sharding", "mesh"


@dataclasses.dataclass(frozen=True)
class ParamInfo:
  """What flax_tp knows of one param (all fields None/empty on a plain param)."""

  mesh: Mesh | None = None
  names: tuple | None = None  # out_sharding: an axis name (or names, or None) per dim
  layout: ShardLayout | None = None  # the layout of its dim split over "model"
  dim: int | None = None  # which dim that is
  layers: int | None = None  # stacked: how many layers on the leading axis
  layer_at: int | None = None  # stacked: where the layer goes in its per-layer path
  first_layer: int | None = None  # stacked as one run of a model's layers (stack_layer_runs):
  # the number of its first layer, which replaces the run's index in the per-layer path
  layer_slots: tuple | None = None  # pipelined: the layer each stored slot holds (None:
  # an identity layer); None: slot i holds layer i
  fsdp_dim: int | None = None  # the dim split over "data" too (FSDP)
  fsdp_per_block: bool = False  # FSDP: gathered by its block, not by gather_for_step
  expert_layout: ShardLayout | None = None  # experts split over "data" (expert parallel)
  expert_dim: int | None = None  # which dim that is

  @classmethod
  def of(cls, leaf: Any) -> ParamInfo:
    """The record of ``leaf`` (an ``nnx.Variable``; anything else: the empty record)."""
    if not isinstance(leaf, nnx.Variable):
      return cls()
    meta = leaf.get_metadata()
    names = meta.get(NAMES_KEY)
    return cls(mesh=meta.get(MESH_KEY), names=None if names is None else tuple(names),
               **{field: meta[key] for field, key in KEYS.items() if key in meta})

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
    if self.layout is not None:
      shape[self.dim] = self.layout.size
    if self.expert_layout is not None:
      shape[self.expert_dim] = self.expert_layout.size
    if self.layer_slots is not None:  # pipeline stages' identity layers are not the model's
      shape[0] = self.layers
    return tuple(shape)

  def per_layer(self) -> ParamInfo:
    """A stacked param's record as one layer's slice of it has it: no layer axis, so
    each split dim one lower."""
    shift = lambda d: None if d is None else d - 1
    return dataclasses.replace(self, names=None if self.names is None else self.names[1:],
                               dim=shift(self.dim), expert_dim=shift(self.expert_dim),
                               layers=None, layer_at=None, first_layer=None,
                               layer_slots=None, fsdp_dim=shift(self.fsdp_dim))

  def unpad(self, stored: Any) -> Any:
    """The logical value of the whole stored array ``stored`` (padding stripped from
    each padded dim)."""
    if self.layout is not None:
      stored = self.layout.unpad(stored, self.dim)
    if self.expert_layout is not None:
      stored = self.expert_layout.unpad(stored, self.expert_dim)
    if self.layer_slots is not None:  # the model's layers in order, no identity layers
      stored = stored[np.array([self.slot_of(i) for i in range(self.layers)])]
    return stored

  def pad(self, logical: Any) -> Any:
    """The whole stored form of the logical value ``logical`` (inverse of ``unpad``)."""
    if self.layout is not None:
      logical = self.layout.pad(logical, self.dim)
    if self.expert_layout is not None:
      logical = self.expert_layout.pad(logical, self.expert_dim)
    if self.layer_slots is not None:  # each layer in its slot, identity layers zero
      xp = jnp if isinstance(logical, jax.Array) else np
      zero = xp.zeros((1,) + tuple(logical.shape[1:]), logical.dtype)
      rows = np.array([self.layers if at is None else at for at in self.layer_slots])
      logical = xp.concatenate([logical, zero])[rows]
    return logical


def record(var: nnx.Variable, *, names: tuple | None = None, **fields: Any) -> None:
  """Writes ``fields`` (``ParamInfo`` field names) onto ``var``'s metadata, and
  ``names`` as its ``out_sharding``; a field given as None (or ``fsdp_per_block``
  False) is removed."""
  if names is not None:
    var.set_metadata(**{NAMES_KEY: tuple(names)})
  for field, value in fields.items():
    key = KEYS[field]
    if value is None or value is False:
      if key in var.get_metadata():
        var.del_metadata(key)
    else:
      var.set_metadata(**{key: value})


def keys_of(fields: dict[str, Any]) -> dict[str, Any]:
  """``ParamInfo`` fields -> the metadata entries they are stored as (for building a
  new ``nnx.Param`` with its metadata at once); None values are left out."""
  return {KEYS[f]: v for f, v in fields.items() if v is not None}
