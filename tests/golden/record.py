"""Goldens of main before the redesign (issue 25): what no move may change, bit for bit.

    python tests/golden/record.py            # (re)writes tests/golden/main.json
    python tests/golden/record.py --check    # compares, prints each difference
    python tests/golden/record.py --update help   # re-records one structure section
                                                  # after a change meant to move it
    python tests/golden/record.py --update numerics   # after a change meant to round
                                                      # differently (on this CPU kind)

``structure()`` is what the code decides (param paths, the compiled train step's
collectives, ``--help`` of every entry point, the configs' identities): the same on
any machine.
``numerics()`` is what the code computes (a seeded model's ``save_hf`` bytes, the
metrics and checkpoint files of two six-step runs): the same on the same kind of
CPU; XLA:CPU compiles for the host's instruction set, so another CPU may round
differently, and ``machine()`` is recorded beside them to tell the two cases apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("main.json")
ENTRY_POINTS = ("train/run.py", "train/generate.py", "train/launch.py", "train/export.py",
                "bench/run.py",
                "bench/mfu.py", "bench/memory.py", "bench/decode.py", "bench/plan.py",
                "bench/ckptmem.py", "bench/hostmem.py", "bench/plots.py")
STEP_CONFIGS = [(preset, mesh, fsdp) for preset in ("tiny", "llama-tiny")
                for mesh in ("2x4", "4x2", "1x8") for fsdp in (False, True)]
RUN = ["--preset", "llama-tiny", "--mesh", "2x4", "--steps", "6", "--seed", "0"]
RUN_OPTIONS = {"plain": [], "memory": ["--sequence-parallel", "--remat", "block",
                                       "--scan-layers", "--fsdp"]}


def machine() -> dict:
  """What decides XLA:CPU's code: the CPU model and its vector extensions."""
  import jax
  info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
  lines = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
  flags = sorted(f for f in lines.get("flags\t\t", "").split() if f.startswith(("avx", "fma")))
  return {"cpu": lines.get("model name\t", "").strip(), "vector_flags": flags,
          "jax": jax.__version__}


# Flags that change how XLA:CPU emits and optimises a program's code (the tests compile
# with them: tests/conftest.py); results may round differently in the last bit, so the
# numerics run without them, as a user's run does.
CODEGEN_FLAGS = ("--xla_backend_optimization_level", "--xla_llvm_disable_expensive_passes",
                 "--xla_cpu_use_fusion_emitters", "--xla_cpu_parallel_codegen_split_count")


def _env() -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100", NO_COLOR="1", TERM="dumb")
  env.pop("FLAX_TP_TRACEBACK", None)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(CODEGEN_FLAGS)]
  env["XLA_FLAGS"] = " ".join(flags)
  return env


def in_default_codegen(name: str):
  """``name()`` of this module, computed in a child process without ``CODEGEN_FLAGS``
  and with 8 simulated devices (the numerics goldens, from a test process)."""
  env = _env()
  if "xla_force_host_platform_device_count" not in env["XLA_FLAGS"]:
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
  code = (f"import json, sys; sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]; "
          f"import record; print(json.dumps(record.{name}()))")
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=1200)
  if done.returncode:
    raise RuntimeError(f"record.{name}() failed (rc={done.returncode}):\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.splitlines()[-1])


def help_texts() -> dict[str, str]:
  out = {}
  for entry in ENTRY_POINTS:
    done = subprocess.run([sys.executable, entry, "--help"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    out[entry] = f"rc={done.returncode}\n{done.stdout}{done.stderr}"
  return out


def step_tallies() -> dict[str, dict]:
  """``flax_tp.hlo.tally`` of the compiled train step of each (preset, mesh, fsdp)."""
  import jax
  from flax import nnx

  import flax_tp
  from flax_tp.hlo import collectives, tally
  from models.config import TransformerConfig
  from models.execution import Execution
  from models.transformer import Transformer
  from train.step import Trainer, make_optimizer

  out = {}
  for preset, spec, fsdp in STEP_CONFIGS:
    mesh = flax_tp.make_mesh(spec)
    cfg = TransformerConfig.preset(preset)
    trainer = Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0),
                                  execution=Execution(fsdp=fsdp)),
                      make_optimizer(lr=1e-3, steps=3))
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(1), (8, cfg.max_seq_len + 1), 0, cfg.vocab_size),
        trainer.batch_sharding)
    hlo = trainer.train_step.lower(trainer.params, trainer.init_opt_state(trainer.params),
                                   tokens, None).compile().as_text()
    out[f"{preset}@{spec}{'+fsdp' if fsdp else ''}"] = tally(collectives(hlo, mesh))
  return out


def param_paths() -> dict[str, list[str]]:
  from flax import nnx

  import flax_tp
  from models.config import TransformerConfig
  from models.execution import Execution
  from models.transformer import Transformer

  out = {}
  for preset, options in (("tiny", {}), ("llama-tiny", {}), ("llama-tiny", {"scan_layers": True}),
                          ("tiny", {"tie_embeddings": False})):
    scan = options.get("scan_layers", False)
    model = Transformer(TransformerConfig.preset(
        preset, **{k: v for k, v in options.items() if k != "scan_layers"}),
        mesh=flax_tp.make_mesh("2x4"), rngs=nnx.Rngs(0), execution=Execution(scan_layers=scan))
    key = preset + "".join(f"+{k}" for k in options)
    out[key] = [".".join(map(str, path)) + f" {tuple(leaf[...].shape)}"
                for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param))]
  return out


def identities() -> dict[str, dict]:
  """Every preset's and every HF fixture's ``TransformerConfig.identity()``: the keys and
  values a checkpoint records, which a run written before must still match to resume."""
  from models.config import TransformerConfig
  from models.families import config_from_hf

  out = {f"preset:{name}": TransformerConfig.preset(name).identity()
         for name in TransformerConfig.preset_names()}
  for path in sorted((ROOT / "tests" / "fixtures").rglob("config.json")):
    hf = json.loads(path.read_text())
    out[f"hf:{path.relative_to(ROOT)}"] = config_from_hf(hf).identity()
  return out


def structure() -> dict:
  return {"help": help_texts(), "param_paths": param_paths(), "step_tallies": step_tallies(),
          "identities": identities()}


def _sha256(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def save_hf_bytes() -> dict[str, str]:
  from flax import nnx

  import flax_tp
  from models.config import TransformerConfig
  from models.hf import save_hf
  from models.transformer import Transformer

  model = Transformer(TransformerConfig.preset("llama-tiny"), mesh=flax_tp.make_mesh("2x4"),
                      rngs=nnx.Rngs(3))
  with tempfile.TemporaryDirectory() as folder:
    save_hf(model, folder)
    return {p.name: _sha256(p) for p in sorted(Path(folder).iterdir())}


def runs() -> dict[str, dict]:
  """Each run's metrics lines (wall-clock fields dropped) and its checkpoint's file hashes."""
  out = {}
  for name, options in RUN_OPTIONS.items():
    with tempfile.TemporaryDirectory() as folder:
      metrics, ckpt = Path(folder) / "metrics.jsonl", Path(folder) / "ckpt"
      done = subprocess.run(
          [sys.executable, "train/run.py", *RUN, *options, "--metrics-file", str(metrics),
           "--checkpoint-dir", str(ckpt), "--sample-length", "0"],
          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1200)
      if done.returncode:
        raise RuntimeError(f"run {name} failed (rc={done.returncode}):\n{done.stderr[-3000:]}")
      lines = [json.loads(line) for line in metrics.read_text().splitlines()]
      kept = [{k: v for k, v in line.items() if k in ("step", "loss", "grad_norm",
                                                      "eval_loss", "lr")} for line in lines]
      files = {str(p.relative_to(ckpt)): _sha256(p) for p in sorted(ckpt.rglob("*"))
               if p.is_file() and (p.name.startswith(("index.", "shards.")))}
      out[name] = {"metrics": kept, "checkpoint": files}
  return out


def numerics() -> dict:
  return {"machine": machine(), "save_hf": save_hf_bytes(), "runs": runs()}


def differences(want, got, where="") -> list[str]:
  if isinstance(want, dict) and isinstance(got, dict):
    out = []
    for key in sorted(set(want) | set(got)):
      if key not in got:
        out.append(f"{where}/{key}: missing")
      elif key not in want:
        out.append(f"{where}/{key}: new")
      else:
        out.extend(differences(want[key], got[key], f"{where}/{key}"))
    return out
  return [] if want == got else [f"{where}: {want!r:.300} != {got!r:.300}"]


if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  sys.path.insert(0, str(ROOT))
  if "--update" in sys.argv:  # one intended change (e.g. a new preset in --help)
    section = sys.argv[sys.argv.index("--update") + 1]
    # numerics: an intended change of rounding, recorded with this CPU kind beside it
    sections = {"help": help_texts, "identities": identities, "step_tallies": step_tallies,
                "numerics": numerics}
    if section not in sections:
      sys.exit(f"--update: expected one of {tuple(sections)}, got {section!r}")
    golden = json.loads(GOLDEN.read_text())
    where = golden if section == "numerics" else golden["structure"]
    where[section] = sections[section]()
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"re-recorded {section} in {GOLDEN}")
    sys.exit(0)
  got = {"structure": structure(), "numerics": numerics()}
  if "--check" in sys.argv:
    found = differences(json.loads(GOLDEN.read_text()), got)
    print("\n".join(found) or "goldens equal")
    sys.exit(1 if found else 0)
  GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
  print(f"wrote {GOLDEN}")
