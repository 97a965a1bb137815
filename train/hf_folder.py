"""An HF model folder as the CLIs take it (``--init-from``, ``--hf``): its config and its
tokenizer, each problem a ``UsageError`` naming the flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.hf import HFConfigError, read_config
from train.data import HFTokenizer
from train.errors import UsageError


def hf_model_and_tokenizer(folder: str, overrides: dict[str, Any], flag: str = "--init-from"):
  """The config and tokenizer of an HF folder (UsageError naming ``flag`` and what is wrong)."""
  try:
    cfg = read_config(folder, **overrides)
  except (HFConfigError, ValueError, KeyError, OSError) as err:
    raise UsageError(f"{flag} {folder!r}: {err}") from None
  path = Path(folder) / "tokenizer.json"
  if not path.is_file():
    raise UsageError(f"{flag} {folder!r} has no tokenizer.json: the text cannot be "
                     "turned into this model's tokens")
  try:
    tokenizer = HFTokenizer(path)
  except Exception as err:  # tokenizers raises its own exception types
    raise UsageError(f"{flag} {folder!r}: cannot read tokenizer.json: {err}") from None
  if tokenizer.vocab_size > cfg.vocab_size:
    raise UsageError(f"{flag} {folder!r}: tokenizer.json has {tokenizer.vocab_size} "
                     f"tokens, more than the model's vocab_size {cfg.vocab_size}")
  return cfg, tokenizer


def eos_ids(folder: Path) -> list[int]:
  """The end-of-text ids of an HF folder (generation_config.json, else config.json)."""
  for name in ("generation_config.json", "config.json"):
    path = folder / name
    if path.is_file():
      eos = json.loads(path.read_text()).get("eos_token_id")
      if eos is not None:
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
  return []
