"""The HF tensors of a checkpoint and the flax_tp params each holds (``HFTensor``), and
the builders a family declares for its layers' tensors (``Family.attention``,
``Family.experts``): Llama's attention (fused as Phi-3's when the family says so),
DeepSeek-V3's latent attention, a mixture of experts' router and experts per expert or
fused, GPT-OSS's biased experts. ``catalog.tensor_names`` puts a config's together with
the tensors every family shares (embedding, norms, the dense MLP, the head)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from models.config import TransformerConfig
from models.families.fields import HFConfigError

# A builder of one layer's tensors of one part (attention, experts): (config, the
# ``Family`` declaring it (family.py imports this module, so it is typed ``Any`` here),
# the layer's HF prefix ``model.layers.{i}``, ``at(*path)`` -> the flax_tp param path in
# that layer, experts_fused) -> its tensors.
Family = Any
TensorBuilder = Callable[[TransformerConfig, Family, str, Callable, bool], Iterator["HFTensor"]]

# -- tensor names ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HFTensor:
  """One tensor of an HF checkpoint: its name, the flax_tp params it holds (one, or
  several fused along its rows with ``sizes`` rows each: the first dim of a matrix, the
  second of a stack of experts' ``[E, out, in]``), and whether it is stored transposed
  (HF's ``[..., out, in]`` against flax's ``kernel [..., in, out]``). ``expert``: the
  tensor is that expert's slice of the param (``[E, ...]``; transformers'
  per-expert layout)."""

  name: str
  paths: tuple[tuple, ...]
  transposed: bool
  sizes: tuple[int, ...] | None = None
  expert: int | None = None
  buffer: bool = False  # not trained (HF's nn.Buffer; a flax_tp.SelectionBias): a gradients
  # state has none
  rows: tuple[int, ...] | None = None  # the param's row i is the checkpoint's row rows[i]
  # (its out dim; a bias's one dim): DeepSeek's interleaved rotary rows, held half-split
  columns: bool = False  # ``sizes`` and ``rows`` lie along the last dim, not the rows: a
  # tensor stored [..., in, out] (GPT-OSS's experts, their biases [E, out])

  @property
  def out_axis(self) -> Callable[[Any], int]:
    """Where ``sizes`` and ``rows`` lie in a checkpoint value of this tensor: the rows
    (``out``) of ``[..., out, in]`` or a bias's one dim, or (``columns``) the last."""
    return (lambda value: -1) if self.columns else _rows_axis


def _rows_axis(value: Any) -> int:
  """The rows (``out``) of ``[..., out, in]``, or the one dim of a bias."""
  return 0 if value.ndim == 1 else value.ndim - 2


_ATTENTION = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"))
_MLP_IN = (("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"))


def expert_tensors(cfg: TransformerConfig, family: Family, layer: str, at: Callable,
                   experts_fused: bool) -> Iterator[HFTensor]:
  """A MoE layer's tensors: the router, the experts (one tensor per expert and weight,
  as ``save_pretrained`` writes them; or ``experts_fused``, transformers 5's in-memory
  ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` under ``mlp``), and a shared
  expert with its gate."""
  prefix = "mlp" if experts_fused else family.moe_prefix
  yield HFTensor(f"{layer}.{prefix}.gate.weight", (at("mlp", "router"),), True)
  if cfg.router_selection_bias:
    yield HFTensor(f"{layer}.{prefix}.gate.e_score_correction_bias",
                   (at("mlp", "selection_bias"),), False, buffer=True)
  if experts_fused:
    yield HFTensor(f"{layer}.mlp.experts.gate_up_proj", (at("mlp", "gate"), at("mlp", "up")),
                   True, (cfg.expert_width, cfg.expert_width))
    yield HFTensor(f"{layer}.mlp.experts.down_proj", (at("mlp", "down"),), True)
  else:
    for n in range(cfg.num_experts):
      for ours, hf in zip(("gate", "up", "down"), family.expert_names, strict=True):
        yield HFTensor(f"{layer}.{prefix}.experts.{n}.{hf}.weight", (at("mlp", ours),), True,
                       expert=n)
  if cfg.shared_expert_d_ff:
    for ours, hf in (("shared_gate", "gate_proj"), ("shared_up", "up_proj"),
                     ("shared_down", "down_proj")):
      yield HFTensor(f"{layer}.mlp.{family.shared_expert}.{hf}.weight",
                     (at("mlp", ours, "kernel"),), True)
    if cfg.shared_expert_gated:
      yield HFTensor(f"{layer}.mlp.shared_expert_gate.weight",
                     (at("mlp", "shared_expert_gate"),), True)


def gpt_oss_expert_tensors(cfg: TransformerConfig, family: Family, layer: str, at: Callable,
                           experts_fused: bool) -> Iterator[HFTensor]:
  """GPT-OSS's MoE tensors: the router's weight ``[E, H]`` and bias, the experts fused as
  transformers writes them (on disk and in memory alike), gate and up interleaved along
  gate_up's last dim (``rows`` takes the even columns, then the odd)."""
  width = cfg.expert_width
  split = tuple(range(0, 2 * width, 2)) + tuple(range(1, 2 * width, 2))
  yield HFTensor(f"{layer}.mlp.router.weight", (at("mlp", "router"),), True)
  yield HFTensor(f"{layer}.mlp.router.bias", (at("mlp", "router_bias"),), False)
  experts = f"{layer}.mlp.experts"
  yield HFTensor(f"{experts}.gate_up_proj", (at("mlp", "gate"), at("mlp", "up")), False,
                 (width, width), rows=split, columns=True)
  yield HFTensor(f"{experts}.gate_up_proj_bias", (at("mlp", "gate_bias"), at("mlp", "up_bias")),
                 False, (width, width), rows=split, columns=True)
  yield HFTensor(f"{experts}.down_proj", (at("mlp", "down"),), False)
  yield HFTensor(f"{experts}.down_proj_bias", (at("mlp", "down_bias"),), False)


def _deinterleaved(width: int, rope: int, blocks: int) -> tuple[int, ...]:
  """Row order of ``blocks`` blocks of ``width`` rows whose last ``rope`` rows hold rotary
  pairs interleaved ``(x0, x1), (x2, x3), ...``: each block's own rows, then its even rope
  rows, then its odd ones (the half-split layout rotary runs on)."""
  keep = width - rope
  block = [*range(keep), *range(keep, width, 2), *range(keep + 1, width, 2)]
  return tuple(b * width + r for b in range(blocks) for r in block)


def latent_attention_tensors(cfg: TransformerConfig, family: Family, layer: str,
                             at: Callable, experts_fused: bool) -> Iterator[HFTensor]:
  """DeepSeek-V3's attention tensors (``models.transformer.LatentAttention``); with
  ``rope_interleave`` the rotary rows of q (each head's last ``qk_rope_head_dim``) and of
  kv_a (its last) are permuted to the half-split layout flax_tp holds."""
  if not cfg.latent_attention:
    raise HFConfigError(f"{family.model_type}'s attention is latent (kv_lora_rank); this "
                        "model's is not")
  rope = cfg.qk_rope_head_dim
  q_rows = kv_rows = None
  if cfg.rope_interleave:
    q_rows = _deinterleaved(cfg.head_dim, rope, cfg.num_heads)
    kv_rows = _deinterleaved(cfg.kv_lora_rank + rope, rope, 1)
  attn = f"{layer}.self_attn"
  bias = cfg.qkv_bias
  if cfg.q_lora_rank is None:
    yield HFTensor(f"{attn}.q_proj.weight", (at("attn", "q", "kernel"),), True, rows=q_rows)
  else:
    yield HFTensor(f"{attn}.q_a_proj.weight", (at("attn", "q_a", "kernel"),), True)
    if bias:
      yield HFTensor(f"{attn}.q_a_proj.bias", (at("attn", "q_a", "bias"),), False)
    yield HFTensor(f"{attn}.q_a_layernorm.weight", (at("attn", "q_a_norm", "scale"),), False)
    yield HFTensor(f"{attn}.q_b_proj.weight", (at("attn", "q_b", "kernel"),), True, rows=q_rows)
  yield HFTensor(f"{attn}.kv_a_proj_with_mqa.weight", (at("attn", "kv_a", "kernel"),), True,
                 rows=kv_rows)
  if bias:
    yield HFTensor(f"{attn}.kv_a_proj_with_mqa.bias", (at("attn", "kv_a", "bias"),), False,
                   rows=kv_rows)
  yield HFTensor(f"{attn}.kv_a_layernorm.weight", (at("attn", "kv_a_norm", "scale"),), False)
  yield HFTensor(f"{attn}.kv_b_proj.weight", (at("attn", "kv_b", "kernel"),), True)
  yield HFTensor(f"{attn}.o_proj.weight", (at("attn", "o", "kernel"),), True)
  if cfg.attn_out_bias:
    yield HFTensor(f"{attn}.o_proj.bias", (at("attn", "o", "bias"),), False)


def attention_tensors(cfg: TransformerConfig, family: Family, layer: str, at: Callable,
                      experts_fused: bool) -> Iterator[HFTensor]:
  """Llama's attention tensors: q, k, v and o with the biases the config has; q/k/v as one
  ``qkv_proj`` (rows q, k, v) where the family stores them fused (Phi-3)."""
  if cfg.latent_attention:
    raise HFConfigError(f"this model's attention is latent (kv_lora_rank), which "
                        f"{family.model_type} cannot hold (deepseek_v3 does)")
  attn = f"{layer}.self_attn"
  if family.fused:
    yield from _linear(f"{attn}.qkv_proj", [at("attn", n) for n in ("q", "k", "v")],
                       cfg.qkv_bias, (cfg.num_heads * cfg.head_dim,
                                      cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim))
  else:
    for ours, hf in _ATTENTION:
      yield from _linear(f"{layer}.{hf}", [at("attn", ours)], cfg.qkv_bias)
  yield from _linear(f"{attn}.o_proj", [at("attn", "o")], cfg.attn_out_bias)


def dense_mlp_tensors(cfg: TransformerConfig, family: Family, layer: str,
                      at: Callable) -> Iterator[HFTensor]:
  """A dense layer's MLP: gate and up (one ``gate_up_proj`` where the family fuses them)
  for a gated MLP, and down, with the biases the config has."""
  if cfg.mlp in ("swiglu", "geglu"):
    if family.fused:
      yield from _linear(f"{layer}.mlp.gate_up_proj", [at("mlp", "gate"), at("mlp", "up")],
                         cfg.mlp_bias, (cfg.d_ff, cfg.d_ff))
    else:
      for ours, hf in _MLP_IN:
        yield from _linear(f"{layer}.{hf}", [at("mlp", ours)], cfg.mlp_bias)
  yield from _linear(f"{layer}.mlp.down_proj", [at("mlp", "down")], cfg.mlp_bias)


def _linear(name: str, modules: list[tuple], bias: bool,
            sizes: tuple[int, ...] | None = None) -> Iterator[HFTensor]:
  """A linear layer's ``weight`` (and ``bias``): the kernels of ``modules`` (their flax_tp
  paths), fused along the rows with ``sizes`` rows each when there are several."""
  yield HFTensor(f"{name}.weight", tuple((*m, "kernel") for m in modules), True, sizes)
  if bias:
    yield HFTensor(f"{name}.bias", tuple((*m, "bias") for m in modules), False, sizes)
