"""Errors the training CLI reports as one line (no jax import here)."""

import argparse
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
