"""The contenders a flax_tp step is measured against, all on the same model and batch.

- ``gspmd``: the plain-Flax reference model sharded the way Flax's docs teach:
  Megatron-style partition specs as ``nnx.Param`` sharding metadata, the params
  placed with ``nnx.get_named_sharding``, and XLA's partitioner inserting every
  collective inside one ``jax.jit``.
- ``gspmd_fused``: the same with one fused q/k/v projection per block, laid out
  per kv head as ``[q heads of its group | k | v]`` so that splitting its outputs
  over the model axis splits whole groups (what a GPT written for GSPMD does).
- ``gpt``: an independent GPT written as Flax's docs teach GSPMD, sharing no code
  with flax_tp's models: plain NNX layers whose initializers carry Megatron specs
  (``nnx.with_partitioning``), one fused q/k/v projection laid out per head
  (``[heads, 3, head_dim]``, so splitting its outputs splits whole heads), rotary
  positions (so it computes what flax_tp's model computes), attention as einsums with a
  causal ``where`` (as ``../shared/peers/gspmd_gpt.py``, the faster form on XLA:CPU), a
  tied head, optax's cross-entropy, a mesh of ``Auto`` axes, one ``jax.jit``. Multi-head
  only (the GPT family): GELU MLP, LayerNorm, biases, as the ``small`` preset.
- ``data_parallel``: the reference model replicated, batch split over all devices.
- ``single``: the reference model on one device, plain ``jax.jit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import attention, ops
from models.config import TransformerConfig
from models.reference import ReferenceTransformer, reference_loss

# Megatron's layout written as specs: column-parallel kernels split their
# outputs, row-parallel ones their inputs, the embedding its vocabulary.
_RULES = {
    ("embed", "embedding"): ("model", None),
    ("q", "kernel"): (None, "model"), ("k", "kernel"): (None, "model"),
    ("v", "kernel"): (None, "model"), ("q", "bias"): ("model",), ("k", "bias"): ("model",),
    ("v", "bias"): ("model",), ("o", "kernel"): ("model", None),
    ("qkv", "kernel"): (None, "model"), ("qkv", "bias"): ("model",),
    ("up", "kernel"): (None, "model"), ("up", "bias"): ("model",),
    ("gate", "kernel"): (None, "model"), ("gate", "bias"): ("model",),  # SwiGLU
    ("down", "kernel"): ("model", None), ("head", "kernel"): (None, "model"),
}


def megatron_spec(path: tuple, ndim: int) -> tuple:
  names = tuple(str(p) for p in path[-2:])
  return _RULES.get(names, (None,) * ndim)


def annotate(model: nnx.Module, mesh: Mesh, spec_fn: Callable[[tuple, int], tuple]) -> None:
  """Adds sharding metadata to every param and places it accordingly (in place)."""
  state = nnx.state(model, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    var.set_metadata(out_sharding=spec_fn(path, var[...].ndim))
  shardings = nnx.get_named_sharding(state, mesh)
  nnx.update(model, jax.device_put(state, shardings))


def make_step(graphdef, tx) -> Callable:
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(
        lambda p: reference_loss(nnx.merge(graphdef, p), tokens))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


class FusedQKVAttention(nnx.Module):
  """The reference attention with one ``[d, hkv * (group + 2) * head_dim]`` projection.

  Per kv head its group's query heads, then its key, then its value: the output
  dimension splits over the model axis by whole groups when the axis divides
  the kv heads, so the partitioner needs no communication before attention.
  """

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    group = cfg.num_heads // cfg.kv_heads
    dense = dict(dtype=cfg.compute_dtype, rngs=rngs)
    self.qkv = nnx.Linear(cfg.d_model, cfg.kv_heads * (group + 2) * cfg.head_dim,
                          use_bias=cfg.qkv_bias, **dense)
    self.o = nnx.Linear(cfg.num_heads * cfg.head_dim, cfg.d_model,
                        use_bias=cfg.attn_out_bias, **dense)
    self.cfg = cfg

  def __call__(self, x_bsd, key, layer):
    cfg = self.cfg
    b, s, _ = x_bsd.shape
    group = cfg.num_heads // cfg.kv_heads
    qkv = self.qkv(x_bsd).reshape(b, s, cfg.kv_heads, group + 2, cfg.head_dim)
    q = qkv[:, :, :, :group].reshape(b, s, cfg.num_heads, cfg.head_dim)
    k, v = qkv[:, :, :, group], qkv[:, :, :, group + 1]
    q, k = ops.rotary(q, cfg.rope_base), ops.rotary(k, cfg.rope_base)
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    dropout_key = ops.site_key(key, layer, ops.ATTN_PROBS)
    dropout = None if dropout_key is None else attention.Dropout(
        dropout_key, jnp.arange(b), jnp.arange(cfg.num_heads))
    out = attention.attend(q, k, v, attention.AttentionSpec(dropout=cfg.dropout),
                           dropout=dropout)
    return self.o(out.reshape(b, s, -1))


def fused_qkv_reference(cfg: TransformerConfig, rngs: nnx.Rngs) -> ReferenceTransformer:
  """The reference model with each block's attention a ``FusedQKVAttention`` holding
  the same q, k and v weights: the same function, one projection."""
  model = ReferenceTransformer(cfg, rngs=rngs)
  group, hd = cfg.num_heads // cfg.kv_heads, cfg.head_dim
  for block in model.blocks:
    fused = FusedQKVAttention(cfg, rngs=nnx.Rngs(0))
    names = ("kernel", "bias") if cfg.qkv_bias else ("kernel",)
    for name in names:
      q, k, v = (getattr(getattr(block.attn, p), name)[...] for p in "qkv")
      lead = q.shape[:-1]
      packed = jnp.concatenate([q.reshape(*lead, cfg.kv_heads, group, hd),
                                k.reshape(*lead, cfg.kv_heads, 1, hd),
                                v.reshape(*lead, cfg.kv_heads, 1, hd)], axis=-2)
      getattr(fused.qkv, name)[...] = packed.reshape(*lead, -1)
    fused.o = block.attn.o
    block.attn = fused
  return model


class Peer:
  """A compiled reference step with its params, optimizer state and batch sharding."""

  def __init__(self, name: str, cfg: TransformerConfig, tx, mesh: Mesh | None,
               spec_fn: Callable[[tuple, int], tuple] | None, seed: int = 0,
               build: Callable[..., nnx.Module] = ReferenceTransformer):
    self.name = name
    model = build(cfg, rngs=nnx.Rngs(seed))
    if mesh is not None:
      annotate(model, mesh, spec_fn)
      self.batch_sharding = NamedSharding(mesh, P("data"))
    else:
      self.batch_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    self.graphdef, self.params = nnx.split(model, nnx.Param)
    self.opt_state = tx.init(self.params)
    out_shardings = None
    if mesh is not None:
      shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
      replicated = NamedSharding(mesh, P())
      self.opt_state = jax.tree.map(
          lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated),
          self.opt_state)
      out_shardings = (shardings(self.params), shardings(self.opt_state), replicated)
    self.step = jax.jit(make_step(self.graphdef, tx), out_shardings=out_shardings,
                        donate_argnums=(0, 1))

  def state(self) -> tuple[Any, Any]:
    return self.params, self.opt_state


def _rotary(x_bshk, base: float):
  """Half-split rotary at positions ``0 .. s-1``, computed in the step as a docs-style
  GPT (and ``../shared/peers/gspmd_gpt.py``) computes it: flax_tp's ``ops.rotary``
  before its tables became constants."""
  s, k = x_bshk.shape[1], x_bshk.shape[-1]
  inv_freq = 1.0 / (base ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
  angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq  # [s, k / 2]
  cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
  x1, x2 = jnp.split(x_bshk.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                         axis=-1).astype(x_bshk.dtype)


class GPTBlock(nnx.Module):
  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    kernel, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
    column = dict(kernel_init=nnx.with_partitioning(kernel, (None, "model")),
                  bias_init=nnx.with_partitioning(zeros, ("model",)), rngs=rngs)
    row = dict(kernel_init=nnx.with_partitioning(kernel, ("model", None)), rngs=rngs)
    d, heads, hd = cfg.d_model, cfg.num_heads, cfg.head_dim
    self.ln1 = nnx.LayerNorm(d, epsilon=cfg.norm_eps, rngs=rngs)
    self.qkv = nnx.Linear(d, heads * 3 * hd, **column)  # per head: its q, k, v
    self.o = nnx.Linear(heads * hd, d, **row)
    self.ln2 = nnx.LayerNorm(d, epsilon=cfg.norm_eps, rngs=rngs)
    self.up = nnx.Linear(d, cfg.d_ff, **column)
    self.down = nnx.Linear(cfg.d_ff, d, **row)
    self.cfg = cfg

  def __call__(self, x_bsd):
    cfg = self.cfg
    b, s, _ = x_bsd.shape
    qkv = self.qkv(self.ln1(x_bsd)).reshape(b, s, cfg.num_heads, 3, cfg.head_dim)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    q, k = _rotary(q, cfg.rope_base), _rotary(k, cfg.rope_base)
    # attention written out as a docs-style GPT writes it (issue 41's peer,
    # ../shared/peers/gspmd_gpt.py): on XLA:CPU faster than jax.nn.dot_product_attention
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(cfg.head_dim))
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
    x_bsd = x_bsd + self.o(attn.reshape(b, s, -1))
    return x_bsd + self.down(jax.nn.gelu(self.up(self.ln2(x_bsd))))


class GPT(nnx.Module):
  """tokens ``[b, s]`` -> logits ``[b, s, vocab]``; see ``gpt`` in the module docstring."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    if cfg.kv_heads != cfg.num_heads or cfg.mlp != "gelu" or cfg.norm != "layernorm":
      raise ValueError("the GPT peer is multi-head with a GELU MLP and LayerNorm (the "
                       "'tiny' / 'small' presets)")
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(1.0), ("model", None)), rngs=rngs)
    self.blocks = nnx.List([GPTBlock(cfg, rngs) for _ in range(cfg.num_layers)])
    self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)

  def __call__(self, tokens_bs):
    x = self.embed(tokens_bs)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.ln_f(x))


class GPTPeer:
  """``gpt``'s compiled step, params, optimizer state and batch sharding (as ``Peer``)."""

  name = "gpt"

  def __init__(self, cfg: TransformerConfig, tx, mesh: Mesh, seed: int = 0):
    auto = jax.make_mesh(mesh.devices.shape, mesh.axis_names,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names),
                         devices=mesh.devices.reshape(-1))
    with jax.set_mesh(auto):
      model = GPT(cfg, nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    specs = nnx.get_partition_spec(params)
    self.params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(auto, s), specs))
    self.opt_state = tx.init(self.params)
    self.batch_sharding = NamedSharding(auto, P("data"))

    def step(params, opt_state, tokens):
      def loss(p):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      value, grads = jax.value_and_grad(loss)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    self.step = jax.jit(step, donate_argnums=(0, 1))

  def state(self) -> tuple[Any, Any]:
    return self.params, self.opt_state


def gpt(cfg, tx, mesh) -> GPTPeer:
  return GPTPeer(cfg, tx, mesh)


def _replicated(path: tuple, ndim: int) -> tuple:
  return (None,) * ndim


def gspmd(cfg, tx, mesh) -> Peer:
  return Peer("gspmd", cfg, tx, mesh, megatron_spec)


def gspmd_fused(cfg, tx, mesh) -> Peer:
  return Peer("gspmd_fused", cfg, tx, mesh, megatron_spec, build=fused_qkv_reference)


def data_parallel(cfg, tx, mesh) -> Peer:
  """Every param replicated; the batch split over the "data" axis (use a Dx1 mesh)."""
  return Peer("data_parallel", cfg, tx, mesh, _replicated)


def single(cfg, tx) -> Peer:
  return Peer("single", cfg, tx, None, None)


def tokens_for(cfg: TransformerConfig, batch: int, seq: int, seed: int = 0) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, cfg.vocab_size,
                            dtype=jnp.int32)
