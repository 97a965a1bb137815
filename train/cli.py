"""What the training CLIs share: one parser class, one 2/1/130 exit ladder, and how an
unexpected failure is told in one line (no jax import here: XLA_FLAGS must be set before
JAX starts)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable

from train.errors import RunError, UsageError

INT_MAX = 2**31 - 1  # steps, sizes and counters are int32 inside the compiled step
SEED_LIMIT = 2**32




class UsageParser(argparse.ArgumentParser):
  """``argparse`` whose errors are ``UsageError``s (one line and exit status 2 through
  ``exit_ladder``), not usage + traceback."""

  def error(self, message):
    raise UsageError(message)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """argparse's "(default: X)" after each flag's help, except where the help says its own
  default already or there is none to say (None)."""

  def _get_help_string(self, action):
    if action.default is None or "(default:" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


def one_line(err: BaseException) -> str:
  """``Type: first line`` of an unexpected failure (the traceback: FLAX_TP_TRACEBACK=1)."""
  lines = str(err).strip().splitlines()
  text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
  return f"{text} (set FLAX_TP_TRACEBACK=1 for the traceback)"


def exit_ladder(prog: str, body: Callable[[], int], *, failures: tuple = (),
                interrupted: str = "") -> int:
  """The exit status of ``body()``: its own; 2 and one line for bad input
  (``UsageError``); 130 when interrupted (``interrupted`` goes before the line: a
  newline after streamed text); 1 and one line for a failure while running (``RunError``
  and ``failures``), with the cause's traceback under ``FLAX_TP_TRACEBACK=1``."""
  try:
    return body()
  except UsageError as err:
    print(f"{prog}: error: {err}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:  # outside a training loop, which saves and stops by itself
    print(f"{interrupted}{prog}: interrupted", file=sys.stderr)
    return 130
  except (RunError, *failures) as err:
    print(f"{prog}: error: {err}", file=sys.stderr)
    if os.environ.get("FLAX_TP_TRACEBACK") and err.__cause__ is not None:
      traceback.print_exception(err.__cause__)
    return 1
