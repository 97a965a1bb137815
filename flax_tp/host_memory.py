"""Host memory on XLA:CPU: keep what the steps free for the next step.

XLA:CPU allocates each executable's temporary buffer with ``malloc`` when a step
starts and frees it when the step ends: one block per device and step, tens of MB
at small sizes (20 MB per device at issue 41's 2x4 step, 32 MB at 1x8). glibc's
default policy hands such blocks back to the kernel: a thread arena's emptied heap
is unmapped, the main arena's free top beyond the trim threshold is released. The
next step then touches fresh pages, one page fault per 4 KiB: 3-30 thousand faults
per step at those sizes, which cost 10-20% of the step on a 2-core machine and came
and went with which threads' arenas the blocks landed in (BENCHMARKS.md §2, issue
41). A GPU framework keeps a caching allocator for the same reason.

``keep_freed_host_memory`` sets glibc's malloc so that freed blocks stay with the
process: blocks up to 32 MiB come from the arenas (``M_MMAP_THRESHOLD``, the most
glibc allows; larger ones are mapped and unmapped per step whatever the policy),
the main arena's free top is not trimmed (``M_TRIM_THRESHOLD``) and a thread arena
keeps its emptied heaps (``M_TOP_PAD`` of one whole heap). What the process has
freed stays resident for its next allocation instead of going back to the system:
the resident size stays at its high-water mark, as under a caching allocator.
``Trainer`` calls it for a CPU mesh; ``FLAX_TP_KEEP_FREED_MEMORY=0`` in the
environment turns it off.
"""

from __future__ import annotations

import ctypes
import os
import threading

ENV_VAR = "FLAX_TP_KEEP_FREED_MEMORY"

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# The largest mmap threshold glibc accepts on 64-bit: half its 64 MiB HEAP_MAX_SIZE.
_MMAP_THRESHOLD = 32 << 20
# A heap is kept while its arena's free top is within this pad: one whole heap.
_TOP_PAD = 64 << 20
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int

_lock = threading.Lock()
_kept: bool | None = None


def keep_freed_host_memory() -> bool:
  """Set this process's glibc malloc to keep freed memory for reuse (module
  docstring). Idempotent; returns whether the policy is in force: False where the
  C library is not glibc (macOS, musl) or ``FLAX_TP_KEEP_FREED_MEMORY=0``.
  Raises ``ValueError`` for any other value of that variable than ``0`` or ``1``."""
  global _kept
  with _lock:
    if _kept is None:
      _kept = _apply()
    return _kept


def setting_problem() -> str | None:
  """Why ``FLAX_TP_KEEP_FREED_MEMORY`` holds neither ``0`` nor ``1``, or None (unset
  reads as ``1``). The CLIs check it before any work starts."""
  setting = os.environ.get(ENV_VAR, "1")
  if setting in ("0", "1"):
    return None
  return (f"{ENV_VAR}={setting!r}; expected 0 (leave malloc's policy alone) or 1 (keep "
          "freed host memory for reuse, the default)")


def _apply() -> bool:
  problem = setting_problem()
  if problem:
    raise ValueError(problem)
  if os.environ.get(ENV_VAR, "1") == "0":
    return False
  libc = _glibc()
  if libc is None:
    return False
  settings = ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _NEVER_TRIM),
              (_M_TOP_PAD, _TOP_PAD))
  return all(libc.mallopt(param, value) == 1 for param, value in settings)


def _glibc() -> ctypes.CDLL | None:
  """The process's C library if it is glibc (which alone has these knobs)."""
  try:
    process = ctypes.CDLL(None)
  except (OSError, TypeError):  # TypeError: Windows, which has no process handle
    return None
  if not (hasattr(process, "gnu_get_libc_version") and hasattr(process, "mallopt")):
    return None
  process.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  process.mallopt.restype = ctypes.c_int
  return process
