"""PNG plots of ``bench/run.py``'s results: flax_tp beside its peers on each mesh.

    python -m bench.plots [bench/results.json] [--out DIR]

``bench/run.py`` draws them itself next to its ``--out`` file. Needs matplotlib,
the ``bench`` extra (``pip install -e ".[bench]"``); nothing else in flax_tp does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Contenders in the order they are drawn, with their legend labels.
CONTENDERS = {
    "flax_tp": "flax_tp",
    "gspmd": "GSPMD (reference, separate q/k/v)",
    "gspmd_fused": "GSPMD (fused q/k/v GPT)",
    "data_parallel": "data parallel (Dx1)",
}
# (results key, axis label, scale to the axis unit, file name)
METRICS = (
    ("step_s", "step time (ms)", 1e3, "step_time.png"),
    ("collective_bytes", "collective bytes per device (MB)", 1e-6, "collective_bytes.png"),
)


class PlotsUnavailable(RuntimeError):
  """matplotlib is not installed."""


def draw(results: dict, out_dir: Path) -> list[Path]:
  """Grouped bars per mesh for each metric of ``results["meshes"]``; returns the files."""
  try:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
  except ImportError:
    raise PlotsUnavailable('plots need matplotlib: pip install -e ".[bench]"') from None
  meshes = results.get("meshes") or {}
  specs = list(meshes)
  names = [n for n in CONTENDERS if any(n in meshes[s] and "step_s" in meshes[s][n]
                                        for s in specs)]
  if not names:
    return []
  machine = results.get("machine", {})
  where = f"{machine.get('platform', '?')}, jax {machine.get('jax', '?')}"
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  width = 0.8 / len(names)
  for key, label, scale, file_name in METRICS:
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for i, name in enumerate(names):
      offset = (i - (len(names) - 1) / 2) * width
      points = [(j + offset, meshes[s][name][key] * scale) for j, s in enumerate(specs)
                if name in meshes[s] and key in meshes[s][name]]
      ax.bar([x for x, _ in points], [y for _, y in points], width, label=CONTENDERS[name])
    ax.set_xticks(range(len(specs)), specs)
    ax.set_xlabel("mesh (data x model)")
    ax.set_ylabel(label)
    ax.set_title(f"train step ({where})")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / file_name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written


def main(argv=None) -> int:
  from train.errors import OneLineParser

  p = OneLineParser(prog="bench.plots", description=__doc__.split("\n\n")[0])
  p.add_argument("results", nargs="?", default=str(Path(__file__).parent / "results.json"))
  p.add_argument("--out", default=None, help="folder for the PNGs (default: beside results)")
  args = p.parse_args(argv)
  path = Path(args.results)
  try:
    results = json.loads(path.read_text())
    files = draw(results, Path(args.out) if args.out else path.parent)
  except (OSError, ValueError, PlotsUnavailable) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  for f in files:
    print(f)
  return 0


if __name__ == "__main__":
  sys.exit(main())
