"""Benchmarks of flax_tp (BENCHMARKS.md); each module runs with ``python -m bench.<name>``."""

from __future__ import annotations

import sys


def meshes_or_exit(specs: list[str], prog: str) -> None:
  """Exits 2 with one line naming the first mesh this machine cannot build (a bad spec,
  more devices than it has, an impossible device count in ``XLA_FLAGS``), before any
  benchmark starts."""
  import os

  from train.errors import xla_device_count_problem
  problem = xla_device_count_problem(os.environ.get("XLA_FLAGS", ""))
  if problem:
    print(f"{prog}: error: {problem}", file=sys.stderr)
    raise SystemExit(2)
  import flax_tp
  for spec in specs:
    try:
      flax_tp.make_mesh(spec)
    except ValueError as e:
      print(f"{prog}: error: {e}", file=sys.stderr)
      raise SystemExit(2) from None


def out_path_or_exit(out: str | None, prog: str) -> None:
  """Makes the folder of ``--out`` before any benchmark starts, or exits 2 with one
  line saying why it cannot be written: the results of a long run must not be lost
  to a missing folder at its end."""
  if not out:
    return
  from pathlib import Path

  from train.errors import unwritable_file
  path = Path(out)
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    why = unwritable_file(path)
  except OSError as e:
    why = e.strerror or str(e)
  if why:
    print(f"{prog}: error: cannot write --out {out!r}: {why}", file=sys.stderr)
    raise SystemExit(2)
