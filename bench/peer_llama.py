"""An independent single-device Llama in plain JAX, the accelerator benchmark's peer
(``bench/mfu.py``): what a user would write by hand for one chip, with jax's own
Pallas splash attention kernel on a TPU.

Written apart from flax_tp (nothing imported from ``flax_tp`` or ``models``; only the
config's sizes are read): params a dict of float32 arrays, each layer's stacked
``[layers, ...]`` and sliced per layer in an unrolled loop, compute in the config's
``compute_dtype``, RMSNorm in float32, half-split rotary, SwiGLU, grouped-query
attention, an untied head (or the embedding's transpose when tied), cross-entropy over
the next token in float32, any optax transformation. Attention: ``"splash"`` (causal,
blocks of 512, the backward's blocks given, q scaled before the kernel: TPU only) or
``"xla"`` (einsums, the scores in float32). Modelled on ``../shared/peers/tpu_llama.py``
(the peer the accelerator issue was measured with).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def init_params(cfg, key) -> dict:
  d, h, g, hd, f, v, n = (cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff,
                          cfg.vocab_size, cfg.num_layers)
  keys = iter(jax.random.split(key, 9))
  normal = lambda shape, fan_in: (jax.random.normal(next(keys), shape, jnp.float32)
                                  / np.sqrt(fan_in))
  params = {
      "embed": normal((v, d), 1.0) * 0.02,
      "final_norm": jnp.ones((d,), jnp.float32),
      "layers": {
          "attn_norm": jnp.ones((n, d), jnp.float32),
          "mlp_norm": jnp.ones((n, d), jnp.float32),
          "wq": normal((n, d, h * hd), d), "wk": normal((n, d, g * hd), d),
          "wv": normal((n, d, g * hd), d), "wo": normal((n, h * hd, d), h * hd),
          "wg": normal((n, d, f), d), "wu": normal((n, d, f), d), "wd": normal((n, f, d), f),
      },
  }
  if not cfg.tie_embeddings:
    params["head"] = normal((d, v), d)
  return params


def rms_norm(x, scale, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
  return (y * scale).astype(x.dtype)


def rotary(x, base):  # x [b, s, heads, hd]
  s, hd = x.shape[1], x.shape[-1]
  angles = np.arange(s)[:, None] * (1.0 / base ** (np.arange(0, hd, 2) / hd))[None, :]
  cos = jnp.asarray(np.cos(angles), x.dtype)[None, :, None, :]
  sin = jnp.asarray(np.sin(angles), x.dtype)[None, :, None, :]
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def xla_attention(q, k, v):  # q [b, s, h, hd], k/v [b, s, g, hd]
  b, s, h, hd = q.shape
  g = k.shape[2]
  q = q.reshape(b, s, g, h // g, hd)
  scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(np.tril(np.ones((s, s), bool)), scores / np.sqrt(hd), -1e30)
  probs = jax.nn.softmax(scores, -1).astype(v.dtype)
  return jnp.einsum("bgrqk,bkgd->bqgrd", probs, v).reshape(b, s, h, hd)


@functools.cache
def splash_kernel(seq: int, group: int, block: int = 512):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  b = min(block, seq)
  sizes = sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                        block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
  mask = sa.MultiHeadMask([sa.CausalMask((seq, seq))] * group)
  return sa.make_splash_mqa_single_device(mask=mask, block_sizes=sizes)


def splash_attention(q, k, v):
  b, s, h, hd = q.shape
  g = k.shape[2]
  kernel = splash_kernel(s, h // g)
  q = (q / np.sqrt(hd)).astype(q.dtype).reshape(b, s, g, h // g, hd).transpose(0, 2, 3, 1, 4)
  out = jax.vmap(jax.vmap(kernel))(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
  return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, hd)


def make_loss(cfg, attention: str):
  h, g, hd, eps = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.norm_eps
  dtype = jnp.dtype(cfg.compute_dtype)
  attend = splash_attention if attention == "splash" else xla_attention
  base = cfg.rope.base

  def layer(x, p):
    b, s, _ = x.shape
    y = rms_norm(x, p["attn_norm"], eps)
    q = (y @ p["wq"].astype(dtype)).reshape(b, s, h, hd)
    k = (y @ p["wk"].astype(dtype)).reshape(b, s, g, hd)
    v = (y @ p["wv"].astype(dtype)).reshape(b, s, g, hd)
    x = x + attend(rotary(q, base), rotary(k, base), v).reshape(b, s, h * hd) @ p[
        "wo"].astype(dtype)
    y = rms_norm(x, p["mlp_norm"], eps)
    gate = jax.nn.silu(y @ p["wg"].astype(dtype)) * (y @ p["wu"].astype(dtype))
    return x + gate @ p["wd"].astype(dtype)

  def loss(params, tokens):
    x = params["embed"][tokens[:, :-1]].astype(dtype)
    for i in range(cfg.num_layers):
      x = layer(x, jax.tree.map(lambda a, i=i: a[i], params["layers"]))
    x = rms_norm(x, params["final_norm"], eps)
    head = params["embed"].T if cfg.tie_embeddings else params["head"]
    logits = (x @ head.astype(dtype)).astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, -1)
    picked = jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    return jnp.mean(logz - picked)

  return loss


class PeerLlama:
  """The peer's compiled step with its params and optimizer state (``bench.harness``'s
  ``peer_contender`` interface: ``name``, ``step``, ``state()``, ``batch_sharding``)."""

  def __init__(self, cfg, tx, attention: str = "splash", seq: int | None = None, seed: int = 0):
    self.name = f"peer {attention}"
    if attention == "splash":  # built now: its mask tables must not be made in a trace
      splash_kernel(seq, cfg.num_heads // cfg.kv_heads)
    self.params = init_params(cfg, jax.random.key(seed))
    self.opt_state = tx.init(self.params)
    self.batch_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    loss = make_loss(cfg, attention)

    def step(params, opt_state, tokens):
      value, grads = jax.value_and_grad(loss)(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return jax.tree.map(jnp.add, params, updates), opt_state, value

    self.step = jax.jit(step, donate_argnums=(0, 1))

  def state(self):
    return self.params, self.opt_state
