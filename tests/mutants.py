"""The suite's guard: bugs it is known to catch, each planted in a copy of the checkout.

    python tests/mutants.py            # every mutant; exits 1 if one survives
    python tests/mutants.py rotary     # the mutants whose name contains "rotary"

Each mutant replaces one line of the committed code (``git archive HEAD`` into a temporary
folder) and runs the tests named beside it, which must fail. Trimming the suite (issue
"The suite in half the time") is safe only while every mutant is still caught: the list
and its last result are in the README's section on the tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (file, the line's text, its mutation, the tests that must fail)
MUTANTS = {
    "split RMSNorm without its all-reduce": (
        "flax_tp/split_norm.py",
        'total = all_reduce(jnp.sum(squares, axis=-1, keepdims=True), "sum", self.axis_name)',
        "total = jnp.sum(squares, axis=-1, keepdims=True)",
        ["tests/test_split_norm.py"]),
    "copied kv heads counted once per copy in the gradient norm": (
        "flax_tp/norm.py",
        "weights = None if layout is None else layout.replica_weights()",
        "weights = None",
        ["tests/test_transformer.py", "-k", "grouped_query_attention_equivalence"]),
    # (Padding a param holds is stored as zero and gets no gradient on any path tested,
    # so dropping flax_tp.padding.masked changes no result: an equivalent mutant. The
    # vocabulary's padded logit columns are a mask that matters.)
    "the vocabulary's padded logits left in the softmax": (
        "flax_tp/loss.py",
        "valid = None if layout.is_even else layout.local_mask(index)",
        "valid = None",
        ["tests/test_loss.py"]),
    "data-parallel gradients averaged, not summed": (
        "flax_tp/collectives.py",
        "flat = jax.lax.psum(jnp.concatenate([cotangents[i].reshape(-1) for i in bucket]),",
        "flat = jax.lax.pmean(jnp.concatenate([cotangents[i].reshape(-1) for i in bucket]),",
        ["tests/test_data_parallel.py"]),
    # (Swapping the two output halves permutes q's and k's dims alike, which leaves every
    # q.k as it was: an equivalent mutant. Swapping the halves' roles rotates backwards.)
    "rotary's halves in each other's roles": (
        "models/ops.py",
        "out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)",
        "out = jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)",
        ["tests/test_families.py", "-k", "test_family_equals_transformers and llama3"]),
    "a sliding window one key too wide": (
        "models/attention.py",
        "seen = seen & (key_pos > query_pos - window)",
        "seen = seen & (key_pos >= query_pos - window)",
        ["tests/test_families.py", "-k", "test_family_equals_transformers and mistral"]),
}


def checkout_copy(folder: Path) -> None:
  """The committed tree (HEAD) written into ``folder``."""
  archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True,
                           check=True).stdout
  with tarfile.open(fileobj=BytesIO(archive)) as tar:
    tar.extractall(folder, filter="data")


def run(name: str, file: str, line: str, mutation: str, tests: list[str]) -> bool:
  """True when the tests fail with the mutant in place (it is caught)."""
  with tempfile.TemporaryDirectory(prefix="flax_tp_mutant_") as folder:
    checkout_copy(Path(folder))
    path = Path(folder) / file
    text = path.read_text()
    if text.count(line) != 1:
      raise SystemExit(f"mutant {name!r}: {line!r} is not once in {file}; update the list")
    path.write_text(text.replace(line, mutation))
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": ""}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=-n 2", *tests], cwd=folder, env=env,
                          capture_output=True, text=True)
    caught = done.returncode != 0
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"{'caught  ' if caught else 'SURVIVED'} {name}: {' '.join(tests)} -> {last} "
          f"({time.time() - start:.0f} s)", flush=True)
    return caught


def main(argv: list[str]) -> int:
  chosen = {n: m for n, m in MUTANTS.items() if not argv or any(a in n for a in argv)}
  results = [run(name, *mutant) for name, mutant in chosen.items()]
  return 0 if all(results) else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
