"""train/data.py: text streamed, binaries sniffed, no size cap, the token cache."""

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
from helpers import SHORT_RUN_FLAGS, subprocess_env, wait_for

from train.data import TokenCorpus
from train.run import main


def test_data_is_streamed_sniffed_uncapped_and_cached(tmp_path):
  folder = tmp_path / "data"
  folder.mkdir()
  big = b"print('hello')\n" * (18 * 2**20 // 15)  # > the 16 MiB the old reader cut at
  (folder / "big.py").write_bytes(big)
  with open(folder / "huge.bin", "wb") as f:  # 2 GiB, sparse: binary from its first byte
    f.write(b"\0" * 16)
    f.truncate(2 * 2**30)
  cache = tmp_path / "cache"
  tracemalloc.start()
  corpus = TokenCorpus.load(str(folder), seq_len=16, cache=cache)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert peak < 64 * 2**20  # neither file was read whole
  assert len(corpus.train) + len(corpus.eval) == len(big)
  assert isinstance(corpus.tokens, np.memmap)
  assert "1 binary file(s)" in corpus.describe() and f"{len(big):,} tokens" in corpus.describe()
  built = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
  again = TokenCorpus.load(str(folder), seq_len=16, cache=cache)  # from the cache
  assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == built
  assert again.fingerprint == corpus.fingerprint
  (folder / "more.py").write_text("x = 1\n" * 100)  # a new source: a new token file
  assert TokenCorpus.load(str(folder), seq_len=16, cache=cache).fingerprint != corpus.fingerprint


def test_a_binary_file_alone_is_named_as_such(tmp_path):
  (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 1000)
  with pytest.raises(ValueError, match=r"has no text: 1 binary file\(s\)"):
    TokenCorpus.load(str(tmp_path / "blob.bin"), seq_len=16, cache=tmp_path / "cache")


def test_a_token_cache_of_another_version_is_rebuilt(tmp_path):
  """A report missing a field (written by an older flax_tp) is a cache miss, not a crash."""
  source = tmp_path / "a.py"
  source.write_text("x = 1\n" * 50)
  cache = tmp_path / "cache"
  corpus = TokenCorpus.load(str(source), seq_len=8, cache=cache)
  (report,) = cache.glob("tokens-*.json")
  old = json.loads(report.read_text())
  del old["token_counts"]
  report.write_text(json.dumps(old))
  again = TokenCorpus.load(str(source), seq_len=8, cache=cache)
  assert again.unigram_entropy() == corpus.unigram_entropy()
  assert "token_counts" in json.loads(report.read_text())


TOKENIZE = """
import sys, time
from pathlib import Path
from train.errors import exit_on_interrupt
exit_on_interrupt("tokenize")
from train import data

class Slow(data.ByteTokenizer):
  def encode(self, b, special_tokens=False):
    time.sleep(0.02)
    return super().encode(b)

data.CHUNK_BYTES = 4096
files = sorted(Path(sys.argv[1]).glob("*.py"))
data._cached_tokens(files, "k" * 40, Slow(), Path(sys.argv[2]), False)
print("finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_tokenizing_leaves_no_partial_token_file(tmp_path, signum):
  """Ctrl-C or SIGTERM during start-up ends the process with os._exit (no traceback), which
  runs no finally: the token file being written is removed first. The next run clears
  what a kill -9 left (a dead process's file, and the old naming's once stale), and only
  that."""
  source, cache = tmp_path / "src", tmp_path / "cache"
  source.mkdir()
  for i in range(40):
    (source / f"f{i}.py").write_text(f"x = {i}\n" * 3000)
  proc = subprocess.Popen([sys.executable, "-c", TOKENIZE, str(source), str(cache)],
                          env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    wait_for(lambda: cache.is_dir() and any(cache.glob(".tokens-*.tmp")),
              what="the partial token file")
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signum and "finished" not in out
  assert err == "tokenize: interrupted\n", err
  assert list(cache.iterdir()) == []

  from train.data import ByteTokenizer, _cached_tokens
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  import socket
  host = socket.gethostname()
  left = cache / f".tokens-abc.bin.flax_tp-{host}-{dead.stdout.strip()}.tmp"
  old = cache / ".tokens-x1y2.tmp"  # the naming before: no pid, stale after an hour
  recent = cache / ".tokens-z3w4.tmp"
  other_host = cache / f".tokens-abc.bin.flax_tp-elsewhere-{os.getpid()}.tmp"
  for path in (left, old, recent, other_host):
    path.write_bytes(b"partial")
  os.utime(old, (time.time() - 7200, time.time() - 7200))
  _cached_tokens([source / "f0.py"], "q" * 40, ByteTokenizer(), cache, False)
  assert not left.exists() and not old.exists()
  assert recent.exists() and other_host.exists()


def test_a_line_longer_than_a_chunk_is_cut_where_the_tokens_do_not_change(tmp_path,
                                                                          monkeypatch):
  """A line longer than the 1 MiB read chunk (4 KiB here) is cut before a space, so a
  byte-level BPE gives the whole file's tokens; without spaces it is cut between
  characters, never inside one (which inserted U+FFFD: 12 extra tokens in a 3.2 MB line)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  from train import data
  line = ("Grüße, café — naïve Ω≈ç√∫ 日本語のテキスト, and more words; " * 800).rstrip()
  unbroken = "日本語のテキストé" * 2000  # no whitespace at all
  raw = Tokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  raw.train_from_iterator([line[:5000], unbroken[:2000]], trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  raw.save(str(tmp_path / "tokenizer.json"))
  tokenizer = data.HFTokenizer(tmp_path / "tokenizer.json")
  monkeypatch.setattr(data, "CHUNK_BYTES", 4096)
  for text, exact in ((line, True), (unbroken, False)):
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    with open(tmp_path / "ids.bin", "wb") as out:
      data.tokenize_to_file([tmp_path / "t.txt"], out, tokenizer)
    ids = np.fromfile(tmp_path / "ids.bin", tokenizer.dtype)
    assert "\ufffd" not in tokenizer.decode(ids)
    assert tokenizer.decode(ids) == text
    if exact:
      np.testing.assert_array_equal(ids, tokenizer.encode(text.encode()))


def test_a_binary_file_named_with_a_newline_is_one_line(tmp_path, capsys):
  folder = tmp_path / "data"
  folder.mkdir()
  (folder / "bad\nname.txt").write_bytes(b"\0\1\2" * 100)
  assert main([*SHORT_RUN_FLAGS, "--data", str(folder)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "'" in err and "bad\\nname.txt" in err, err
