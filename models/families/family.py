"""``Family``: what one HF family declares (its names, how its config is read and
written, the tensors its layers store and which it fuses, where its experts live)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from models.config import TransformerConfig
from models.families.tensors import TensorBuilder, attention_tensors, expert_tensors

# -- the families ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Family:
  """One HF family: its ``model_type``, architecture, the config fields it reads
  beyond the shared ones, what it writes back, and whether it fuses q/k/v and
  gate/up on disk (Phi-3: ``qkv_proj`` rows q, k, v; ``gate_up_proj`` rows gate, up).

  read: config.json -> ``TransformerConfig`` fields that override the shared ones.
  write: config -> config.json fields beyond the shared ones (``HFConfigError`` for a
  config the family cannot represent).
  attention, experts: the builders of a layer's attention tensors and of a MoE layer's
  router and experts (``tensors.TensorBuilder``; Llama's and the per-expert layout unless
  the family stores its own: DeepSeek-V3's latent attention, GPT-OSS's experts).
  """

  model_type: str
  architecture: str
  read: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
  write: Callable[[TransformerConfig], dict[str, Any]]
  fused: bool = False
  # Mixture of experts: the prefix of a layer's MoE tensors in the per-expert form
  # transformers' save_pretrained writes (Mixtral's "block_sparse_moe", Qwen's "mlp"),
  # and the names of an expert's gate, up and down there. None: a dense family.
  moe_prefix: str | None = None
  expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  shared_expert: str = "shared_expert"  # the shared expert's module (GLM's "shared_experts")
  # Multi-token-prediction layers a checkpoint may hold after its decoder layers (the
  # config.json fields that count them; DeepSeek-V3, GLM-4.5): not run by a causal LM
  # (transformers ignores them too), skipped by name on load with a warning.
  mtp_fields: tuple[str, ...] = ()
  attention: TensorBuilder = attention_tensors
  experts: TensorBuilder = expert_tensors

  @property
  def name(self) -> str | None:
    """``TransformerConfig.family``: None for Llama and Qwen2, which the biases tell
    apart (a run written before the families keeps its identity)."""
    return None if self.model_type in ("llama", "qwen2") else self.model_type


