"""The device mesh every flax_tp layer lives on, the one record of its axes' roles
(``MeshAxes``), and the thread pool that simulated CPU devices need.

A mesh always has ``"data"`` (data parallelism, FSDP, the experts) and ``"model"``
(tensor and sequence parallelism); ``"context"`` (the sequence split for long contexts)
joins them, between the two, when it has more than one device, and ``"stage"``
(pipeline stages, ``flax_tp.pipeline``) before them all. A role without an axis
has size 1: ``MeshAxes.of(mesh)`` reads every role's size from any mesh. Which axes a
mixture of experts' experts split over is the record's too (``MeshAxes.expert_axes``):
``"data"`` by default, with ``"context"`` and/or ``"model"`` if asked.
"""

from __future__ import annotations

import copyreg
import dataclasses
import os
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

STAGE_AXIS = "stage"
DATA_AXIS = "data"
CONTEXT_AXIS = "context"
MODEL_AXIS = "model"
_SIZES = re.compile(r"^\s*-?\d+\s*([xX]\s*-?\d+\s*){1,2}$")
_NAMED = re.compile(r"^\s*([A-Za-z_]+)\s*=\s*(-?\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """How many devices each role of the mesh has: the one record every layer, the step,
  FSDP, the experts, the cache and the CLI read the mesh's roles from.

  ``ROLES`` lists the roles in device order (the last varies fastest: consecutive
  devices share ``"model"``, which talks every layer, then ``"context"``, which talks
  every attention). ``"data"`` and ``"model"`` are always axes of the mesh (specs name
  them); an optional role (``OPTIONAL``: ``"stage"``, ``"context"``) is an axis only
  when it has more than one device, so ``"2x1x4"`` builds the very mesh ``"2x4"`` does.
  ``"stage"`` (pipeline stages) comes first, varying slowest: it talks least (one
  activation per microbatch per stage boundary), so it may span nodes.
  """

  data: int = 1
  context: int = 1
  model: int = 1
  stage: int = 1

  ROLES = (STAGE_AXIS, DATA_AXIS, CONTEXT_AXIS, MODEL_AXIS)
  OPTIONAL = (STAGE_AXIS, CONTEXT_AXIS)
  # The roles whose devices hold different tokens of one step (gradients are summed
  # over them), and those a mixture of experts' experts may split over: always "data",
  # then "context" (each context shard's tokens go to the experts on the others) and
  # "model" (each expert whole on one device, its FFN not split: Megatron's
  # expert-tensor-parallel size 1).
  BATCH_ROLES = (DATA_AXIS, CONTEXT_AXIS)
  EXPERT_ROLES = (DATA_AXIS, CONTEXT_AXIS, MODEL_AXIS)
  DEFAULT_EXPERT_ROLES = (DATA_AXIS,)

  @classmethod
  def parse(cls, spec: str | Sequence[int] | MeshAxes) -> MeshAxes:
    """``"DxM"``, ``"DxCxM"``, the named form ``"data=2,context=2,model=2"`` or
    ``"stage=2,data=2,model=2"`` (any order, a missing role is 1), a tuple ``(D, M)`` / ``(D, C, M)``, or a ``MeshAxes``.
    ``ValueError`` naming the spec for anything else: an unknown or repeated role, a
    size that is not a positive integer, a wrong number of sizes."""
    if isinstance(spec, MeshAxes):
      return spec
    if isinstance(spec, str) and "=" in spec:
      return cls._parse_named(spec)
    if isinstance(spec, str):
      sizes = ([int(p) for p in re.split(r"[xX]", spec.strip())]
               if _SIZES.match(spec) else None)
    else:
      try:
        sizes = [int(d) for d in spec]
        if any(isinstance(d, bool) or int(d) != d for d in spec):
          sizes = None
      except (TypeError, ValueError):
        sizes = None
    if sizes is None or len(sizes) not in (2, 3) or min(sizes) < 1:
      raise ValueError(
          f"bad mesh spec {spec!r}: expected 'DxM' (e.g. '2x4'), 'DxCxM' (data x "
          "context x model, e.g. '2x2x2') or named sizes ('data=2,context=2,model=2'), "
          "each a positive integer")
    if len(sizes) == 2:
      return cls(data=sizes[0], model=sizes[1])
    return cls(data=sizes[0], context=sizes[1], model=sizes[2])

  @classmethod
  def _parse_named(cls, spec: str) -> MeshAxes:
    sizes: dict[str, int] = {}
    for part in spec.split(","):
      match = _NAMED.match(part)
      if match is None:
        raise ValueError(f"bad mesh spec {spec!r}: {part.strip()!r} is not role=size "
                         f"(roles {', '.join(cls.ROLES)})")
      role, size = match[1], int(match[2])
      if role not in cls.ROLES:
        raise ValueError(f"bad mesh spec {spec!r}: unknown axis {role!r}; expected "
                         f"{', '.join(cls.ROLES)}")
      if role in sizes:
        raise ValueError(f"bad mesh spec {spec!r}: axis {role!r} is given twice")
      if size < 1:
        raise ValueError(f"bad mesh spec {spec!r}: axis {role!r} has {size} devices; "
                         "each axis needs a positive number")
      sizes[role] = size
    return cls(**sizes)

  @classmethod
  def of(cls, mesh: Mesh) -> MeshAxes:
    """The roles' sizes of ``mesh`` (a role it has no axis for: 1)."""
    return cls(**{role: int(mesh.shape.get(role, 1)) for role in cls.ROLES})

  @property
  def devices(self) -> int:
    return self.stage * self.data * self.context * self.model

  def size(self, role: str) -> int:
    return getattr(self, role)

  @property
  def axis_names(self) -> tuple[str, ...]:
    """The mesh's axes, in device order: every role but an optional one of size 1."""
    return tuple(r for r in self.ROLES if r not in self.OPTIONAL or self.size(r) > 1)

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes whose devices hold different tokens of one step, over which a param's
    gradient is summed: ``"data"``, and ``"context"`` when it has an axis."""
    return tuple(r for r in self.BATCH_ROLES if r in self.axis_names)

  @classmethod
  def expert_roles(cls, roles: str | Sequence[str] = DEFAULT_EXPERT_ROLES
                   ) -> tuple[str, ...]:
    """The roles a mixture of experts' experts split over, checked and in device order:
    ``"data"`` and any of ``"context"``, ``"model"`` (a tuple, or a string
    ``"data,context"``). ``ValueError`` naming the value for an unknown or repeated
    role, or one without ``"data"``."""
    given = tuple(r.strip() for r in roles.split(",")) if isinstance(roles, str) else (
        tuple(roles) if isinstance(roles, (tuple, list)) else None)
    expected = (f"expected roles among {', '.join(cls.EXPERT_ROLES)}, {DATA_AXIS!r} "
                "among them (e.g. 'data' or 'data,context')")
    if given is None or not all(isinstance(r, str) for r in given):
      raise ValueError(f"bad expert axes {roles!r}: {expected}")
    unknown = [r for r in given if r not in cls.EXPERT_ROLES]
    if unknown or len(set(given)) != len(given) or DATA_AXIS not in given:
      why = (f"unknown role {unknown[0]!r}" if unknown else "a role given twice"
             if len(set(given)) != len(given) else f"no {DATA_AXIS!r}")
      raise ValueError(f"bad expert axes {roles!r}: {why}; {expected}")
    return tuple(r for r in cls.EXPERT_ROLES if r in given)

  def expert_axes(self, roles: str | Sequence[str] = DEFAULT_EXPERT_ROLES
                  ) -> tuple[str, ...]:
    """The mesh axes the experts split over: those of ``roles`` (``expert_roles``) with
    more than one device here, in device order (a split over them is row-major in this
    order). ``()``: every expert on every device."""
    return tuple(r for r in self.expert_roles(roles) if self.size(r) > 1)

  def __str__(self) -> str:
    """``"DxM"`` without a context axis, else ``"DxCxM"``; with pipeline stages the
    named form (``"stage=2,data=2,model=2"``)."""
    if self.stage > 1:
      return ",".join(f"{r}={self.size(r)}" for r in self.axis_names)
    sizes = (self.data, self.context, self.model) if self.context > 1 else (
        self.data, self.model)
    return "x".join(map(str, sizes))


def split_over(axis_name: str, axis_size: int) -> str | None:
  """The name to split a dimension over on an axis of ``axis_size`` devices: the axis,
  or None on a one-device axis, where a split is the whole tensor. Named replicated
  there, a value stays the same type on every device inside ``shard_map`` and no
  collective over the one-device axis is ever emitted. The one place this rule lives."""
  return axis_name if axis_size > 1 else None


def parse_mesh_spec(spec: str | Sequence[int]) -> tuple[int, int]:
  """``(data, model)`` of a mesh spec without a context axis (any form ``MeshAxes.parse``
  takes); ``ValueError`` for a bad spec or one with a context axis (read those with
  ``MeshAxes.parse``)."""
  axes = MeshAxes.parse(spec)
  if axes.context > 1:
    raise ValueError(f"mesh spec {spec!r} has a context axis of {axes.context}: read it "
                     "with flax_tp.MeshAxes.parse")
  return axes.data, axes.model


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


def make_mesh(spec: str | Sequence[int] | MeshAxes, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``jax.sharding.Mesh`` of the roles ``spec`` gives (``MeshAxes.parse``: ``"2x4"``,
  ``"2x2x2"``, ``"data=2,context=2,model=2"``, ``"stage=2,data=2,model=2"``): axes
  ``("data", "model")``, with ``"context"`` between them when it has more than one
  device and ``"stage"`` before them when it has more than one.

  Uses the first ``S * D * C * M`` of ``devices`` (default: ``jax.devices()``), laid out
  so that consecutive devices share the ``"model"`` axis: tensor parallelism
  talks every layer and wants the fastest links, which neighbouring devices (and
  devices of one process) have; context parallelism, which talks every attention,
  comes next; pipeline stages, which talk least, are furthest apart.
  """
  axes = MeshAxes.parse(spec)
  available = list(devices) if devices is not None else sorted(
      jax.devices(), key=lambda d: (d.process_index, d.id))
  needed = axes.devices
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
  names = axes.axis_names
  grid = np.array(available[:needed], dtype=object).reshape([axes.size(n) for n in names])
  return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


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
