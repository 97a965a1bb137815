"""The end-of-training sample of ``train/run.py``: text continued through ``models/generate.py``."""

from __future__ import annotations

from models.generate import generate
from models.transformer import Transformer


def sample_tokens(model: Transformer, prompt: list[int], *, length: int, window: int, seed: int,
                  temperature: float = 0.7) -> list[int]:
  """``length`` sampled token ids after ``prompt``, with the KV-cached decoder.

  The model was trained on ``window`` positions, so its context stays within
  them: once the text fills the window, the last half of it is prefilled again
  as the next prompt and sampling goes on (each stretch has its own seed).
  """
  ids = list(prompt)[-window:] or [ord("\n")]
  out: list[int] = []
  while len(out) < length:
    context = ids if len(ids) < window else ids[-(window // 2):]
    count = min(length - len(out), window - len(context))
    row = generate(model, [context], max_new_tokens=count, temperature=temperature,
                   seed=seed + len(out))[0, len(context):]
    ids += row.tolist()
    out += row.tolist()
  return out
