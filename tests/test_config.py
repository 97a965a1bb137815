"""TransformerConfig as records (attention, rope, FFN, experts, each in its own record)
read and built by the flat names a checkpoint's identity uses (issue 38). No model is
built: milliseconds."""

import dataclasses
import pickle

import pytest

from models.config import (
  FFN,
  FLAT_FIELDS,
  FULL,
  SLIDING,
  Attention,
  Experts,
  LatentAttention,
  Rope,
  RopeScaling,
  Router,
  TransformerConfig,
)

RECORDS = {"attention": Attention, "latent": LatentAttention, "rope": Rope, "ffn": FFN,
           "experts": Experts, "router": Router}


def _leaf_paths(cls, prefix=()) -> set[tuple[str, ...]]:
  """Every non-record field below ``cls``, as a path of field names."""
  out = set()
  for f in dataclasses.fields(cls):
    if f.name in RECORDS:
      out |= _leaf_paths(RECORDS[f.name], prefix + (f.name,))
    else:
      out.add(prefix + (f.name,))
  return out


def _walk(cfg, path):
  for step in path:
    cfg = getattr(cfg, step)
  return cfg


def test_every_field_of_every_record_has_one_flat_name():
  """A field missing from FLAT_FIELDS would be missing from identity() (a checkpoint
  could not tell two models apart); a flat name must point at a field."""
  paths = [path or (name,) for name, path in FLAT_FIELDS.items()]
  assert len(set(paths)) == len(paths)
  assert set(paths) == _leaf_paths(TransformerConfig)


@pytest.mark.parametrize("preset", ["moe-tiny", "deepseek-v3", "gpt-oss-20b", "gemma3-1b",
                                    "olmo3-7b", "llama3.2-1b"])
def test_flat_names_read_their_record_and_build_the_same_config(preset):
  cfg = TransformerConfig.preset(preset)
  flat = cfg.flat()
  for name, path in FLAT_FIELDS.items():
    if path and all(_walk(cfg, path[:i]) is not None for i in range(1, len(path))):
      assert flat[name] == _walk(cfg, path), name
  assert TransformerConfig(**flat) == cfg
  assert TransformerConfig.from_identity(cfg.identity()) == cfg
  assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(pickle.loads(pickle.dumps(cfg))) == hash(cfg)


def test_records_and_flat_fields_are_two_spellings_of_one_config():
  by_records = TransformerConfig(
      d_model=24, norm="rmsnorm",
      attention=Attention(num_heads=6, head_dim=4, num_kv_heads=2, qkv_bias=False,
                          layer_types=(SLIDING, FULL), sliding_window=3),
      rope=Rope(base=500.0, scaling=RopeScaling("linear", 2.0)),
      ffn=FFN(kind="swiglu", d_ff=90, bias=False), num_layers=2,
      experts=Experts(num_experts=6, per_token=3, router=Router(score="sigmoid", groups=2)))
  by_names = TransformerConfig(
      d_model=24, norm="rmsnorm", num_heads=6, head_dim=4, num_kv_heads=2, qkv_bias=False,
      layer_types=(SLIDING, FULL), sliding_window=3, rope_base=500.0,
      rope_scaling=RopeScaling("linear", 2.0), mlp="swiglu", d_ff=90, mlp_bias=False,
      num_layers=2, num_experts=6, experts_per_token=3, router_score="sigmoid",
      expert_groups=2)
  assert by_records == by_names
  assert by_names.experts.router.groups == 2 and by_names.expert_groups == 2
  assert by_names.attention.num_kv_heads == by_names.num_kv_heads == 2


def test_replace_by_a_flat_name_changes_its_record_and_turns_records_on_and_off():
  dense = TransformerConfig.preset("llama-tiny")
  assert dense.experts is None and dense.num_experts is None
  assert dense.experts_per_token == Experts.per_token  # an absent record reads its defaults
  moe = dataclasses.replace(dense, num_experts=4, router_score="sigmoid")
  assert moe.experts == Experts(num_experts=4, router=Router(score="sigmoid"))
  assert moe.attention == dense.attention and moe.rope == dense.rope
  assert dataclasses.replace(moe, num_experts=None) == dense
  latent = TransformerConfig.preset("deepseek-v3")
  assert dataclasses.replace(latent, q_lora_rank=None).attention.latent == dataclasses.replace(
      latent.attention.latent, q_lora_rank=None)


@pytest.mark.parametrize("fields, error, named", [
    (dict(q_lora_rank=8), ValueError, "q_lora_rank is a field of multi-head latent attention"),
    (dict(router_score="sigmoid"), ValueError,
     "router_score is a field of mixture-of-experts layers, which num_experts"),
    (dict(experts_per_token=3), ValueError, "experts_per_token is a field of mixture"),
    (dict(experts=Experts()), ValueError, "needs num_experts"),
    (dict(heads=4), TypeError, "unexpected keyword argument 'heads'"),
])
def test_a_field_with_nowhere_to_go_is_named(fields, error, named):
  with pytest.raises(error, match=named):
    TransformerConfig.tiny(**fields)


def test_a_flat_field_at_its_default_leaves_an_absent_record_absent():
  """An HF reader or an old identity may spell a default out (experts_per_token=2 on a
  dense model): that is no expert layer, and no error."""
  cfg = TransformerConfig.tiny(experts_per_token=2, rope_interleave=False)
  assert cfg == TransformerConfig.tiny()


def test_the_whole_is_checked_whichever_spelling_built_it():
  with pytest.raises(ValueError, match="num_kv_heads must divide num_heads=6"):
    TransformerConfig.tiny(attention=Attention(num_heads=6, head_dim=4, num_kv_heads=4))
  with pytest.raises(ValueError, match="mlp must be 'swiglu'"):
    TransformerConfig.tiny(num_experts=4)  # (tiny's FFN is GELU)


def test_a_record_given_to_a_preset_replaces_the_presets_record_whole():
  attention = Attention(num_heads=8, head_dim=4, num_kv_heads=2)
  cfg = TransformerConfig.preset("llama-tiny", attention=attention)
  assert cfg.attention == attention and cfg.num_heads == 8
  assert cfg.ffn == TransformerConfig.preset("llama-tiny").ffn


@pytest.mark.parametrize("fields, named", [
    (dict(attention={"num_heads": 4}), "attention must be a models.config.Attention, got"),
    (dict(experts=6), "experts must be a models.config.Experts or None, got 6"),
    (dict(num_experts=4, mlp="swiglu", experts=Experts(num_experts=4, router=None)),
     "experts.router must be a models.config.Router, got None"),
])
def test_a_record_of_the_wrong_kind_is_named(fields, named):
  with pytest.raises(ValueError, match=named):
    TransformerConfig(**fields)


@pytest.mark.parametrize("preset,fixture", [
    ("deepseek-v3-tiny", "deepseek_v3"), ("glm4.5-tiny", "glm4_moe"),
    ("gpt-oss-tiny", "gpt_oss"), ("olmo2-tiny", "olmo2"), ("olmo3-tiny", "olmo3")])
def test_a_tiny_preset_is_its_familys_fixture_over_the_byte_vocabulary(preset, fixture):
  """Each 2026 family's -tiny preset is the architecture of its HF fixture (which the
  family tests compare with transformers), with the byte vocabulary and llama-tiny's 16
  positions and no pad token (the byte tokenizer has none): the same identity but for
  those fields."""
  import json
  from pathlib import Path

  from models.families import config_from_hf
  folder = Path(__file__).parent / "fixtures" / "hf" / fixture
  hf = config_from_hf(json.loads((folder / "config.json").read_text())).identity()
  ours = TransformerConfig.preset(preset).identity()
  assert ours["vocab_size"] == 259 and ours["max_seq_len"] == 16
  differ = {k for k in hf.keys() | ours.keys() if hf.get(k) != ours.get(k)}
  assert differ == {"vocab_size", "max_seq_len", "padding_idx"}, differ
