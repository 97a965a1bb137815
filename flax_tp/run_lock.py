"""One run at a time in a checkpoint folder: a lock that dies with the process holding it.

Two runs saving into one folder replace each other's checkpoints (a requeued job
started while the old one still runs, a pasted command). ``FolderLock`` holds a POSIX
record lock (``fcntl.lockf``) on ``DIR/.flax_tp-run.lock`` for as long as a run lives:
the kernel releases it when the process ends, however it ends (``kill -9`` too), so a
stale lock never needs clearing by hand. On NFS the lock is kept by the server (NFSv4,
or lockd for v3), so runs on hosts sharing the folder see each other's. The file's text
names the holder (host, pid, start time, command) for the refusal's message; the lock,
not the text, decides.

In a run of several processes only process 0 takes the lock (POSIX locks belong to a
process, and the run's processes must not refuse each other); ``train.loop`` tells the
others what it found, so all of them stop or none does.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = ".flax_tp-run.lock"

# Paths this process holds: a second FolderLock on one of them must refuse, since
# POSIX locks do not exclude their own process (and closing the second descriptor
# would release the first one's lock).
_HELD: set[Path] = set()


class FolderInUse(RuntimeError):
  """Another run (or another lock in this process) holds the folder; says which.

  ``holder``: the holder's own description (pid, host, start, command)."""

  def __init__(self, message: str, holder: str):
    super().__init__(message)
    self.holder = holder


class FolderLock:
  """The lock of one folder: ``acquire`` (``FolderInUse`` if held), ``release``.

  Also a context manager. ``holder`` describes the process that holds it.
  """

  def __init__(self, directory: str | Path):
    self.path = Path(directory).absolute() / LOCK_NAME
    self._fd: int | None = None

  def acquire(self) -> None:
    if self.path in _HELD:
      raise FolderInUse(f"{str(self.path.parent)!r} is already locked by this process "
                        f"(pid {os.getpid()})", f"this process (pid {os.getpid()})")
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = _read(fd) or "a process that has not yet said which"
      os.close(fd)
      raise FolderInUse(f"{str(self.path.parent)!r} is in use by another run: {holder}",
                        holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, _describe_self().encode("utf-8", "backslashreplace"), 0)
    os.fsync(fd)
    self._fd = fd
    _HELD.add(self.path)

  def release(self) -> None:
    """Lets the folder go (the file stays: removing it would race a new holder)."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    _HELD.discard(self.path)
    os.close(fd)  # closing the descriptor drops the lock

  @property
  def held(self) -> bool:
    return self._fd is not None

  def __enter__(self) -> FolderLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _describe_self() -> str:
  started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  command = " ".join([Path(sys.argv[0]).name if sys.argv else "python", *sys.argv[1:]])
  return f"pid {os.getpid()} on host {socket.gethostname()!r} since {started} ({command!r})"


def _read(fd: int) -> str:
  try:
    return os.pread(fd, 4096, 0).decode("utf-8", "replace").strip().splitlines()[0]
  except (OSError, IndexError):
    return ""
