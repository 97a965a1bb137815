"""The code's layering, read from its source (milliseconds, no import runs).

``flax_tp`` (the library) imports nothing above it, ``models`` nothing from ``train`` or
``bench``, ``train`` nothing from ``bench``; no module imports itself back through
others; no source module imports another's private name; and flax_tp's param metadata
keys are written in one module only (``flax_tp/param_info.py``).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flax_tp", "models", "train", "bench")
ABOVE = {"flax_tp": {"models", "train", "bench"}, "models": {"train", "bench"},
         "train": {"bench"}, "bench": set()}
METADATA_KEYS = {"tp_layout", "tp_dim", "tp_layers", "tp_layer_at", "fsdp_dim",
                 "fsdp_per_block"}


def _modules() -> dict[str, Path]:
  out = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
      out[name] = path
  return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
  """``(module, [names imported from it], line)`` of every import, function-local too."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      out += [(a.name, [], node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      out.append((node.module, [a.name for a in node.names], node.lineno))
  return out


def _target(module: str, names: list[str]) -> list[str]:
  """The project modules an import loads: ``from pkg import sub`` loads ``pkg.sub``."""
  found = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
  return found or ([module] if module in MODULES else [])


def _graph() -> dict[str, set[str]]:
  return {name: {t for module, names, _ in _imports(path) for t in _target(module, names)
                 if t != name}
          for name, path in MODULES.items()}


def test_the_project_was_found():
  assert {"flax_tp", "flax_tp.partition", "models.transformer", "train.run",
          "bench.run"} <= set(MODULES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_only_point_down(package):
  wrong = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {module}"
           for name in MODULES if name.split(".")[0] == package
           for module, _, line in _imports(MODULES[name])
           if module.split(".")[0] in ABOVE[package]]
  assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
  graph = _graph()
  cycles, state = [], {}

  def visit(node, stack):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
      elif nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  assert not cycles, "\n".join(cycles)


def test_no_private_names_imported_across_modules():
  wrong = [f"{path.relative_to(ROOT)}:{line} imports {n} from {module}"
           for path in MODULES.values() for module, names, line in _imports(path)
           if module.split(".")[0] in PACKAGES
           for n in names if n.startswith("_") and not n.startswith("__")]
  assert not wrong, "\n".join(wrong)


def _constants_outside_all(tree: ast.AST) -> list[ast.Constant]:
  """String constants, less those naming exports in ``__all__`` (a function may share
  a key's name)."""
  exported = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
              and any(getattr(t, "id", None) == "__all__" for t in node.targets)
              for c in ast.walk(node.value)}
  return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in exported]


def test_param_metadata_keys_live_in_one_module():
  home = ROOT / "flax_tp" / "param_info.py"
  wrong = [f"{path.relative_to(ROOT)}:{node.lineno} writes {node.value!r}"
           for path in MODULES.values() if path != home
           for node in _constants_outside_all(ast.parse(path.read_text(encoding="utf-8")))
           if node.value in METADATA_KEYS]
  assert not wrong, "\n".join(wrong)
  assert all(repr(key) in home.read_text() or f'"{key}"' in home.read_text()
             for key in METADATA_KEYS)
