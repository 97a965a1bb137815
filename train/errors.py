"""Errors the training CLI reports as one line (no jax import here)."""


class UsageError(Exception):
  """Bad input (flags, mesh, data, checkpoint): one line on stderr, exit status 2."""


class RunError(Exception):
  """A failure while running (disk full, unwritable path): one line on stderr, exit status 1."""
