"""The metrics file: one JSON line per record, each step once across resumes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import jax

from train.tempfiles import remove_stale, temp_beside


def is_main_process() -> bool:
  return jax.process_index() == 0


class MetricsWriter:
  """One JSON line per record, appended (process 0 only).

  On resume from step ``resume_from``, records past it (steps the interrupted
  run did after its last checkpoint, which this run does again) are dropped
  first, so the file holds each step once.
  """

  def __init__(self, path: str | None, resume_from: int | None = None):
    self.file = None
    if not (path and is_main_process()):
      return
    if resume_from is not None and os.path.exists(path):
      _drop_records_after(Path(path), resume_from)
    self.file = open(path, "a", encoding="utf-8")

  def write(self, record: dict[str, Any]) -> None:
    """(A NaN or infinity is written as ``null``: JSON has no such number.)"""
    if self.file:
      self.file.write(json.dumps(_finite_or_null(record), allow_nan=False) + "\n")
      self.file.flush()

  def close(self) -> None:
    if self.file:
      self.file.close()


def _finite_or_null(value: Any) -> Any:
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite_or_null(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_finite_or_null(v) for v in value]
  return value


def _drop_records_after(path: Path, step: int) -> None:
  kept = []
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      record = json.loads(line)
    except ValueError:
      continue  # a line cut short by a kill
    if not (isinstance(record, dict) and isinstance(record.get("step"), int)
            and record["step"] > step):
      kept.append(line)
  # Beside it under a name of flax_tp's own (a user's m.jsonl.tmp stays theirs), removed
  # on every way out, a full disk included.
  remove_stale(path.parent)
  with temp_beside(path) as tmp:
    with open(tmp, "x", encoding="utf-8") as f:
      f.write("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
