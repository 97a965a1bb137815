"""train/export.py and train/generate.py on a run as a new user makes one: a LoRA fine-tune
of an HF mixture-of-experts folder with an expert capacity. The same run's model is
rebuilt for resume, export and generate alike; nothing in ``--out`` is replaced; an
export keeps its base's context length; bad ``--out`` values are one line, exit 2."""

import json
import os

import pytest
from helpers import fine_tune_folder

from train import export, generate
from train.run import main


@pytest.mark.slow
def test_a_lora_moe_run_exports_and_generates_and_nothing_is_replaced(tmp_path, capsys):
  _, base, flags = fine_tune_folder(tmp_path, "qwen2_moe")
  base_context = json.loads((base / "config.json").read_text())["max_position_embeddings"]
  assert base_context == 32  # the run trains on 16
  ck = tmp_path / "ck"
  run = [*flags, "--mesh", "1x2", "--steps", "2", "--lora-rank", "4",
         "--expert-capacity-factor", "1.0", "--checkpoint-dir", str(ck), "--sample-length", "0"]
  assert main(run) == 0
  started = capsys.readouterr().out
  assert "per expert), full experts keep the largest weights" in started
  # The same layers by other globs, in another order: the same run, resumed.
  assert main([*run, "--steps", "3", "--resume",
               "--lora-targets", "blocks.*.attn.v,blocks.*.attn.q"]) == 0
  assert "resumed from step 2" in capsys.readouterr().out

  def refused(argv, message):
    assert export.main(["--checkpoint", str(ck), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err

  # An adapter never goes into a model folder (transformers would read base + adapter).
  before = {p.name: p.read_bytes() for p in base.iterdir()}
  refused(["--out", str(base)], "already holds a model (config.json")
  assert {p.name: p.read_bytes() for p in base.iterdir()} == before
  lone = tmp_path / "lone"
  lone.mkdir()
  (lone / "adapter_model.safetensors").write_bytes(b"the user's")
  refused(["--out", str(lone)], "already holds an adapter (adapter_model.safetensors)")
  assert (lone / "adapter_model.safetensors").read_bytes() == b"the user's"
  os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
  refused(["--out", str(tmp_path / "dangling")], "is a symbolic link to")
  refused(["--out", str(tmp_path / "lone" / "adapter_model.safetensors" / "x")], "is a file")

  # The run's capacity is part of the model it rebuilds: export and generate work.
  assert export.main(["--checkpoint", str(ck), "--out", str(tmp_path / "adapter")]) == 0
  assert (tmp_path / "adapter" / "adapter_config.json").is_file()
  capsys.readouterr()
  assert generate.main(["--checkpoint", str(ck), "--mesh", "1x2", "--prompt", "def",
                        "--max-new-tokens", "2"]) == 0
  capsys.readouterr()
  # Generating from the checkpoint takes the base's context too, not the run's --seq-len.
  assert generate.main(["--checkpoint", str(ck), "--mesh", "1x2", "--prompt", "def",
                        "--max-new-tokens", "20"]) == 0  # past 16 positions
  capsys.readouterr()

  # --merge: a user's tokenizer.json in --out is not replaced; the export keeps the
  # base's context (32 positions), not the run's --seq-len.
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "tokenizer.json").write_text("the user's")
  refused(["--out", str(mine), "--merge"], "already holds files (tokenizer.json)")
  assert (mine / "tokenizer.json").read_text() == "the user's"
  merged = tmp_path / "merged"
  assert export.main(["--checkpoint", str(ck), "--out", str(merged), "--merge"]) == 0
  written = json.loads((merged / "config.json").read_text())
  assert written["max_position_embeddings"] == base_context
  refused(["--out", str(merged)], "already holds a model")  # the adapter next to it: no
  capsys.readouterr()
  assert generate.main(["--hf", str(merged), "--mesh", "1x2", "--prompt", "def",
                        "--max-new-tokens", "20"]) == 0  # past 16 positions


@pytest.mark.slow
def test_a_model_mixing_dense_and_expert_layers_decodes_and_exports_on_a_stage_mesh(
    tmp_path, capsys):
  """deepseek-v3-tiny (a dense first layer, then experts) trains on 2x4; no pipeline holds
  its layers, but generate and export run them one by one, so --mesh stage=2,model=2
  works for both, and exports what 1x2 exports, byte for byte."""
  from helpers import write_small_corpus
  corpus = write_small_corpus(tmp_path / "corpus.py", files=5)
  ck = tmp_path / "ck"
  assert main(["--preset", "deepseek-v3-tiny", "--mesh", "2x4", "--steps", "2", "--batch-size",
               "8", "--seq-len", "16", "--eval-every", "0", "--sample-length", "0", "--data",
               corpus, "--checkpoint-dir", str(ck)]) == 0
  assert generate.main(["--checkpoint", str(ck), "--mesh", "stage=2,model=2", "--prompt",
                        "def", "--max-new-tokens", "4"]) == 0
  for mesh in ("stage=2,model=2", "1x2"):
    assert export.main(["--checkpoint", str(ck), "--mesh", mesh, "--out",
                        str(tmp_path / mesh)]) == 0
  capsys.readouterr()
  assert ((tmp_path / "1x2" / "model.safetensors").read_bytes()
          == (tmp_path / "stage=2,model=2" / "model.safetensors").read_bytes())
