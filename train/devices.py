"""The devices a CLI run needs, asked of XLA before JAX starts: simulated CPU devices,
their thread pool and collective timeout."""

from __future__ import annotations

import os

from train.errors import MAX_SIMULATED_DEVICES, UsageError, xla_device_count_problem

CPU_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def provide_cpu_devices(count: int) -> None:
  """Asks XLA's CPU platform for ``count`` devices unless the user chose a number, lets
  their collectives wait out a busy host (``CPU_COLLECTIVE_TIMEOUT_FLAG``), and gives
  them a thread pool with a spare thread per device (``flax_tp.mesh.cpu_thread_pool_size``,
  unless ``NPROC`` is set)."""
  from flax_tp.host_memory import setting_problem
  from flax_tp.mesh import cpu_thread_pool_size, simulated_device_count
  flags = os.environ.get("XLA_FLAGS", "")
  problem = xla_device_count_problem(flags) or setting_problem()
  if problem:
    raise UsageError(problem)
  if "xla_force_host_platform_device_count" not in flags:
    flags = f"{flags} --xla_force_host_platform_device_count={count}"
  if "xla_cpu_collective_call_terminate_timeout_seconds" not in flags:
    flags = f"{flags} {CPU_COLLECTIVE_TIMEOUT_FLAG}"
  os.environ["XLA_FLAGS"] = flags.strip()
  # JAX has not started here (this runs before it is imported), so NPROC still counts.
  os.environ.setdefault("NPROC", str(cpu_thread_pool_size(simulated_device_count(flags))))


def provide_mesh_devices(mesh: str, processes: int = 1) -> None:
  """Checks ``--mesh`` (UsageError) and provides this process's share of its CPU devices."""
  from flax_tp.mesh import MeshAxes, simulated_device_count
  try:
    devices = MeshAxes.parse(mesh).devices
  except ValueError as err:
    raise UsageError(str(err)) from None
  if devices % processes:
    raise UsageError(f"--mesh {mesh} has {devices} devices, which "
                     f"{processes} processes cannot share evenly")
  chosen = simulated_device_count(os.environ.get("XLA_FLAGS", ""))
  if devices // processes > MAX_SIMULATED_DEVICES and chosen is None:
    raise UsageError(f"--mesh {mesh} needs {devices:,} devices; at most "
                     f"{MAX_SIMULATED_DEVICES} per process can be simulated on a CPU")
  provide_cpu_devices(devices // processes)
