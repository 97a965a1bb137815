"""train/metrics.py: the metrics file keeps a user's files beside it and survives a full disk."""

import errno
import json

import pytest


def test_a_users_file_beside_the_metrics_file_stays_and_a_full_disk_leaves_nothing(
    tmp_path, monkeypatch):
  """--resume rewrites the metrics file (dropping the records past the checkpoint) through
  a temporary name of flax_tp's own: the user's m.jsonl.tmp keeps its bytes; a failing
  write leaves the file as it was, and no temporary file."""
  from train import metrics as metrics_file
  metrics, theirs = tmp_path / "m.jsonl", tmp_path / "m.jsonl.tmp"
  theirs.write_text("my notes\n")
  metrics.write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(4)))
  metrics_file.MetricsWriter(str(metrics), resume_from=1).close()
  assert theirs.read_text() == "my notes\n"
  assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1]
  before = metrics.read_bytes()

  def full(*_):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(metrics_file.os, "replace", full)
  with pytest.raises(OSError, match="No space left"):
    metrics_file._drop_records_after(metrics, 0)
  assert metrics.read_bytes() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl", "m.jsonl.tmp"]
