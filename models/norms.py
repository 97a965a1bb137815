"""The norm Gemma uses: RMSNorm scaled by ``1 + w`` (``w`` starts at zero)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class OffsetRMSNorm(nnx.Module):
  """``x [..., width]`` -> same shape and dtype: ``x / rms(x) * (1 + scale)``.

  As transformers' Gemma/Gemma2/Gemma3 ``RMSNorm``: the normalisation and the
  ``(1 + w)`` product both in float32, cast to ``dtype`` only at the end (Llama's
  RMSNorm casts before multiplying by ``w``). The param is named ``scale``, as
  ``nnx.RMSNorm``'s is, and holds HF's ``weight`` unchanged.
  """

  def __init__(self, width: int, *, epsilon: float = 1e-6, dtype=jnp.float32):
    self.scale = nnx.Param(jnp.zeros((width,), jnp.float32))
    self.epsilon = epsilon
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.epsilon)
    return (h * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype)
