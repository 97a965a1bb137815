"""Errors the CLIs report as one line, and the argument checks they share (no jax import
here: XLA_FLAGS must be checked before JAX starts)."""

import argparse
import math
import sys


class UsageError(Exception):
  """Bad input (flags, mesh, data, checkpoint): one line on stderr, exit status 2."""


class RunError(Exception):
  """A failure while running (disk full, unwritable path): one line on stderr, exit status 1."""


class OneLineParser(argparse.ArgumentParser):
  """``argparse`` whose errors are one line, ``prog: error: message``, and exit status 2
  (argparse's default prints the whole usage first). For the scripts that have no
  ``UsageError`` handler of their own: the launcher and the benchmarks."""

  def error(self, message):
    print(f"{self.prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# -- argument types shared by the CLIs: argparse reports their errors as one line ----------

def positive_int(text: str) -> int:
  """``type=`` of a flag that must be an integer >= 1."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
  return value


def non_negative_float(text: str) -> float:
  """``type=`` of a flag that must be a finite number >= 0."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
  if not math.isfinite(value) or value < 0:
    raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
  return value


def port_number(text: str) -> int:
  """``type=`` of a TCP port: an integer in [1, 65535]."""
  value = positive_int(text)
  if value > 65535:
    raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {value}")
  return value


def comma_choices(allowed: tuple[str, ...]):
  """``type=`` of a comma-separated list whose every item is one of ``allowed``."""
  def parse(text: str) -> list[str]:
    items = [item for item in text.split(",") if item]
    unknown = [item for item in items if item not in allowed]
    if unknown:
      raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; expected "
                                       f"comma-separated names from {', '.join(allowed)}")
    return items
  return parse


def comma_positive_ints(text: str) -> list[int]:
  """``type=`` of a comma-separated list of integers >= 1 (``128,512``)."""
  items = [item for item in text.split(",") if item]
  if not items:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
  return [positive_int(item) for item in items]


def unwritable_file(path) -> str | None:
  """Why the file ``path`` cannot be written (created, or appended to), or None.

  Tried for real, not with ``os.access``: root passes every permission check, yet
  cannot create ``/proc/x``. A file the probe creates is removed again."""
  import os
  from pathlib import Path
  path = Path(path)
  if path.is_dir():
    return "it is a folder"
  existed = path.exists()
  try:
    with open(path, "a"):
      pass
  except OSError as err:
    return err.strerror or str(err)
  if not existed:
    os.unlink(path)
  return None


# XLA's CPU client takes minutes and tens of GB (ignoring Ctrl-C) on absurd counts.
MAX_SIMULATED_DEVICES = 1024


def xla_device_count_problem(flags: str) -> str | None:
  """Why ``XLA_FLAGS`` asks for an impossible number of simulated CPU devices
  (``banana``, ``-3``, ``0``, ``²``, more than ``MAX_SIMULATED_DEVICES``), or None; XLA
  itself fails later with a traceback, or runs out of memory."""
  import re
  for value in re.findall(r"--xla_force_host_platform_device_count=(\S*)", flags):
    # [0-9] and not str.isdigit, which takes '²' (and int() then refuses it).
    if not (re.fullmatch(r"[0-9]+", value) and int(value) >= 1):
      return (f"XLA_FLAGS sets --xla_force_host_platform_device_count={value!r}; expected an "
              "integer >= 1")
    if int(value) > MAX_SIMULATED_DEVICES:
      return (f"XLA_FLAGS sets --xla_force_host_platform_device_count={value}; at most "
              f"{MAX_SIMULATED_DEVICES} devices per process can be simulated on a CPU")
  return None


def not_utf8(text: str) -> str | None:
  """Why a command-line string is not UTF-8 text, or None. Python hands undecodable
  argument bytes over as surrogate escapes, which every encoder then refuses."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as err:
    bad = text[err.start:err.end].encode("utf-8", "surrogateescape")
    return f"it is not valid UTF-8 (byte {bad[:1].hex()!r} at character {err.start})"
  return None


def stderr_fd() -> int:
  """The file descriptor of Python's stderr: the terminal even where a multi-process run
  diverted native (C++) log lines away from descriptor 2."""
  try:
    return sys.stderr.fileno()
  except (AttributeError, OSError, ValueError):  # a test's in-memory capture
    return 2


def say(line: str) -> None:
  """``line`` on stderr straight through the descriptor: safe in a signal handler and
  while a live progress display holds ``sys.stderr``."""
  import os
  os.write(stderr_fd(), (line + "\n").encode())


def exit_on_interrupt(prog: str) -> None:
  """From now until a run installs its own handler, Ctrl-C (or SIGTERM) ends the
  process at once with one line and status 130 (143).

  For the start-up of a script: there is nothing to save yet, and Python's
  ``KeyboardInterrupt`` would print a traceback from wherever an import or JAX's own
  start-up happened to be (or, a second Ctrl-C, from its shutdown). ``os._exit`` runs
  no ``finally``: the temporary files being written (a token cache) are removed first
  (``train.tempfiles``)."""
  import os
  import signal

  from train.tempfiles import remove_registered

  def handler(signum, _frame):
    remove_registered()
    try:
      sys.stdout.flush()
    except Exception:  # a closed or broken stdout must not stop the exit
      pass
    say(f"{prog}: interrupted")
    os._exit(128 + signum)

  signal.signal(signal.SIGINT, handler)
  signal.signal(signal.SIGTERM, handler)
