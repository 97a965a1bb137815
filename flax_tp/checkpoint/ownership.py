"""What in a checkpoint folder is flax_tp's: it never deletes anything else.

A step folder is removed (replaced, rotated out, cleared by ``delete_all``) only as far
as it holds flax_tp's own files; anything else there (a user's file, a numbered folder
that is not a checkpoint, a symbolic link) is named in a refusal instead.
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from flax_tp.checkpoint.legacy import is_legacy

# What flax_tp writes into a step folder; anything else there is the user's.
OWN_FILE = re.compile(r"(meta\.json|index\.[0-9]+\.json|shards\.[0-9]+\.bin)")


# A flax_tp 0.1.0 (orbax) step folder: its items and orbax's metadata files.
_LEGACY_ENTRY = re.compile(r"(state|meta|commit_success\.txt|_[A-Za-z_.]+)")


OWN_FOLDER = re.compile(r"([0-9]+|\.tmp-[0-9]+|\.old-[0-9]+)")


# A step's folder name: ASCII digits without leading zeros, as save writes it.
STEP_NAME = re.compile(r"0|[1-9][0-9]*")


def check_step(step: Any) -> int:
  """``step`` as the int that names its folder; ``ValueError`` naming anything that is
  not a non-negative integer (numpy integers are; ``True``, ``5.0``, ``"08"`` are not)."""
  if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r} "
                     f"({type(step).__name__})")
  return int(step)


def not_ours(folder: Path) -> Path | None:
  """The first thing in step folder ``folder`` that flax_tp did not write (``folder``
  itself when it is a numbered folder that is not a checkpoint); None when all is ours."""
  if folder.is_symlink():
    return folder  # flax_tp writes no links, and never deletes through one
  if not folder.is_dir():
    return folder if folder.exists() else None
  legacy = is_legacy(folder)
  if folder.name.isascii() and folder.name.isdigit() and not legacy and not (
      folder / "meta.json").is_file():
    return folder  # a user's folder that happens to be named like a step
  for entry in sorted(folder.iterdir()):
    if legacy and _LEGACY_ENTRY.fullmatch(entry.name):
      continue
    if not (OWN_FILE.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink()):
      return entry
  return None


def describe_not_ours(path: Path) -> str:
  """``'DIR/12' is not a flax_tp checkpoint ...`` / ``'DIR/2/x' was not written by flax_tp``."""
  if path.is_symlink():
    return f"{str(path)!r} is a symbolic link, which flax_tp did not write"
  what = ("is not a flax_tp checkpoint (no meta.json)" if path.is_dir() and path.name.isdigit()
          else "was not written by flax_tp")
  return f"{str(path)!r} {what}"


def refusal(foreign: Path, action: str) -> str:
  return (f"refusing to {action}: {describe_not_ours(foreign)}; flax_tp never deletes what "
          "it did not write: move it elsewhere, or choose another checkpoint directory")


def rotate_out(folder: Path) -> None:
  """Deletes an old step folder, keeping whatever in it flax_tp did not write."""
  if not_ours(folder) is None:
    shutil.rmtree(folder)
    return
  (folder / "meta.json").unlink(missing_ok=True)  # first: it stops being a checkpoint
  kept = []
  for entry in sorted(folder.iterdir()):
    if OWN_FILE.fullmatch(entry.name) and entry.is_file():
      entry.unlink()
    else:
      kept.append(entry.name)
  warnings.warn(f"checkpoint {str(folder)!r} rotated out; kept {kept} in it, which flax_tp "
                "did not write", stacklevel=2)
