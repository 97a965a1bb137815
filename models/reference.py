"""The transformer in plain Flax NNX: the reference flax_tp must reproduce exactly.

Same architecture, same param names and nesting, same order of key draws as
``models/transformer.py``, so one seed gives the same model in both. It imports
nothing from flax_tp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import layer_kinds, ops
from models.config import TransformerConfig


class Attention(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    width, kv_width = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    dense = dict(dtype=cfg.compute_dtype, rngs=rngs)
    self.q = nnx.Linear(cfg.d_model, width, use_bias=cfg.qkv_bias, **dense)
    self.k = nnx.Linear(cfg.d_model, kv_width, use_bias=cfg.qkv_bias, **dense)
    self.v = nnx.Linear(cfg.d_model, kv_width, use_bias=cfg.qkv_bias, **dense)
    self.o = nnx.Linear(width, cfg.d_model, use_bias=cfg.attn_out_bias, **dense)
    if cfg.qk_norm:
      self.q_norm = cfg.norm_layer(rngs, cfg.head_dim)
      self.k_norm = cfg.norm_layer(rngs, cfg.head_dim)
    self.cfg = cfg

  def __call__(self, x_bsd, key, layer):
    cfg = self.cfg
    b, s, _ = x_bsd.shape
    split = lambda t: t.reshape(b, s, -1, cfg.head_dim)
    q, k, v = split(self.q(x_bsd)), split(self.k(x_bsd)), split(self.v(x_bsd))
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = (layer_kinds.rotate(cfg, t, None, layer) for t in (q, k))
    # k, v keep their kv heads: query head i reads kv head i // (query heads per kv head)
    out = ops.causal_attention(q, k, v, dropout_key=ops.site_key(key, layer, ops.ATTN_PROBS),
                               rate=cfg.dropout, rows=jnp.arange(b),
                               heads=jnp.arange(cfg.num_heads),
                               window=layer_kinds.window_of(cfg, layer),
                               scale=cfg.attn_scale, softcap=cfg.attn_softcap)
    return self.o(out.reshape(b, s, -1))


class MLP(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    dense = dict(use_bias=cfg.mlp_bias, dtype=cfg.compute_dtype, rngs=rngs)
    if cfg.mlp in ops.GATED:
      self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, **dense)
    self.up = nnx.Linear(cfg.d_model, cfg.d_ff, **dense)
    self.down = nnx.Linear(cfg.d_ff, cfg.d_model, **dense)
    self.kind = cfg.mlp

  def __call__(self, x_bsd):
    gate = self.gate(x_bsd) if self.kind in ops.GATED else None
    return self.down(ops.mlp_hidden(self.kind, gate, self.up(x_bsd)))


class Block(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.ln1 = cfg.norm_layer(rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.ln2 = cfg.norm_layer(rngs)
    self.mlp = MLP(cfg, rngs=rngs)
    if cfg.sandwich_norm:
      self.ln_attn_out = cfg.norm_layer(rngs)
      self.ln_mlp_out = cfg.norm_layer(rngs)
    self.cfg = cfg

  def __call__(self, x_bsd, key, layer):
    rate, rows = self.cfg.dropout, jnp.arange(x_bsd.shape[0])
    attn = self.attn(self.ln1(x_bsd), key, layer)
    if self.cfg.sandwich_norm:
      attn = self.ln_attn_out(attn)
    x_bsd = x_bsd + ops.dropout(attn, ops.site_key(key, layer, ops.ATTN_OUT), rate, rows)
    mlp = self.mlp(self.ln2(x_bsd))
    if self.cfg.sandwich_norm:
      mlp = self.ln_mlp_out(mlp)
    return x_bsd + ops.dropout(mlp, ops.site_key(key, layer, ops.MLP_OUT), rate, rows)


class ReferenceTransformer(nnx.Module):
  """tokens ``[b, s]`` int -> logits ``[b, s, v]``."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.ln_f = cfg.norm_layer(rngs)
    if not cfg.tie_embeddings:
      self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                             dtype=cfg.compute_dtype, rngs=rngs)
    self.cfg = cfg

  def __call__(self, tokens_bs, *, dropout_key=None):
    cfg = self.cfg
    x = ops.scale_embeddings(cfg, self.embed(tokens_bs))
    x = ops.dropout(x, ops.site_key(dropout_key, 0, ops.EMBED), cfg.dropout,
                    jnp.arange(tokens_bs.shape[0]))
    for layer, block in enumerate(self.blocks):
      x = block(x, dropout_key, layer)
    x = self.ln_f(x)
    return ops.softcap_of(self.embed.attend(x) if cfg.tie_embeddings else self.head(x),
                       cfg.final_softcap)


def reference_loss(model: ReferenceTransformer, tokens_bs1, *, dropout_key=None,
                   label_smoothing: float = 0.0, z_loss: float = 0.0):
  """Mean next-token cross-entropy of ``tokens [b, s + 1]`` (optax's formula)."""
  import optax

  logits = model(tokens_bs1[:, :-1], dropout_key=dropout_key).astype(jnp.float32)
  targets = optax.smooth_labels(jax.nn.one_hot(tokens_bs1[:, 1:], logits.shape[-1]),
                                label_smoothing)
  loss = optax.softmax_cross_entropy(logits, targets)
  if z_loss:
    loss = loss + z_loss * jax.nn.logsumexp(logits, axis=-1) ** 2
  return jnp.mean(loss)
