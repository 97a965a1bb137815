"""Benchmarks of flax_tp (BENCHMARKS.md); each module runs with ``python -m bench.<name>``."""

from __future__ import annotations

import sys


def meshes_or_exit(specs: list[str], prog: str) -> None:
  """Exits 2 with one line naming the first mesh this machine cannot build (a bad spec,
  or more devices than it has), before any benchmark starts."""
  import flax_tp
  for spec in specs:
    try:
      flax_tp.make_mesh(spec)
    except ValueError as e:
      print(f"{prog}: error: {e}", file=sys.stderr)
      raise SystemExit(2) from None
