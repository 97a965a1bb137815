"""Benchmarks of flax_tp (BENCHMARKS.md); each module runs with ``python -m bench.<name>``."""

from __future__ import annotations

import sys


def mesh_list(text: str) -> list[str]:
  """The meshes of a ``--meshes`` value, in any of ``flax_tp.make_mesh``'s forms:
  ``"1x8,2x4"``, ``"2x2x2,1x8x1"``, and named ones, whose own commas do not separate
  meshes (``"data=2,context=2,model=2,1x8"`` is two). A named mesh ends where the next
  form starts, or where one of its roles comes again (``"data=2,model=4,data=4,model=2"``
  is two). ``;`` separates meshes too."""
  specs: list[str] = []
  named: list[str] = []  # the current named mesh's "role=size" parts

  def close():
    if named:
      specs.append(",".join(named))
      named.clear()

  for part in (p.strip() for p in text.replace(";", ",").split(",")):
    if not part:
      continue
    if "=" in part:
      role = part.split("=", 1)[0].strip()
      if any(n.split("=", 1)[0].strip() == role for n in named):
        close()
      named.append(part)
    else:
      close()
      specs.append(part)
  close()
  return specs


def meshes_or_exit(specs: list[str], prog: str, *, context: bool = True) -> None:
  """Exits 2 with one line naming the first mesh this machine cannot build (a bad spec,
  more devices than it has, an impossible device count in ``XLA_FLAGS``), before any
  benchmark starts. ``context=False``: a benchmark whose contenders have no context
  axis (the GSPMD peers) names a mesh with one, rather than failing inside."""
  import os

  from train.errors import xla_device_count_problem
  problem = xla_device_count_problem(os.environ.get("XLA_FLAGS", ""))
  if problem:
    print(f"{prog}: error: {problem}", file=sys.stderr)
    raise SystemExit(2)
  import flax_tp
  for spec in specs:
    try:
      mesh = flax_tp.make_mesh(spec)
    except ValueError as e:
      print(f"{prog}: error: {e}", file=sys.stderr)
      raise SystemExit(2) from None
    if not context and flax_tp.MeshAxes.of(mesh).context > 1:
      print(f"{prog}: error: mesh {spec!r} has a context axis, and this benchmark's "
            f"contenders have none (data x model only); bench.context measures context "
            f"parallelism", file=sys.stderr)
      raise SystemExit(2)


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
