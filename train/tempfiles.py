"""Temporary files the CLIs write beside their targets: named so they are flax_tp's own,
removed on every exit path, and cleared by the next run when a killed one left them.

A temporary file is ``DIR/.NAME.flax_tp-HOST-PID.tmp`` beside its target ``DIR/NAME``:
no file of a user's is ever overwritten or renamed away (``m.jsonl.tmp`` stays theirs),
and whose process wrote it can be told from its name. It is removed when its ``with``
block ends, however it ends: an exception (a full disk), Ctrl-C or SIGTERM during
start-up (``train.errors.exit_on_interrupt`` ends the process with ``os._exit``, which
runs no ``finally``: it removes the files registered here first), a second signal in
the training loop. Only ``kill -9`` leaves one behind, and ``remove_stale`` then clears
those whose process on this host is gone. No jax import here.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

_OWN = re.compile(r"\..+\.flax_tp-(?P<host>[^/]+)-(?P<pid>\d+)\.tmp")
_REGISTERED: set[Path] = set()


def _host() -> str:
  return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


@contextlib.contextmanager
def temp_beside(target: str | Path) -> Iterator[Path]:
  """A temporary path beside ``target`` for writing it atomically (write, then
  ``os.replace(tmp, target)``); removed when the block ends unless it was renamed."""
  target = Path(target)
  tmp = target.with_name(f".{target.name}.flax_tp-{_host()}-{os.getpid()}.tmp")
  # This name is this process's; a file already there was left by a dead process that
  # had the same pid.
  tmp.unlink(missing_ok=True)
  _REGISTERED.add(tmp)
  try:
    yield tmp
  finally:
    _REGISTERED.discard(tmp)
    tmp.unlink(missing_ok=True)


def remove_registered() -> None:
  """Removes every temporary file now being written (for an exit that skips ``finally``)."""
  for tmp in list(_REGISTERED):
    with contextlib.suppress(OSError):
      tmp.unlink()


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def remove_stale(folder: str | Path, legacy_glob: str | None = None,
                 legacy_age_s: float = 3600.0) -> list[Path]:
  """Removes the temporary files in ``folder`` that a process of this host which is no
  longer running left behind (a ``kill -9``). ``legacy_glob``: older flax_tp's temporary
  names, which carry no pid: removed once not written for ``legacy_age_s`` seconds.
  Returns what was removed."""
  folder = Path(folder)
  removed = []
  if not folder.is_dir():
    return removed
  host, now = _host(), time.time()
  for path in folder.iterdir():
    match = _OWN.fullmatch(path.name)
    stale = (match is not None and match["host"] == host and not _alive(int(match["pid"])))
    if not stale and match is None and legacy_glob and path.match(legacy_glob):
      with contextlib.suppress(OSError):
        stale = now - path.stat().st_mtime > legacy_age_s
    if stale and path.is_file():
      with contextlib.suppress(OSError):
        path.unlink()
        removed.append(path)
  return removed
