#!/usr/bin/env python
"""Export a train/run.py checkpoint as a HuggingFace model folder.

    python train/export.py --checkpoint runs/ft --out exported/   # the latest step
    python train/export.py --checkpoint runs/ft --step 200 --out exported/

Writes ``config.json`` and ``model.safetensors`` in the family the run's model came from
(``models.hf.save_hf``: a Mixtral's experts one tensor each, as ``save_pretrained``
writes them), so ``transformers.AutoModelForCausalLM.from_pretrained(out)`` reads it. A run
started ``--init-from`` a folder also gets that folder's tokenizer files and its special
token ids. A LoRA run (``--lora-rank``) writes its adapters as a PEFT folder
(``adapter_config.json``, ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained(base, out)`` reads, or with ``--merge`` the base with
the adapters merged in, as an HF model folder. Bad input exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.errors import RunError, UsageError, exit_on_interrupt

if __name__ == "__main__":  # before the imports below start JAX: Ctrl-C there is one line
  exit_on_interrupt("train/export.py")

from train.cli import DefaultsHelpFormatter, UsageParser, exit_ladder, one_line
from train.devices import provide_mesh_devices

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def build_parser() -> argparse.ArgumentParser:
  p = UsageParser(prog="train/export.py", description=__doc__.split("\n\n")[0],
                  formatter_class=DefaultsHelpFormatter)
  p.add_argument("--checkpoint", metavar="DIR", required=True,
                 help="a train/run.py --checkpoint-dir")
  p.add_argument("--step", type=int, default=None,
                 help="the checkpoint step to export (default: the latest)")
  p.add_argument("--out", metavar="DIR", required=True, help="the HF folder to write")
  p.add_argument("--mesh", default="1x1", help="DxM or DxCxM devices to restore on, "
                 "or named sizes (data=1,model=8), e.g. 1x8")
  p.add_argument("--merge", action="store_true",
                 help="a LoRA run: write the base with its adapters merged in (an HF model "
                      "folder) instead of the PEFT adapter")
  return p


# What an export writes, and what must not be in the folder beside it: a model folder
# holding an adapter is read by transformers as base plus adapter, and a folder holding a
# model that gets an adapter becomes that too, so neither kind goes where the other is.
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def run(args: argparse.Namespace) -> int:
  import flax_tp
  from train.run_model import checkpoint_model
  try:
    mesh = flax_tp.make_mesh(args.mesh)
  except ValueError as err:
    raise UsageError(str(err)) from None
  record = _run_record(Path(args.checkpoint), args.step)
  source = Path(record["init_from"]) if record.get("init_from") else None
  adapter = bool(record.get("lora")) and not args.merge
  if args.merge and not record.get("lora"):
    raise UsageError(f"--merge: the run in {args.checkpoint!r} has no LoRA adapters")
  copied = [n for n in TOKENIZER_FILES if source is not None and (source / n).is_file()]
  out = Path(args.out)
  check_out(args.out, ADAPTER_FILES if adapter else MODEL_FILES + tuple(copied))
  model, _, _ = checkpoint_model(args.checkpoint, args.step, mesh)  # (its own dtype)
  if adapter:
    return _export_adapter(model, out, source)
  if args.merge:
    from models.peft import merged
    model = merged(model)
  return _export_model(model, out, source, copied)


def check_out(flag_value: str, writes: tuple[str, ...]) -> None:
  """Refuses (``UsageError``, one line) an ``--out`` that cannot be written, or that holds
  a file the export would write or a model or adapter it would mix with: nothing of a
  user's is replaced, and no folder ends up holding two models."""
  out = Path(flag_value)
  if out.is_symlink() and not out.exists():
    raise UsageError(f"--out {flag_value!r} is a symbolic link to {os.readlink(out)!r}, "
                     "which does not exist")
  if out.exists() and not out.is_dir():
    raise UsageError(f"--out {flag_value!r} is a file, not a folder")
  if out.is_dir():
    held = [n for n in dict.fromkeys(writes + MODEL_FILES + ADAPTER_FILES)
            if os.path.lexists(out / n)]
    if held:
      what = ("an adapter" if set(held) <= set(ADAPTER_FILES) else
              "a model" if set(held) & set(MODEL_FILES) else "files")
      raise UsageError(f"--out {flag_value!r} already holds {what} ({', '.join(held)}) that "
                       "this export would write or mix with; choose a new or empty folder")
  ancestor = out
  while not ancestor.exists():  # the folder is made on writing: its nearest existing parent
    ancestor = ancestor.parent
  if not ancestor.is_dir():
    raise UsageError(f"--out {flag_value!r} cannot be made: {str(ancestor)!r} is a file")
  if not os.access(ancestor, os.W_OK | os.X_OK):
    raise UsageError(f"--out {flag_value!r} cannot be written: {str(ancestor)!r} is not "
                     "writable")


def _export_model(model, out: Path, source: Path | None, copied: list[str]) -> int:
  from models.hf import save_hf
  base_config = None
  if source is not None and (source / "config.json").is_file():
    base_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
  special = {k: base_config.get(k) for k in SPECIAL if k in (base_config or {})}
  try:
    save_hf(model, out, special_tokens=special, base_config=base_config)
    for name in copied:
      shutil.copyfile(source / name, out / name)
  except (ValueError, FileExistsError) as err:
    raise UsageError(f"--out {str(out)!r}: {err}") from None
  except OSError as err:
    raise UsageError(f"--out {str(out)!r} cannot be written: {err.strerror or err}") from None
  print(f"wrote {out} ({model.cfg.family or 'llama/qwen2'} family, "
        f"{sum(1 for _ in out.iterdir())} files)")
  if model.cfg.expert_capacity_factor is not None:  # an HF config has no such field
    print(f"note: trained with expert capacity factor {model.cfg.expert_capacity_factor:g}; "
          "transformers runs the experts dropless")
  return 0


def _export_adapter(model, out: Path, source: Path | None) -> int:
  from models.peft import save_peft_adapter
  try:
    modules = save_peft_adapter(model, out, base_model_name_or_path=source and str(source))
  except ValueError as err:
    raise UsageError(f"--out {str(out)!r}: {err}") from None
  except OSError as err:
    raise UsageError(f"--out {str(out)!r} cannot be written: {err.strerror or err}") from None
  print(f"wrote {out} (a PEFT LoRA adapter: rank {model.lora.rank} on {len(modules)} "
        f"modules{'' if source is None else f' of {source}'})")
  return 0


def _run_record(checkpoint: Path, step: int | None) -> dict:
  """The run record of the checkpoint ``--checkpoint`` (``--step``) names."""
  from flax_tp.checkpoint import Checkpointer, CheckpointError
  try:
    return Checkpointer(checkpoint).read_meta(step).get("run") or {}
  except CheckpointError as err:
    raise UsageError(f"--checkpoint: {err}") from None


def main(argv: list[str] | None = None) -> int:
  return exit_ladder("train/export.py", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
  args = build_parser().parse_args(argv)
  if args.step is not None and args.step < 0:
    raise UsageError(f"--step must be >= 0, got {args.step}")
  provide_mesh_devices(args.mesh)
  try:
    return run(args)
  except (UsageError, RunError):
    raise
  except Exception as err:
    raise RunError(one_line(err)) from err


if __name__ == "__main__":
  sys.exit(main())
