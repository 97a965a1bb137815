"""The transformer's configuration: one frozen dataclass, presets as classmethods."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only, pre-LayerNorm transformer with rotary positions.

  Shapes in the code use: b batch, s sequence, d ``d_model``, h heads,
  k ``head_dim``, f ``d_ff``, v ``vocab_size``. Neither ``num_heads``, ``d_ff``
  nor ``vocab_size`` need divide the model axis: flax_tp pads the shards.
  """

  vocab_size: int = BYTE_VOCAB
  d_model: int = 128
  num_heads: int = 4
  head_dim: int = 32
  d_ff: int = 512
  num_layers: int = 4
  max_seq_len: int = 128
  tie_embeddings: bool = True  # LM head = embedding.attend; else its own weight
  dropout: float = 0.0  # embedding, attention probabilities, both residual branches
  dtype: str = "float32"  # compute dtype; params stay float32
  rope_base: float = 10_000.0
  norm_eps: float = 1e-5

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_heads", "head_dim", "d_ff", "num_layers",
                 "max_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary positions, got {self.head_dim}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @classmethod
  def tiny(cls, **overrides) -> TransformerConfig:
    """For tests: 6 heads, d_ff 90 and vocab 259 divide neither 4 nor 8."""
    return cls(**{**dict(vocab_size=259, d_model=24, num_heads=6, head_dim=4, d_ff=90,
                         num_layers=2, max_seq_len=16), **overrides})

  @classmethod
  def small(cls, **overrides) -> TransformerConfig:
    """The default: learns Python's look in a few CPU minutes."""
    return cls(**overrides)

  @classmethod
  def preset(cls, name: str, **overrides) -> TransformerConfig:
    if name not in PRESETS:
      raise ValueError(f"unknown preset {name!r}; expected one of {PRESETS}")
    return getattr(cls, name)(**overrides)

  @classmethod
  def preset_names(cls) -> tuple[str, ...]:
    return PRESETS


PRESETS = ("tiny", "small")
