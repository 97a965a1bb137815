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
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.errors import RunError, UsageError, exit_on_interrupt

if __name__ == "__main__":  # before the imports below start JAX: Ctrl-C there is one line
  exit_on_interrupt("train/export.py")

from train.cli import UsageParser, exit_ladder, one_line
from train.devices import provide_mesh_devices

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def build_parser() -> argparse.ArgumentParser:
  p = UsageParser(prog="train/export.py", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--checkpoint", metavar="DIR", required=True,
                 help="a train/run.py --checkpoint-dir")
  p.add_argument("--step", type=int, default=None,
                 help="the checkpoint step to export (default: the latest)")
  p.add_argument("--out", metavar="DIR", required=True, help="the HF folder to write")
  p.add_argument("--mesh", default="1x1", help="DATAxMODEL devices to restore on, e.g. 1x8")
  p.add_argument("--merge", action="store_true",
                 help="a LoRA run: write the base with its adapters merged in (an HF model "
                      "folder) instead of the PEFT adapter")
  return p


def run(args: argparse.Namespace) -> int:
  import flax_tp
  from models.hf import save_hf
  from train.generate import load_from_checkpoint
  try:
    mesh = flax_tp.make_mesh(args.mesh)
  except ValueError as err:
    raise UsageError(str(err)) from None
  args.dtype = None  # the checkpoint's own
  model, _, _ = load_from_checkpoint(args, mesh)
  source = _init_from(Path(args.checkpoint), args.step)
  if model.lora is not None and not args.merge:
    return _export_adapter(model, Path(args.out), source)
  if args.merge:
    if model.lora is None:
      raise UsageError(f"--merge: the run in {args.checkpoint!r} has no LoRA adapters")
    from models.peft import merged
    model = merged(model)
  special = {}
  if source is not None and (source / "config.json").is_file():
    hf = json.loads((source / "config.json").read_text(encoding="utf-8"))
    special = {k: hf.get(k) for k in SPECIAL if k in hf}
  out = Path(args.out)
  held = [n for n in ("config.json", "model.safetensors", "model.safetensors.index.json")
          if (out / n).exists()]
  if held:  # never over another model (say the --init-from folder itself)
    raise UsageError(f"--out {args.out!r} already holds a model ({', '.join(held)}); choose "
                     "a new or empty folder")
  try:
    save_hf(model, out, special_tokens=special)
  except (ValueError, FileExistsError) as err:
    raise UsageError(f"--out {args.out!r}: {err}") from None
  for name in TOKENIZER_FILES:
    if source is not None and (source / name).is_file():
      shutil.copyfile(source / name, out / name)
  print(f"wrote {out} ({model.cfg.family or 'llama/qwen2'} family, "
        f"{sum(1 for _ in out.iterdir())} files)")
  if model.cfg.expert_capacity_factor is not None:  # an HF config has no such field
    print(f"note: trained with expert capacity factor {model.cfg.expert_capacity_factor:g}; "
          "transformers runs the experts dropless")
  return 0


def _export_adapter(model, out: Path, source: Path | None) -> int:
  from models.peft import CONFIG, save_peft_adapter
  if (out / CONFIG).exists():  # never over another adapter
    raise UsageError(f"--out {str(out)!r} already holds an adapter ({CONFIG}); choose a new "
                     "or empty folder")
  if out.exists() and not out.is_dir():
    raise UsageError(f"--out {str(out)!r} is a file, not a folder")
  try:
    modules = save_peft_adapter(model, out, base_model_name_or_path=source and str(source))
  except ValueError as err:
    raise UsageError(f"--out {str(out)!r}: {err}") from None
  print(f"wrote {out} (a PEFT LoRA adapter: rank {model.lora.rank} on {len(modules)} "
        f"modules{'' if source is None else f' of {source}'})")
  return 0


def _init_from(checkpoint: Path, step: int | None) -> Path | None:
  from flax_tp.checkpoint import Checkpointer
  run = Checkpointer(checkpoint).read_meta(step).get("run") or {}
  return Path(run["init_from"]) if run.get("init_from") else None


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
