"""The ``("data", "model")`` device mesh that every flax_tp layer lives on, and the
thread pool that simulated CPU devices need."""

from __future__ import annotations

import copyreg
import os
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"
_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def split_over(axis_name: str, axis_size: int) -> str | None:
  """The name to split a dimension over on an axis of ``axis_size`` devices: the axis,
  or None on a one-device axis, where a split is the whole tensor. Named replicated
  there, a value stays the same type on every device inside ``shard_map`` and no
  collective over the one-device axis is ever emitted. The one place this rule lives."""
  return axis_name if axis_size > 1 else None


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


_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=([0-9]+)(?![^\s])")


def simulated_device_count(flags: str) -> int | None:
  """The CPU device count an ``XLA_FLAGS`` string asks for (ASCII digits), or None."""
  match = _DEVICE_COUNT_FLAG.search(flags)
  return None if match is None else int(match[1])


def cpu_thread_pool_size(devices: int) -> int:
  """Threads for XLA:CPU's pool when it simulates ``devices`` devices: twice as many.

  XLA runs every simulated device's program on one pool of ``max(cores, devices)``
  threads (``NPROC`` overrides the core count), and a collective holds its thread
  until all devices arrive. Independent collectives of one program can run at once, so
  with as many threads as devices, one device blocked in a second collective can leave
  the others no thread to reach the first: a 1x8 run hung that way (7 of 8 devices in
  an all-reduce for 10 minutes, then XLA aborted), and so did ``generate`` on 8
  devices after 700-1100 tokens. A spare thread per device leaves room; waiting
  threads use no CPU.
  """
  return max(os.cpu_count() or 1, 2 * devices)


def provide_cpu_threads() -> None:
  """Sets ``NPROC`` to ``cpu_thread_pool_size`` of the simulated devices that
  ``XLA_FLAGS`` asks for, when the user has not set it and JAX has not started its
  backends yet (XLA reads it then). Called when flax_tp is imported, so a program that
  imports flax_tp before computing anything gets the spare threads by itself."""
  count = simulated_device_count(os.environ.get("XLA_FLAGS", ""))
  if count is None or count < 2 or "NPROC" in os.environ:
    return
  try:
    from jax._src import xla_bridge  # no public way to ask whether the backends started
    started = xla_bridge.backends_are_initialized()
  except (ImportError, AttributeError):
    started = True
  if not started:
    os.environ["NPROC"] = str(cpu_thread_pool_size(count))


def _check_cpu_threads(devices: Sequence[jax.Device]) -> None:
  """Refuses simulated CPU devices that share XLA's default pool (``NPROC`` unset, fewer
  cores than ``cpu_thread_pool_size``): their collectives can deadlock, and XLA then
  aborts the process minutes later. A user's own ``NPROC`` is respected."""
  local = [d for d in devices if d.process_index == jax.process_index()]
  if len(local) < 2 or local[0].platform != "cpu" or "NPROC" in os.environ:
    return
  wanted = cpu_thread_pool_size(len(local))
  if (os.cpu_count() or 1) < wanted:
    raise ValueError(
        f"{len(local)} simulated CPU devices share XLA's default thread pool of "
        f"{os.cpu_count()} threads: a collective holds its thread while it waits, and "
        f"theirs can deadlock (XLA aborts the process). Set NPROC={wanted} in the "
        "environment before JAX starts, or import flax_tp before running anything with "
        "JAX, which sets it")


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
  _check_cpu_threads(available[:needed])
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
provide_cpu_threads()
