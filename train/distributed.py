"""Joining a multi-process run through JAX's own distributed runtime.

Three ways to say how, in this order:
1. flags ``--coordinator HOST:PORT --num-processes N --process-id I``;
2. environment variables ``FLAX_TP_COORDINATOR``, ``FLAX_TP_NUM_PROCESSES``,
   ``FLAX_TP_PROCESS_ID`` (what ``train/launch.py`` sets);
3. nothing, on a cluster launcher JAX detects by itself (Slurm, Open MPI, TPU
   pods, Kubernetes): ``jax.distributed.initialize()`` reads it all from there.
With none of these the run is a single process. Collectives between processes
are gloo's on CPU and NCCL's on GPU, chosen by JAX.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading

from train.errors import UsageError, say

ENV = {"coordinator": "FLAX_TP_COORDINATOR", "num_processes": "FLAX_TP_NUM_PROCESSES",
       "process_id": "FLAX_TP_PROCESS_ID"}


class DistributedError(Exception):
  """The distributed runtime could not start: one line on stderr, exit status 1."""


@dataclasses.dataclass(frozen=True)
class Distributed:
  """How this process joins the run; ``auto`` lets JAX read a cluster launcher."""

  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  auto: bool = False


def _cluster_detected() -> bool:
  """Whether JAX would find a cluster launcher by itself (Slurm, Open MPI, TPU, K8s)."""
  try:
    from jax._src import clusters  # JAX's own detection; private, so guarded
    return any(not env.opt_in_only_method and env.is_env_present()
               for env in clusters.ClusterEnv._cluster_types)
  except Exception:  # an API change must not break single-process runs
    return False


def from_args(args) -> Distributed | None:
  """The settings from flags, then environment; None for a single-process run."""
  values = {}
  for name, var in ENV.items():
    flag = getattr(args, name, None)
    values[name] = flag if flag is not None else os.environ.get(var)
  given = {k: v for k, v in values.items() if v not in (None, "")}
  if not given:
    return Distributed(auto=True) if _cluster_detected() else None
  missing = [f"--{k.replace('_', '-')}" for k in ENV if k not in given]
  if missing:
    raise UsageError(f"a multi-process run needs --coordinator, --num-processes and "
                     f"--process-id (or {', '.join(ENV.values())}); missing {', '.join(missing)}")
  coordinator = str(given["coordinator"])
  if not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", coordinator):
    raise UsageError(f"--coordinator {coordinator!r} is not HOST:PORT")
  try:
    num, pid = int(given["num_processes"]), int(given["process_id"])
  except ValueError:
    raise UsageError(f"--num-processes and --process-id must be integers, got "
                     f"{given['num_processes']!r} and {given['process_id']!r}") from None
  if num < 1 or not 0 <= pid < num:
    raise UsageError(f"--process-id must be in [0, {num}) for --num-processes {num}, got {pid}")
  return Distributed(coordinator, num, pid)


def silence_native_stdout() -> None:
  """Sends what native code prints to stdout to /dev/null; Python keeps the real stdout.

  gloo prints a line from C++ for every connection it opens, from several
  threads at once, so the lines even interleave mid-word; nothing the run
  reports goes through the C-level stdout. Errors (stderr) are untouched.
  """
  sys.stdout.flush()
  real_stdout = os.dup(1)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.close(devnull)
  sys.stdout = os.fdopen(real_stdout, "w", buffering=1, encoding="utf-8")


def divert_native_stderr(path: str) -> None:
  """Sends what native code writes to stderr (gRPC's and XLA's log lines) to the file
  ``path``; Python's ``sys.stderr`` keeps the real one, so the run's own one-line errors
  still reach the terminal. ``train/launch.py`` asks for it (``FLAX_TP_NATIVE_LOG``): when
  a peer dies, every survivor's gRPC client logs a screenful."""
  sys.stderr.flush()
  real_stderr = os.dup(2)
  log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.dup2(log, 2)
  os.close(log)
  sys.stderr = os.fdopen(real_stderr, "w", buffering=1, encoding="utf-8",
                         errors="backslashreplace")


def initialize(settings: Distributed, *, timeout_s: int, heartbeat_s: int) -> None:
  """Starts JAX's distributed runtime; must run before any other JAX work.

  A coordinator that does not answer within ``timeout_s``, or a peer that stops
  sending heartbeats for ``heartbeat_s``, ends the run instead of hanging it.
  """
  import jax
  # Cross-process collectives on the CPU platform go through gloo (NCCL on GPU).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  where = "the cluster launcher's coordinator" if settings.auto else settings.coordinator
  message = (f"could not join the distributed run at {where} within {timeout_s}s: is process "
             f"0 running there, and have all {settings.num_processes or 'the'} processes "
             "started? (--init-timeout sets the wait)")
  # JAX aborts the whole process (no Python exception) when the coordinator
  # stays unreachable; this watchdog ends it first, with one clear line.
  watchdog = threading.Timer(timeout_s, _die, args=(message,))
  watchdog.daemon = True
  watchdog.start()
  try:
    kwargs = dict(initialization_timeout=timeout_s + 30, heartbeat_timeout_seconds=heartbeat_s)
    if settings.auto:
      jax.distributed.initialize(**kwargs)
    else:
      jax.distributed.initialize(settings.coordinator, settings.num_processes,
                                 settings.process_id, **kwargs)
  except Exception as err:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise DistributedError(f"{message} ({first[:200]})") from None
  finally:
    watchdog.cancel()


def _die(message: str) -> None:
  say(f"train/run.py: error: {message}")
  os._exit(1)


def lost_peer(err: BaseException) -> str | None:
  """A one-line explanation if ``err`` means another process of the run is gone."""
  text = str(err)
  if type(err).__name__ != "JaxRuntimeError":
    return None
  markers = ("Connection closed by peer", "Gloo", "NCCL", "heartbeat", "Connection reset",
             "coordination service", "UNAVAILABLE")
  if not any(m in text for m in markers):
    return None
  first = text.strip().splitlines()[0][:200]
  return f"lost contact with another process of the run, which probably died ({first})"
