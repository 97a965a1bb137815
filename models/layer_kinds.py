"""What differs between a model's layers: full or sliding-window attention, and the
rotary each kind uses (Gemma 3: sliding layers one base, full layers another).

``layer`` is a Python int in a loop over the blocks, or a traced int inside the
``lax.scan`` of scanned layers; both give the same values (the traced case selects
between the kinds with ``jnp.where``), so scanning changes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import ops
from models.config import SLIDING, TransformerConfig

# A window no sequence reaches: a full layer's, where a traced layer needs a number.
UNBOUNDED = 2**30


def _is_sliding(cfg: TransformerConfig, layer) -> bool | jax.Array:
  if isinstance(layer, int):
    return cfg.layer_type(layer) == SLIDING
  return jnp.asarray([t == SLIDING for t in cfg.layer_types])[layer]


def window_of(cfg: TransformerConfig, layer) -> int | jax.Array | None:
  """The sliding window of ``layer``'s attention; None where it (every layer) is full."""
  if not cfg.has_sliding_layers:
    return None
  sliding = _is_sliding(cfg, layer)
  if isinstance(sliding, bool):
    return cfg.sliding_window if sliding else None
  return jnp.where(sliding, cfg.sliding_window, UNBOUNDED)


def rotate(cfg: TransformerConfig, x_bshk: jax.Array, positions, layer) -> jax.Array:
  """Rotary positions on ``x [b, s, h, k]`` as ``layer``'s kind has them."""
  rope = cfg.rope

  def full():
    return ops.rotary(x_bshk, rope.base, positions, scaling=rope.scaling,
                      rotary_dim=cfg.rotary_dim)

  def local():
    return ops.rotary(x_bshk, rope.local_base, positions, rotary_dim=cfg.rotary_dim)

  if rope.local_base is None or not cfg.has_sliding_layers:
    return full()
  sliding = _is_sliding(cfg, layer)
  if isinstance(sliding, bool):
    return local() if sliding else full()
  return jnp.where(sliding, local(), full())  # a traced layer: both kinds, one kept
