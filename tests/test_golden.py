"""Today's behaviour, bit for bit, against goldens recorded before the redesign (issue 25).

What the code decides (param paths, the compiled train step's collectives, every entry
point's ``--help``) must equal the goldens on any machine. What it computes (``save_hf``
bytes, two runs' metrics and checkpoint files) must equal them bit for bit on the kind of
CPU that recorded them; XLA:CPU compiles for the host's instruction set, so on another
kind the comparison is skipped, saying which. ``python tests/golden/record.py`` rewrites
the goldens: only for a change that means to change behaviour, said in its commit.
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import record

GOLDEN = json.loads(record.GOLDEN.read_text())


def _same_machine():
  if record.machine() != GOLDEN["numerics"]["machine"]:
    pytest.skip(f"goldens recorded on {GOLDEN['numerics']['machine']}, this is "
                f"{record.machine()}: bitwise numerics compare only on the same CPU kind")


def _equal(name, want, got):
  found = record.differences(want, got, name)
  assert not found, "\n".join(found)


def test_param_paths():
  _equal("param_paths", GOLDEN["structure"]["param_paths"], record.param_paths())


def test_config_identities():
  """Nesting TransformerConfig's fields into records (issue 38) left every identity a
  checkpoint records as it was: recorded by the flat dataclass before the change."""
  _equal("identities", GOLDEN["structure"]["identities"], record.identities())


def test_save_hf_bytes():
  _same_machine()
  # In a child process: this one compiles with the tests' fast-compile flags.
  _equal("save_hf", GOLDEN["numerics"]["save_hf"], record.in_default_codegen("save_hf_bytes"))


@pytest.mark.slow
def test_compiled_step_collectives():
  _equal("step_tallies", GOLDEN["structure"]["step_tallies"], record.step_tallies())


@pytest.mark.slow
def test_help_of_every_entry_point():
  _equal("help", GOLDEN["structure"]["help"], record.help_texts())


@pytest.mark.slow
def test_runs_metrics_and_checkpoints():
  _same_machine()
  _equal("runs", GOLDEN["numerics"]["runs"], record.runs())
