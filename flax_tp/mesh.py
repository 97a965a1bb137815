"""The ``("data", "model")`` device mesh that every flax_tp layer lives on."""

from __future__ import annotations

import copyreg
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"
_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_mesh_spec(spec: str | Sequence[int]) -> tuple[int, int]:
  """``"2x4"`` or ``(2, 4)`` -> ``(data, model)``; ``ValueError`` for anything else."""
  if isinstance(spec, str):
    match = _SPEC.match(spec)
    shape = (int(match[1]), int(match[2])) if match else None
  else:
    try:
      shape = tuple(int(d) for d in spec)
      if len(shape) != 2 or any(int(d) != d for d in spec):
        shape = None
    except (TypeError, ValueError):
      shape = None
  if shape is None or min(shape) < 1:
    raise ValueError(
        f"bad mesh spec {spec!r}: expected 'DxM' (e.g. '2x4') or a pair (D, M) of "
        "positive integers, D data-parallel by M model-parallel devices"
    )
  return shape


def make_mesh(spec: str | Sequence[int], *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``jax.sharding.Mesh`` with axes ``("data", "model")`` of shape ``spec``.

  Uses the first ``D * M`` of ``devices`` (default: ``jax.devices()``), laid out
  so that consecutive devices share the ``"model"`` axis: tensor parallelism
  talks every layer and wants the fastest links, which neighbouring devices (and
  devices of one process) have.
  """
  data, model = parse_mesh_spec(spec)
  available = list(devices) if devices is not None else sorted(
      jax.devices(), key=lambda d: (d.process_index, d.id))
  needed = data * model
  if needed > len(available):
    hint = ""
    if available and available[0].platform == "cpu":
      hint = (f"; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
              "before jax is imported")
    raise ValueError(
        f"mesh {spec!r} needs {needed} devices, found {len(available)} "
        f"({available[0].platform if available else 'none'}){hint}"
    )
  # Auto axes, on purpose: flax_tp places every parameter itself and states each
  # layout in its shard_map specs, so nothing is gained from Explicit mode, while
  # Auto lets a standalone layer take inputs of any sharding (XLA reshards at the
  # shard_map boundary) and keeps GSPMD-style code (nnx.with_partitioning, the
  # benchmark's peer) working on the same mesh. Explicit would make every input
  # whose sharding differs from the specs a type error.
  # Row-major over jax.devices(), which lists each process's devices together, so
  # a "model" row stays inside one process whenever M divides its device count.
  grid = np.array(available[:needed], dtype=object).reshape(data, model)
  return Mesh(grid, (DATA_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def _rebuild_mesh(axis_names: tuple[str, ...], device_ids: list, shape: tuple[int, ...],
                  axis_types: tuple) -> Mesh:
  by_id = {d.id: d for d in jax.devices()}
  missing = [i for i in device_ids if i not in by_id]
  if missing:
    raise ValueError(
        f"cannot unpickle a mesh over devices {missing}: this process has devices "
        f"{sorted(by_id)}. A mesh names devices of one JAX runtime; to move a model "
        "elsewhere, save it with flax_tp.checkpoint.Checkpointer (restores on any mesh)")
  grid = np.array([by_id[i] for i in device_ids], dtype=object).reshape(shape)
  return Mesh(grid, axis_names, axis_types=axis_types)


def _reduce_mesh(mesh: Mesh):
  # JAX devices do not pickle; a mesh does by naming its devices by id, and is
  # rebuilt from the same runtime's devices (e.g. for copy.deepcopy, or a pickle
  # sent between threads/processes of one job).
  return _rebuild_mesh, (tuple(mesh.axis_names), [d.id for d in mesh.devices.flat],
                         mesh.devices.shape, tuple(mesh.axis_types))


copyreg.pickle(Mesh, _reduce_mesh)
