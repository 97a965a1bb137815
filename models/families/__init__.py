"""The HuggingFace model families flax_tp loads and writes, each one declaration.

A ``Family`` (``family.py``) says how its ``config.json`` maps onto ``TransformerConfig``
(``read``: the family's own fields over the ones every family shares, read by
``catalog._shared``), how a config is written back (``write``), and the tensors its
layers store: its attention's and its experts' builders (``attention``, ``experts``:
Llama's and the per-expert layout unless it declares its own, as DeepSeek-V3's latent
attention and GPT-OSS's fused, biased experts do), which tensors it stores fused
(``fused``) and where its experts live (``moe_prefix``, ``expert_names``).
``catalog.tensor_names`` puts a config's tensors together: the family's builders, with
the tensors every family shares (embedding, the dense MLP, the extra norms a config asks
for: ``qk_norm``'s ``self_attn.q_norm``/``k_norm``, over a head or, OLMo 2/3, the whole
projection; ``sandwich_norm``'s four norms per layer, OLMo's two after the branches
without ``pre_norm``; GPT-OSS's sinks). Adding a family is a declaration in
``catalog.FAMILIES`` with its reader and writer in ``dense.py`` or ``experts.py``, its
tensor builders in ``tensors.py`` where its layout is its own, and a mechanism in
``models/transformer.py`` only when it brings a new one.

- ``fields``: reading and checking config.json fields; full and sliding layer layouts;
- ``rope``: rotary positions both ways (``rope_parameters`` or the legacy fields);
- ``family``: the ``Family`` record;
- ``dense``, ``experts``: each family's reader and writer;
- ``catalog``: ``FAMILIES``, ``config_from_hf`` / ``config_to_hf``, quantization and
  multi-token-prediction fields, ``tensor_names``;
- ``tensors``: ``HFTensor`` and the tensor builders a family declares.

A config field that changes the computation and is not honoured is an error
naming it (``HFConfigError``), never a silently different model.
"""

from models.families.catalog import (
  FAMILIES,
  SUPPORTED,
  config_from_hf,
  config_to_hf,
  family_for,
  family_of,
  fp8_block_size,
  is_mxfp4,
  mtp_prefixes,
  tensor_names,
)
from models.families.family import Family
from models.families.fields import HFConfigError
from models.families.tensors import HFTensor

__all__ = ["FAMILIES", "SUPPORTED", "Family", "HFConfigError", "HFTensor", "config_from_hf",
           "config_to_hf", "family_for", "family_of", "fp8_block_size", "is_mxfp4",
           "mtp_prefixes", "tensor_names"]
