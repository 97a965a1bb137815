"""Signals during training: the first stops after the step in flight, a second aborts."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import jax
import numpy as np

from train.errors import say
from train.tempfiles import remove_registered


class Interrupts:
  """SIGINT and SIGTERM ask the loop to stop after the step in flight; a second aborts.

  The handler only records the signal: the step runs to completion, so its
  (donated) inputs are replaced by whole outputs before anything is saved.
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.received: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> Interrupts:
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _handle(self, signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    if self.received is not None:
      say(f"train/run.py: second signal ({name}): aborting without saving")
      remove_registered()  # os._exit runs no finally
      os._exit(128 + signum)
    self.received = signum
    # On a terminal a new line first ends the progress bar's line; a log gets no blank line.
    say(("\n" if sys.stdout.isatty() else "") + f"{name} received: stopping after the current "
        "step (send it again to abort at once)")

  def requested(self) -> bool:
    """Whether any process of the run was signalled (all processes agree, then stop
    at the same step)."""
    if jax.process_count() == 1:
      return self.received is not None
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.int32(self.received is not None))
    return bool(np.any(flags))

  @property
  def exit_status(self) -> int:
    return 128 + (self.received or signal.SIGINT)
