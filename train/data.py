"""Byte-level text data: the default corpus is the Python standard library's source.

Every machine with Python has it (found through ``sysconfig``), so training
needs no download. Tokens are bytes (vocabulary 256). Batches are random
windows drawn from ``(seed, step)`` alone, so any step's batch can be rebuilt
(resume is exact) and each process can build only its own rows.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import numpy as np

DEFAULT_MAX_BYTES = 16 * 2**20
EVAL_FRACTION = 0.05


def stdlib_sources() -> list[Path]:
  """The standard library's ``.py`` files, in a fixed order (third-party packages excluded)."""
  root = Path(sysconfig.get_paths()["stdlib"])
  return sorted(p for p in root.rglob("*.py")
                if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def text_files(path: Path) -> list[Path]:
  """``path`` itself, or every file below it, in a fixed order."""
  if path.is_file():
    return [path]
  if path.is_dir():
    return sorted(p for p in path.rglob("*") if p.is_file())
  raise ValueError(f"--data {str(path)!r} is neither a file nor a folder")


def read_corpus(files: list[Path], max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
  """The files' bytes joined by blank lines, up to ``max_bytes``; binary files skipped."""
  parts, total = [], 0
  for file in files:
    try:
      data = file.read_bytes()
    except OSError:
      continue
    if b"\0" in data[:4096]:  # not text
      continue
    parts.append(data)
    total += len(data) + 2
    if total >= max_bytes:
      break
  return b"\n\n".join(parts)[:max_bytes]


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
  """A token stream split into a training part and a held-out tail for eval."""

  train: np.ndarray  # [n_train] uint8
  eval: np.ndarray  # [n_eval] uint8
  source: str

  @classmethod
  def load(cls, data: str | None = None, *, seq_len: int,
           max_bytes: int = DEFAULT_MAX_BYTES) -> ByteCorpus:
    files = stdlib_sources() if data is None else text_files(Path(data))
    tokens = np.frombuffer(read_corpus(files, max_bytes), dtype=np.uint8)
    source = "the Python standard library" if data is None else str(data)
    n_eval = max(int(len(tokens) * EVAL_FRACTION), seq_len + 2)
    if len(tokens) - n_eval < seq_len + 2:
      raise ValueError(
          f"--data {source!r} has {len(tokens)} bytes: too little text for --seq-len "
          f"{seq_len} (need at least {2 * (seq_len + 2)})")
    return cls(tokens[:-n_eval], tokens[-n_eval:], source)

  def unigram_entropy(self) -> float:
    """Entropy (nats) of the byte distribution: what a model without context scores."""
    counts = np.bincount(self.train, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())

  def window_starts(self, split: str, seed: int, step: int, batch_size: int,
                    seq_len: int) -> np.ndarray:
    """``[batch_size]`` start offsets of the step's windows (deterministic)."""
    tokens = self.train if split == "train" else self.eval
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, step])
    return rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)

  def rows(self, split: str, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """``[len(starts), seq_len + 1]`` int32 windows (inputs plus the next-byte targets)."""
    tokens = self.train if split == "train" else self.eval
    return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)

  def batch(self, split: str, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    return self.rows(split, self.window_starts(split, seed, step, batch_size, seq_len), seq_len)
