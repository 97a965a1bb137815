"""train/data.py: text streamed, binaries sniffed, no size cap, the token cache."""

import json
import tracemalloc

import numpy as np
import pytest

from train.data import TokenCorpus


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
