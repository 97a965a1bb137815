"""Each HF tensor of a config's checkpoint and the flax_tp params it holds
(``tensor_names``): Llama's names with the norms, biases, fused and per-expert tensors a
family adds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from models.config import TransformerConfig
from models.families.catalog import family_for
from models.families.family import Family

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


def _moe_tensors(cfg: TransformerConfig, family: Family, layer: str, at: Callable,
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


def _gpt_oss_experts(cfg: TransformerConfig, layer: str, at: Callable) -> Iterator[HFTensor]:
  """GPT-OSS's MoE tensors: the router's weight ``[E, H]`` and bias, the experts fused as
  transformers writes them, gate and up interleaved along gate_up's last dim (``rows``
  takes the even columns, then the odd)."""
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


def _latent_attention_tensors(cfg: TransformerConfig, layer: str,
                              at: Callable) -> Iterator[HFTensor]:
  """DeepSeek-V3's attention tensors (``models.transformer.LatentAttention``); with
  ``rope_interleave`` the rotary rows of q (each head's last ``qk_rope_head_dim``) and of
  kv_a (its last) are permuted to the half-split layout flax_tp holds."""
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


def tensor_names(cfg: TransformerConfig, experts_fused: bool = False) -> Iterator[HFTensor]:
  """Every tensor of ``cfg``'s HF checkpoint, in its family's names (a MoE family's
  experts one per tensor, or ``experts_fused`` as transformers 5 holds them)."""
  family = family_for(cfg)
  fused = family.fused
  yield HFTensor("model.embed_tokens.weight", (("embed", "embedding"),), False)
  q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
  norms = ([("ln1", "input_layernorm"), ("ln_attn_out", "post_attention_layernorm"),
            ("ln2", "pre_feedforward_layernorm"), ("ln_mlp_out", "post_feedforward_layernorm")]
           if cfg.sandwich_norm else
           [("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")])
  if not cfg.pre_norm:  # OLMo 2/3: only the norms after attention and the MLP
    norms = [(ours, hf) for ours, hf in norms if ours not in ("ln1", "ln2")]
  for i in range(cfg.num_layers):
    layer = f"model.layers.{i}"
    at = lambda *p, i=i: ("blocks", i, *p)
    groups = []  # (our names, HF name, group, bias, row sizes when fused)
    if cfg.latent_attention:
      yield from _latent_attention_tensors(cfg, layer, at)
    elif fused:
      groups.append((("q", "k", "v"), "self_attn.qkv_proj", "attn", cfg.qkv_bias,
                     (q_rows, kv_rows, kv_rows)))
    else:
      groups += [((ours,), hf, "attn", cfg.qkv_bias, None) for ours, hf in _ATTENTION]
    if not cfg.latent_attention:
      groups.append((("o",), "self_attn.o_proj", "attn", cfg.attn_out_bias, None))
    moe = cfg.is_moe_layer(i)
    if moe:
      pass  # (its tensors follow the attention's)
    elif cfg.mlp in ("swiglu", "geglu"):
      if fused:
        groups.append((("gate", "up"), "mlp.gate_up_proj", "mlp", cfg.mlp_bias,
                       (cfg.d_ff, cfg.d_ff)))
      else:
        groups += [((ours,), hf, "mlp", cfg.mlp_bias, None) for ours, hf in _MLP_IN]
    if not moe:
      groups.append((("down",), "mlp.down_proj", "mlp", cfg.mlp_bias, None))
    for ours, hf, group, bias, sizes in groups:
      yield HFTensor(f"{layer}.{hf}.weight", tuple(at(group, n, "kernel") for n in ours), True,
                     sizes)
      if bias:
        yield HFTensor(f"{layer}.{hf}.bias", tuple(at(group, n, "bias") for n in ours), False,
                       sizes)
    if cfg.qk_norm:
      for ours in ("q_norm", "k_norm"):
        yield HFTensor(f"{layer}.self_attn.{ours}.weight", (at("attn", ours, "scale"),), False)
    if cfg.attn_sinks:
      yield HFTensor(f"{layer}.self_attn.sinks", (at("attn", "sinks"),), False)
    if moe and family.model_type == "gpt_oss":
      yield from _gpt_oss_experts(cfg, layer, at)
    elif moe:
      yield from _moe_tensors(cfg, family, layer, at, experts_fused)
    for ours, hf in norms:
      yield HFTensor(f"{layer}.{hf}.weight", (at(ours, "scale"),), False)
  yield HFTensor("model.norm.weight", (("ln_f", "scale"),), False)
  if not cfg.tie_embeddings:
    yield HFTensor("lm_head.weight", (("head", "kernel"),), True)
