#!/usr/bin/env python
"""Generate text with a tensor-parallel model, streaming it as it is produced.

    python train/generate.py --hf DIR --mesh 1x8 --prompt "def main():" --max-new-tokens 64
    python train/generate.py --checkpoint CKPT_DIR --mesh 2x4 --prompt "import " \\
        --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1

``--hf`` reads a HuggingFace folder of a supported family (models/families.py;
config.json, safetensors and its tokenizer.json; the prompt gets the tokenizer's special tokens, as HF's pipeline
gives it). ``--checkpoint`` reads a ``train/run.py`` checkpoint directory (the
latest step, or ``--step``) and its run's tokenizer: bytes for the built-in
presets, the ``--init-from`` folder's tokenizer.json otherwise. The model is
split over the mesh's ``"model"`` axis with a KV cache sharded like its kv
heads (``models/generate.py``). Greedy by default. Bad input exits 2 with one
line on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.errors import RunError, UsageError, exit_on_interrupt, not_utf8

if __name__ == "__main__":  # before the imports below start JAX: Ctrl-C there is one line
  exit_on_interrupt("train/generate.py")

from train.cli import (
    INT_MAX,
    SEED_LIMIT,
    DefaultsHelpFormatter,
    UsageParser,
    exit_ladder,
    one_line,
)
from train.devices import provide_mesh_devices

# The logits are divided by the temperature in float32: below its smallest normal number
# the division overflows to inf (NaN probabilities), above its largest it is inf itself.
FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127


def build_parser() -> argparse.ArgumentParser:
  p = UsageParser(prog="train/generate.py", description=__doc__.split("\n\n")[0],
              formatter_class=DefaultsHelpFormatter)
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--hf", metavar="DIR", help="a HuggingFace model folder (a family of models/families/)")
  source.add_argument("--checkpoint", metavar="DIR", help="a train/run.py --checkpoint-dir")
  p.add_argument("--adapter", metavar="DIR", default=None,
                 help="with --hf: a PEFT LoRA adapter folder to apply to it")
  p.add_argument("--step", type=int, default=None,
                 help="the checkpoint step to load (default: the latest)")
  p.add_argument("--mesh", default="1x1", help="DxM or DxCxM devices, or named sizes "
                 "(data=1,context=2,model=4), e.g. 1x8")
  p.add_argument("--prompt", default="def ", help="the text to continue")
  p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="sampling temperature; 0 is greedy")
  p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
  p.add_argument("--top-p", type=float, default=None,
                 help="sample within the smallest set of tokens holding this probability")
  p.add_argument("--seed", type=int, default=0, help="seed of the sampling noise")
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                 help="compute dtype (default: the model's)")
  return p


def check_args(args: argparse.Namespace) -> None:
  if not 1 <= args.max_new_tokens <= INT_MAX:
    raise UsageError(f"--max-new-tokens must be an integer in [1, {INT_MAX}], got "
                     f"{args.max_new_tokens}")
  t = args.temperature
  if not (math.isfinite(t) and (t == 0 or FLOAT32_TINY <= t <= FLOAT32_MAX)):
    raise UsageError(f"--temperature must be 0 (greedy) or a number in [{FLOAT32_TINY:.4g}, "
                     f"{FLOAT32_MAX:.4g}] (float32's normal range), got {t}")
  if args.top_k is not None and not 1 <= args.top_k <= INT_MAX:
    raise UsageError(f"--top-k must be an integer in [1, {INT_MAX}], got {args.top_k}")
  if args.top_p is not None and not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
    raise UsageError(f"--top-p must be a number in (0, 1], got {args.top_p}")
  if not 0 <= args.seed < SEED_LIMIT:
    raise UsageError(f"--seed must be an integer in [0, 2**32), got {args.seed}")
  if args.step is not None and args.hf:
    raise UsageError("--step needs --checkpoint (an HF folder holds one model)")
  if args.adapter is not None and not args.hf:
    raise UsageError("--adapter needs --hf (a LoRA run's checkpoint holds its own adapters)")
  if not args.prompt:
    raise UsageError("--prompt is empty: give at least one character to continue")
  if not_utf8(args.prompt):
    raise UsageError(f"--prompt: {not_utf8(args.prompt)}")
  folder = Path(args.hf or args.checkpoint)
  if not folder.is_dir():
    raise UsageError(f"{'--hf' if args.hf else '--checkpoint'} {str(folder)!r} is not a folder")
  if args.hf and not (folder / "config.json").is_file():
    raise UsageError(f"--hf {args.hf!r} is not a HuggingFace model folder (no config.json)")


def load_from_hf(args, mesh):
  """(model, tokenizer, eos ids) of an HF folder."""
  from models.hf import HFConfigError, load_hf
  from train.hf_folder import eos_ids, hf_model_and_tokenizer
  from train.run_model import decoding
  overrides = {"dtype": args.dtype} if args.dtype else {}
  try:
    _, tokenizer = hf_model_and_tokenizer(args.hf, overrides, flag="--hf")
    if args.adapter is None:
      model = load_hf(args.hf, mesh, execution=decoding(), **overrides)
  except (HFConfigError, ValueError, OSError) as err:
    raise UsageError(f"--hf {args.hf!r}: {err}") from None
  if args.adapter is not None:
    from models.peft import load_peft_adapter
    try:
      model = load_peft_adapter(args.hf, args.adapter, mesh, **overrides)
    except (ValueError, OSError) as err:
      raise UsageError(f"--adapter {args.adapter!r}: {err}") from None
  return model, tokenizer, eos_ids(Path(args.hf))


def load_from_checkpoint(args, mesh):
  """(model, tokenizer, eos ids) of a train/run.py checkpoint directory
  (``train.run_model.checkpoint_model``)."""
  from train.run_model import checkpoint_model
  return checkpoint_model(args.checkpoint, args.step, mesh, dtype=args.dtype)


class TextStream:
  """Prints the continuation as tokens arrive, whole characters only."""

  def __init__(self, tokenizer, out=None):
    self.tokenizer, self.out = tokenizer, out or sys.stdout
    self.ids: list[int] = []
    self.printed = ""

  def add(self, token: int) -> None:
    self.ids.append(token)
    text = self.tokenizer.decode(self.ids)
    # An incomplete multi-byte character decodes to U+FFFD: wait for its rest.
    stable = text.rstrip("\ufffd")
    if stable.startswith(self.printed) and len(stable) > len(self.printed):
      self.out.write(stable[len(self.printed):])
      self.out.flush()
      self.printed = stable

  def finish(self) -> None:
    text = self.tokenizer.decode(self.ids)
    if text.startswith(self.printed):
      self.out.write(text[len(self.printed):])
    self.out.write("\n")
    self.out.flush()


def run(args: argparse.Namespace) -> int:
  import numpy as np

  import flax_tp
  from models.generate import stream
  try:
    mesh = flax_tp.make_mesh(args.mesh)
  except ValueError as err:
    raise UsageError(str(err)) from None
  started = time.perf_counter()
  model, tokenizer, eos = (load_from_hf if args.hf else load_from_checkpoint)(args, mesh)
  prompt = tokenizer.encode(args.prompt.encode(), special_tokens=True)
  prompt = np.asarray(prompt, np.int32)[None]
  longest = prompt.shape[1] + args.max_new_tokens
  if longest > model.cfg.max_seq_len:
    raise UsageError(f"the prompt's {prompt.shape[1]} tokens plus --max-new-tokens "
                     f"{args.max_new_tokens} need {longest} positions; the model has "
                     f"{model.cfg.max_seq_len} (max_seq_len)")
  loaded = time.perf_counter()
  sys.stdout.write(args.prompt)
  sys.stdout.flush()
  text = TextStream(tokenizer)
  times = []
  for token in stream(model, prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, eos_id=eos or None):
    times.append(time.perf_counter())
    if eos and int(token[0]) in eos:
      break
    text.add(int(token[0]))
  text.finish()
  decode = (f", then {(len(times) - 1) / (times[-1] - times[0]):,.1f} tokens/s"
            if len(times) > 1 else "")
  print(f"{len(times)} tokens on mesh {args.mesh}: loaded in {loaded - started:.1f} s, first "
        f"token after {times[0] - loaded:.2f} s (compiling included){decode}", file=sys.stderr)
  return 0


def main(argv: list[str] | None = None) -> int:
  return exit_ladder("train/generate.py", lambda: _main(argv), interrupted="\n")


def _main(argv: list[str] | None) -> int:
  args = build_parser().parse_args(argv)
  check_args(args)
  provide_mesh_devices(args.mesh)
  try:
    return run(args)
  except (UsageError, RunError):
    raise
  except Exception as err:
    raise RunError(one_line(err)) from err


if __name__ == "__main__":
  sys.exit(main())
