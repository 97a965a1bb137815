"""Shared test tools: run a module on local shards, compare with Flax, check padding."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_tp

F32 = dict(rtol=1e-6, atol=1e-6)
# train/run.py flags of a quick run of the tiny preset (the tests add mesh, data, steps).
TINY_RUN_FLAGS = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "16", "--eval-every",
                  "0", "--sample-length", "0", "--lr", "1e-2", "--warmup-steps", "1"]


def inside_shard_map(module, fn, mesh, *inputs, in_specs=None, out_specs=P()):
  """Value and param-gradient of ``fn(module, *inputs)`` run inside one shard_map.

  ``fn`` returns a scalar that is the same on every device; inputs are replicated
  unless ``in_specs`` says otherwise. Returns (value, grads as a global state).
  """
  graphdef, state = nnx.split(module, nnx.Param)
  specs = nnx.get_partition_spec(state)

  def local(state, *xs):
    def loss(state):
      return fn(nnx.merge(graphdef, state), *xs)
    return jax.value_and_grad(loss)(state)

  in_specs = tuple(in_specs) if in_specs is not None else (P(),) * len(inputs)
  mapped = jax.shard_map(local, mesh=mesh, in_specs=(specs, *in_specs),
                         out_specs=(out_specs, specs))
  return jax.jit(mapped)(state, *inputs)


_TX = optax.adamw(0.1, weight_decay=0.1)


@jax.jit
def _adamw(params, grads):
  updates, _ = _TX.update(grads, _TX.init(params), params)
  return optax.apply_updates(params, updates)


def adamw_step(module, grads):
  """One adamw step applied to ``module`` in place (global arrays, outside any map)."""
  nnx.update(module, _adamw(nnx.state(module, nnx.Param), grads))


@functools.partial(nnx.jit, static_argnums=0)
def forward_and_grads(fn, module, x):
  """``fn(module, x)``, ``module(x)`` and the gradients of ``fn`` w.r.t. module and x."""
  (value, grads) = nnx.value_and_grad(fn, argnums=(0, 1))(module, x)
  return value, module(x), grads


def assert_state_close(parallel_state, flax_state, **tol):
  """Unshards ``parallel_state`` and compares it leaf by leaf with a Flax state."""
  mine = nnx.to_flat_state(flax_tp.unshard(parallel_state))
  ref = nnx.to_flat_state(nnx.state(flax_state, nnx.Param)
                          if isinstance(flax_state, nnx.Module) else flax_state)
  assert [p for p, _ in mine] == [p for p, _ in ref]
  for (path, a), (_, b) in zip(mine, ref, strict=True):
    np.testing.assert_allclose(np.asarray(a[...], np.float32), np.asarray(b[...], np.float32),
                               err_msg=str(path), **(tol or F32))


def assert_adamw_steps_close(params, ref_params, ref_first_grads, *, lr, steps,
                             rtol=1e-5, atol=1e-5, noise=1e-4):
  """``params`` after ``steps`` AdamW steps against the reference's, leaf by leaf.

  AdamW divides each update by the root of its second moment, so an element whose
  gradient is at rounding level moves by up to ~lr a step whatever the gradient's size:
  float rounding alone can turn such an update around. Those elements (the first
  gradient below ``noise`` times its param's largest) are held to ``2 * lr * steps``, and
  must be a small share (under 1%), so the comparison keeps its power; every other
  element to ``rtol`` / ``atol``."""
  mine = nnx.to_flat_state(flax_tp.unshard(params))
  ref = dict(nnx.to_flat_state(ref_params))
  grads = dict(nnx.to_flat_state(ref_first_grads))
  loose_count = total = 0
  for path, var in mine:
    a = np.asarray(var[...], np.float32)
    b = np.asarray(ref[path][...], np.float32)
    g = np.abs(np.asarray(grads[path][...], np.float32))
    loose = g <= noise * g.max() if g.max() > 0 else np.ones_like(g, bool)
    loose_count, total = loose_count + int(loose.sum()), total + g.size
    allowed = atol + rtol * np.abs(b) + np.where(loose, 2 * lr * steps, 0.0)
    bad = np.abs(a - b) > allowed
    assert not bad.any(), (f"{path}: {int(bad.sum())} element(s) off, worst "
                           f"{np.max(np.abs(a - b)[bad]):.3g}")
  assert loose_count < 0.01 * total, f"{loose_count} of {total} gradients at rounding level"


def assert_padding_zero(module_or_state):
  """Every stored padding element of every sharded param is exactly zero (on the dim split
  over "model", and a mixture of experts' experts over "data"); returns how many padded
  dims were checked."""
  from flax_tp.param_info import ParamInfo
  state = (nnx.state(module_or_state, nnx.Param) if isinstance(module_or_state, nnx.Module)
           else module_or_state)
  checked = 0
  for path, var in nnx.to_flat_state(state):
    info = ParamInfo.of(var)
    for layout, dim in ((split.layout, split.dim) for split in info.padded):
      if layout.is_even:
        continue
      stored = np.asarray(var[...])
      pad = np.take(stored, np.flatnonzero(~layout.valid_mask()), axis=dim)
      assert pad.size and not np.any(pad), f"padding of {path} (dim {dim}) is not zero"
      checked += 1
  return checked


def random(shape, seed=1, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def write_small_corpus(path, files=40, max_bytes=200_000):
  """A small text file made of the first standard-library modules: quick, real Python."""
  from train.data import stdlib_sources
  data = b"\n\n".join(p.read_bytes() for p in stdlib_sources()[:files])[:max_bytes]
  path.write_bytes(data)
  return str(path)


def split_execution(options: dict) -> tuple[dict, object]:
  """``options`` mixing architecture fields and execution fields -> (the architecture
  fields, a ``models.execution.Execution`` of the others)."""
  import dataclasses

  from models.execution import Execution
  names = {f.name for f in dataclasses.fields(Execution)}
  return ({k: v for k, v in options.items() if k not in names},
          Execution(**{k: v for k, v in options.items() if k in names}))


# A run of two steps of the tiny preset on 1x2 (the run-safety tests).
SHORT_RUN_FLAGS = [*TINY_RUN_FLAGS, "--mesh", "1x2", "--steps", "2"]


def subprocess_env(**extra) -> dict[str, str]:
  """The environment of a child Python that must choose its own devices and threads."""
  import os
  from pathlib import Path

  from conftest import FAST_COMPILE_XLA_FLAGS
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
  root = str(Path(__file__).resolve().parent.parent)
  # The child compiles as the tests do (conftest.FAST_COMPILE_XLA_FLAGS) and picks its
  # own device count.
  return {**env, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": " ".join(FAST_COMPILE_XLA_FLAGS), **extra}


def wait_for(condition, timeout=60.0, what="the condition") -> None:
  import time
  deadline = time.time() + timeout
  while time.time() < deadline:
    if condition():
      return
    time.sleep(0.05)
  raise AssertionError(f"timed out waiting for {what}")


def tiny_state() -> dict:
  """A one-array state tree for checkpoint tests."""
  return {"params": {"w": jnp.arange(6.0).reshape(2, 3)}}


def bpe_tokenizer(corpus, vocab_size=300):
  """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus`` (a file path): the
  tokenizer.json an HF folder of the CLI tests carries."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train([str(corpus)], trainers.BpeTrainer(
      vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tokenizer


def logged_losses(metrics_path) -> list[float]:
  """The training losses of a ``--metrics-file`` JSONL, in step order."""
  import json
  from pathlib import Path
  return [r["loss"] for r in map(json.loads, Path(metrics_path).read_text().splitlines())
          if "loss" in r]


def fine_tune_folder(tmp_path, name):
  """A family's fixture config at a BPE tokenizer's vocabulary, saved with random weights
  and that tokenizer.json as an HF folder: (config, folder, train/run.py flags for it)."""
  import dataclasses

  from models.hf import read_config, save_hf
  from models.transformer import Transformer
  corpus = write_small_corpus(tmp_path / "corpus.py")
  tokenizer = bpe_tokenizer(corpus)
  fixture = Path(__file__).resolve().parent / "fixtures" / "hf" / name
  cfg = dataclasses.replace(read_config(fixture), vocab_size=tokenizer.get_vocab_size() + 3,
                            max_seq_len=32)
  folder = tmp_path / "model"
  save_hf(Transformer(cfg, mesh=flax_tp.make_mesh("1x1"), rngs=nnx.Rngs(3)), folder)
  tokenizer.save(str(folder / "tokenizer.json"))
  flags = ["--init-from", str(folder), "--batch-size", "8", "--seq-len", "16", "--steps", "6",
           "--lr", "1e-2", "--warmup-steps", "1", "--eval-every", "0", "--sample-length", "4",
           "--data", corpus]
  return cfg, folder, flags


def logical_arrays(state) -> dict[str, np.ndarray]:
  """A module's or state's params (or gradients) by dotted path, as logical numpy arrays
  (``flax_tp.unshard``: padding stripped, stacked layers one by one)."""
  return {".".join(map(str, k)): np.asarray(v[...])
          for k, v in nnx.to_flat_state(flax_tp.unshard(state))}


def rewrite_safetensors(path, edit) -> None:
  """Rewrites a safetensors file from its bytes, with no framework (FP8 needs no torch):
  ``edit(tensors)`` changes ``{name: (dtype, shape, bytes)}`` in place (drop an entry, cut
  one); the header's metadata is kept."""
  import json
  path = Path(path)
  raw = path.read_bytes()
  size = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + size])
  metadata = header.pop("__metadata__", None)
  data = raw[8 + size:]
  tensors = {name: (e["dtype"], list(e["shape"]), data[e["data_offsets"][0]:e["data_offsets"][1]])
             for name, e in header.items()}
  edit(tensors)
  out, blobs, offset = {}, [], 0
  if metadata is not None:
    out["__metadata__"] = metadata
  for name, (dtype, shape, blob) in tensors.items():
    out[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
    blobs.append(blob)
    offset += len(blob)
  text = json.dumps(out).encode()
  text += b" " * (-len(text) % 8)
  path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))
