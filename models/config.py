"""The transformer's configuration: one frozen dataclass, presets as classmethods."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only, pre-norm transformer with rotary positions.

  One family, two styles: GPT-like (``norm="layernorm"``, ``mlp="gelu"``, biases
  everywhere, today's default) and Llama/Qwen2-like (``norm="rmsnorm"``,
  ``mlp="swiglu"``, ``num_kv_heads`` < ``num_heads`` for grouped-query
  attention, biases off, or on q/k/v only for Qwen2).

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
  rope_base: float = 10_000.0  # HF's rope_theta
  norm_eps: float = 1e-5
  norm: str = "layernorm"  # or "rmsnorm"
  mlp: str = "gelu"  # or "swiglu": down(silu(gate(x)) * up(x))
  num_kv_heads: int | None = None  # None: num_heads (multi-head attention)
  qkv_bias: bool = True
  attn_out_bias: bool = True
  mlp_bias: bool = True
  # How a step runs (sequence parallelism, remat, scanned layers, FSDP) is not here:
  # see models.execution.Execution.

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_heads", "head_dim", "d_ff", "num_layers",
                 "max_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary positions, got {self.head_dim}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
    if self.norm not in ("layernorm", "rmsnorm"):
      raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
    if self.mlp not in ("gelu", "swiglu"):
      raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
    kv = self.kv_heads
    if kv < 1 or self.num_heads % kv:
      raise ValueError(f"num_kv_heads must divide num_heads={self.num_heads}, got "
                       f"{self.num_kv_heads}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

  def identity(self) -> dict:
    """The fields that define the model (what a checkpoint must match): all of them."""
    return dataclasses.asdict(self)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  def norm_layer(self, rngs: nnx.Rngs) -> nnx.Module:
    """The pre-norm of a block (and the final norm): LayerNorm or RMSNorm over d_model."""
    cls = nnx.RMSNorm if self.norm == "rmsnorm" else nnx.LayerNorm
    return cls(self.d_model, epsilon=self.norm_eps, dtype=self.compute_dtype, rngs=rngs)

  @classmethod
  def tiny(cls, **overrides) -> TransformerConfig:
    """For tests: 6 heads, d_ff 90 and vocab 259 divide neither 4 nor 8."""
    return cls.preset("tiny", **overrides)

  @classmethod
  def small(cls, **overrides) -> TransformerConfig:
    """The default: learns Python's look in a few CPU minutes."""
    return cls.preset("small", **overrides)

  @classmethod
  def preset(cls, name: str, **overrides) -> TransformerConfig:
    check_architecture_fields(overrides)
    if name not in PRESETS:
      raise ValueError(f"unknown preset {name!r}; expected one of {tuple(PRESETS)}")
    return cls(**{**PRESETS[name], **overrides})

  @classmethod
  def preset_names(cls) -> tuple[str, ...]:
    return tuple(PRESETS)


def check_architecture_fields(overrides: dict) -> None:
  """Refuses, naming it, an execution option given where architecture fields go (they
  were ``TransformerConfig`` fields before the execution record)."""
  from models.execution import Execution  # (it imports flax_tp; this module need not)
  wrong = sorted(set(overrides) & {f.name for f in dataclasses.fields(Execution)})
  if wrong:
    raise ValueError(f"{wrong[0]} is how a step runs, not what the model is: pass "
                     f"execution=Execution({wrong[0]}=...) to Transformer or load_hf")


_LLAMA = dict(norm="rmsnorm", mlp="swiglu", qkv_bias=False, attn_out_bias=False,
              mlp_bias=False, norm_eps=1e-5, rope_base=10_000.0)
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=259, d_model=24, num_heads=6, head_dim=4, d_ff=90, num_layers=2,
                 max_seq_len=16),
    "small": {},
    # Llama-style. For tests: 6 query / 2 kv heads, d_ff 90, vocab 259 divide
    # neither 4 nor 8, so kv heads are replicated and every split is padded.
    "llama-tiny": dict(vocab_size=259, d_model=24, num_heads=6, num_kv_heads=2, head_dim=4,
                       d_ff=90, num_layers=2, max_seq_len=16, **_LLAMA),
    # Benchmark sizes (untied head, 32000-token vocabulary): ~125M and ~336M params.
    "llama-125m": dict(vocab_size=32000, d_model=768, num_heads=12, num_kv_heads=4,
                       head_dim=64, d_ff=2048, num_layers=12, max_seq_len=1024,
                       tie_embeddings=False, **_LLAMA),
    "llama-350m": dict(vocab_size=32000, d_model=1024, num_heads=16, num_kv_heads=4,
                       head_dim=64, d_ff=2816, num_layers=24, max_seq_len=1024,
                       tie_embeddings=False, **_LLAMA),
}
