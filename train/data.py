"""Text data as tokens: the default corpus is the Python standard library's source.

Every machine with Python has it (found through ``sysconfig``), so training
needs no download. Tokens are bytes (vocabulary 256) for the built-in presets,
or the ids of a HuggingFace ``tokenizer.json`` (``HFTokenizer``).

A corpus of any size is tokenized once into a token file that is memory-mapped,
never held whole in memory: files are streamed in chunks, and a file whose
first 4 KiB hold a NUL byte is taken as binary and skipped after reading only
those. The token file is cached (``$FLAX_TP_CACHE``, default
``~/.cache/flax_tp``), keyed by the tokenizer and every source file's path,
size and modification time, and written atomically.

Batches are random windows drawn from ``(seed, step)`` alone, so any step's
batch can be rebuilt (resume is exact) and each process reads only its own rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

from train.tempfiles import remove_stale, temp_beside

EVAL_FRACTION = 0.05
SNIFF_BYTES = 4096
CHUNK_BYTES = 1 << 20
SEPARATOR = b"\n\n"  # between files
STDLIB = "the Python standard library"


class ByteTokenizer:
  """Bytes are tokens: vocabulary 256, nothing to load."""

  name = "bytes"  # part of the token cache's key
  vocab_size = 256
  dtype = np.dtype(np.uint8)

  def encode(self, data: bytes, special_tokens: bool = False) -> np.ndarray:
    return np.frombuffer(data, np.uint8)

  def decode(self, ids) -> str:
    # Ids past the byte range (a vocabulary padded for tests) print as '?'.
    return bytes(int(t) if t < 256 else ord("?") for t in ids).decode("utf-8", "replace")


class HFTokenizer:
  """A HuggingFace ``tokenizer.json`` through the ``tokenizers`` package."""

  def __init__(self, path: Path):
    from tokenizers import Tokenizer
    self.path = Path(path)
    raw = self.path.read_bytes()
    self._tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    self.name = "hf-" + hashlib.sha256(raw).hexdigest()[:24]
    self.vocab_size = self._tokenizer.get_vocab_size()
    self.dtype = np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

  def encode(self, data: bytes, special_tokens: bool = False) -> np.ndarray:
    """Token ids of ``data``; ``special_tokens`` adds the tokenizer's own (a Llama
    prompt's BOS), as HF's pipelines do for a prompt; training text gets none."""
    ids = self._tokenizer.encode(data.decode("utf-8", "replace"),
                                 add_special_tokens=special_tokens).ids
    return np.asarray(ids, self.dtype)

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(t) for t in ids])


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


def _terminal():
  """A rich Console on stdout when it is a terminal, else None: off a terminal rich's
  transient progress bar leaves an empty line behind (before an error, in a log)."""
  from rich.console import Console
  console = Console()
  return console if console.is_terminal else None


def cache_dir() -> Path:
  return Path(os.environ.get("FLAX_TP_CACHE") or Path.home() / ".cache" / "flax_tp")


def fingerprint(files: list[Path], tokenizer) -> str:
  """Identifies the sources and the tokenizer: what the cached token file was built from."""
  h = hashlib.sha256(tokenizer.name.encode())
  for file in files:
    try:
      st = file.stat()
      h.update(f"\0{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    except OSError:
      h.update(f"\0{file}\0unreadable".encode())
  return h.hexdigest()


def tokenize_to_file(files: list[Path], out, tokenizer, progress=None) -> dict[str, Any]:
  """Streams the text files' tokens into ``out``, files separated by blank lines.

  Files are read in chunks; a chunk is cut after its last newline (the rest
  goes with the next; see ``_chunk_cut`` for longer lines), so a token never
  straddles two chunks. Returns what was
  read: file and token counts, the files skipped as binary or unreadable, and
  each token's count (for the unigram entropy without a second pass).
  """
  counts = np.zeros(tokenizer.vocab_size, np.int64)
  report = {"files": 0, "tokens": 0, "binary": [], "unreadable": []}

  def emit(data: bytes) -> None:
    ids = tokenizer.encode(data)
    out.write(ids.tobytes())
    counts[:] += np.bincount(ids, minlength=len(counts))[:len(counts)]
    report["tokens"] += len(ids)

  for file in files:
    try:
      with open(file, "rb") as f:
        chunk = f.read(max(CHUNK_BYTES, SNIFF_BYTES))
        if b"\0" in chunk[:SNIFF_BYTES]:
          report["binary"].append(str(file))
        elif chunk:
          if report["files"]:
            emit(SEPARATOR)
          report["files"] += 1
          carry = b""
          while chunk:
            data = carry + chunk
            cut = _chunk_cut(data)
            emit(data[:cut])
            carry = data[cut:]
            chunk = f.read(CHUNK_BYTES)
          if carry:
            emit(carry)
    except OSError:
      report["unreadable"].append(str(file))
    if progress is not None:
      progress(file)
  report["token_counts"] = counts.tolist()
  return report


def _chunk_cut(data: bytes) -> int:
  """Where to cut a chunk whose rest follows with the next one: after its last newline;
  in a line longer than a chunk, before its last space or tab (a byte-level BPE joins a
  space to the word after it, so the tokens are those of the uncut text); else at the
  last UTF-8 character boundary (never inside a character, which the tokenizer would
  read as U+FFFD)."""
  cut = data.rfind(b"\n") + 1
  if cut:
    return cut
  cut = max(data.rfind(b" "), data.rfind(b"\t"))
  if cut > 0:
    return cut
  start = len(data) - 1  # the last character's first byte: back over continuation bytes
  while start > 0 and len(data) - start < 4 and data[start] & 0xC0 == 0x80:
    start -= 1
  lead = data[start]
  length = 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
  return start if len(data) - start < length else len(data)


@dataclasses.dataclass(frozen=True)
class TokenCorpus:
  """A memory-mapped token stream: a training part and a held-out tail for eval."""

  tokens: np.ndarray  # [n] token ids (uint8 bytes, or the tokenizer's dtype), memory-mapped
  n_eval: int
  source: str
  report: dict[str, Any]
  fingerprint: str
  tokenizer: Any

  @property
  def train(self) -> np.ndarray:
    return self.tokens[:-self.n_eval]

  @property
  def eval(self) -> np.ndarray:
    return self.tokens[-self.n_eval:]

  @classmethod
  def load(cls, data: str | None = None, *, seq_len: int, tokenizer=None,
           show_progress: bool = False, cache: Path | None = None) -> TokenCorpus:
    tokenizer = tokenizer or ByteTokenizer()
    files = stdlib_sources() if data is None else text_files(Path(data))
    source = STDLIB if data is None else str(data)
    key = fingerprint(files, tokenizer)
    tokens_path, report = _cached_tokens(files, key, tokenizer, cache or cache_dir(),
                                         show_progress)
    n = report["tokens"]
    if n == 0:
      raise ValueError(f"--data {source!r} has no text: {_skipped(report) or 'no bytes'}")
    tokens = np.memmap(tokens_path, dtype=tokenizer.dtype, mode="r", shape=(n,))
    n_eval = max(int(n * EVAL_FRACTION), seq_len + 2)
    if n - n_eval < seq_len + 2:
      raise ValueError(
          f"--data {source!r} has {n} tokens of text: too little for --seq-len {seq_len} "
          f"(need at least {2 * (seq_len + 2)})")
    return cls(tokens, n_eval, source, report, key, tokenizer)

  def describe(self) -> str:
    """One line: how many tokens came from where, what was skipped."""
    r = self.report
    skipped = _skipped(r)
    return (f"{r['tokens']:,} tokens ({self.tokenizer.name}) from {r['files']:,} file(s) of "
            f"{self.source}"
            f"{f'; skipped {skipped}' if skipped else ''} | {len(self.train):,} train / "
            f"{len(self.eval):,} eval")

  def unigram_entropy(self) -> float:
    """Entropy (nats) of the token distribution: what a model without context scores."""
    counts = np.asarray(self.report["token_counts"], np.float64)
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
    return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)  # reads these rows

  def batch(self, split: str, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    return self.rows(split, self.window_starts(split, seed, step, batch_size, seq_len), seq_len)


def _skipped(report: dict[str, Any]) -> str:
  parts = []
  for kind in ("binary", "unreadable"):
    names = report[kind]
    if names:
      parts.append(f"{len(names)} {kind} file(s) (e.g. {names[0]!r})")
  return ", ".join(parts)


# What a token file's report holds (``tokenize_to_file``'s fields and the fingerprint).
REPORT_FIELDS = ("files", "tokens", "binary", "unreadable", "token_counts", "fingerprint")


def _cached_tokens(files: list[Path], key: str, tokenizer, cache: Path,
                   show_progress: bool) -> tuple[Path, dict[str, Any]]:
  """The token file for ``files`` (built on a miss) and its report."""
  tokens_path = cache / f"tokens-{key[:32]}.bin"
  report_path = cache / f"tokens-{key[:32]}.json"
  try:
    report = json.loads(report_path.read_text(encoding="utf-8"))
    size = report["tokens"] * tokenizer.dtype.itemsize
    # A report written by another version of this code, or cut short, is a miss:
    # the tokens are built again rather than trusted.
    complete = all(field in report for field in REPORT_FIELDS)
    if complete and report.get("fingerprint") == key and tokens_path.stat().st_size == size:
      return tokens_path, report
  except (OSError, ValueError, KeyError, AttributeError, TypeError):
    pass
  cache.mkdir(parents=True, exist_ok=True)
  # Token files a killed run was writing (``kill -9``; every other exit removes its own);
  # before this naming, ``.tokens-*.tmp``.
  remove_stale(cache, legacy_glob=".tokens-*.tmp")
  with temp_beside(tokens_path) as tmp, open(tmp, "xb") as out:
    if show_progress and _terminal() is not None:
      from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
      with Progress(TextColumn("[bold]tokenizing"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("files"), transient=True, console=_terminal()) as bar:
        task = bar.add_task("tokenize", total=len(files))
        report = tokenize_to_file(files, out, tokenizer, lambda _: bar.advance(task))
    else:
      report = tokenize_to_file(files, out, tokenizer)
    out.flush()
    os.fsync(out.fileno())
    out.close()
    report["fingerprint"] = key
    os.replace(tmp, tokens_path)  # the token file first: a report always has its tokens
  with temp_beside(report_path) as tmp:
    with open(tmp, "x", encoding="utf-8") as f:
      json.dump(report, f)
    os.replace(tmp, report_path)
  return tokens_path, report
