"""The mesh's axes record and context parallelism, against one device (the reference).

Every model test compares a context-parallel model with ``models/reference.py`` built
from the same seed: logits, the loss and every gradient, at sequence lengths that ``2C``
does not divide (padding), with the execution options and attention kinds that meet
the context split (sequence parallelism, FSDP, scanned layers, remat, grouped-query
attention, sliding windows, soft-capping, q/k norms, partial rotary, dropout).
"""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_state_close

import flax_tp
from flax_tp.context import ContextSplit
from flax_tp.hlo import collectives
from models.config import TransformerConfig
from models.execution import Execution
from models.reference import ReferenceTransformer, reference_loss
from models.transformer import Transformer
from train.step import Trainer, make_optimizer

SLIDING = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=3,
               num_layers=2)


# -- the record ----------------------------------------------------------------------


@pytest.mark.parametrize("spec,roles,names", [
    ("2x4", (2, 1, 4), ("data", "model")),
    ("2x2x2", (2, 2, 2), ("data", "context", "model")),
    ("data=2,context=2,model=2", (2, 2, 2), ("data", "context", "model")),
    ("model=2, context=4", (1, 4, 2), ("data", "context", "model")),
    ("model=8", (1, 1, 8), ("data", "model")),
    ("2x1x4", (2, 1, 4), ("data", "model")),  # a one-device context axis is no axis
    ((1, 8, 1), (1, 8, 1), ("data", "context", "model")),
])
def test_mesh_forms_build_one_record(spec, roles, names):
  mesh = flax_tp.make_mesh(spec)
  axes = flax_tp.MeshAxes.of(mesh)
  assert (axes.data, axes.context, axes.model) == roles
  assert mesh.axis_names == names
  assert axes == flax_tp.MeshAxes.parse(spec)
  # consecutive devices share "model", then "context"
  assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()[:axes.devices]]
  assert axes.batch_axes == tuple(n for n in names if n != "model")


def test_a_mesh_without_context_is_the_two_axis_mesh_of_before():
  assert flax_tp.make_mesh("2x1x4") == flax_tp.make_mesh("2x4")
  assert flax_tp.parse_mesh_spec("data=2,model=4") == (2, 4)
  with pytest.raises(ValueError, match="context axis of 2"):
    flax_tp.parse_mesh_spec("2x2x2")


@pytest.mark.parametrize("seq_len,parts", [(13, 2), (16, 4), (5, 3), (1, 4), (17, 8)])
def test_split_holds_every_position_once_head_and_tail(seq_len, parts):
  split = ContextSplit(seq_len, parts)
  order = split.order
  assert order.shape == (parts, split.local_len)
  assert sorted(order.ravel().tolist()) == list(range(split.padded_len))
  assert split.padded_len >= seq_len > split.padded_len - 2 * parts
  for i in range(parts):  # device i: chunks i and 2C-1-i
    chunks = order[i].reshape(2, split.chunk) // split.chunk
    assert chunks[:, 0].tolist() == [i, 2 * parts - 1 - i]


# -- the model against one device ----------------------------------------------------


def _check_against_reference(mesh_spec, seq_len, cfg_options=None, execution=None,
                             dropout_key=None, preset="tiny"):
  cfg = TransformerConfig.preset(preset, **(cfg_options or {}))
  tokens = jax.random.randint(jax.random.key(1), (4, seq_len + 1), 0, cfg.vocab_size)
  reference = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  model = Transformer(cfg, mesh=flax_tp.make_mesh(mesh_spec), rngs=nnx.Rngs(0),
                      execution=execution or Execution())
  assert_state_close(model, reference, rtol=0, atol=0)  # the same params from the seed

  logits = jax.jit(lambda t: model(t))(tokens[:, :-1])
  assert logits.shape == (4, seq_len, cfg.vocab_size)
  np.testing.assert_allclose(logits, nnx.jit(lambda m, t: m(t))(reference, tokens[:, :-1]),
                             rtol=1e-5, atol=1e-5)

  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
  loss, grads = trainer.loss_and_grads(
      trainer.params, jax.device_put(tokens, trainer.batch_sharding), dropout_key)
  graphdef, params = nnx.split(reference, nnx.Param)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(
      lambda p: reference_loss(nnx.merge(graphdef, p), tokens, dropout_key=dropout_key)))(params)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert_state_close(grads, ref_grads, rtol=1e-4, atol=1e-6)


FAST = [
    ("1x3x2", 17, dict(num_kv_heads=3, qk_norm=True, norm="rmsnorm", mlp="swiglu"),
     Execution(fsdp=True, sequence_parallel=True, loss_chunks=3)),  # (pieces of slots)
]
SLOW = [
    ("2x2x2", 13, {}, Execution(sequence_parallel=True)),
    ("1x2x4", 13, {}, Execution()),
    ("1x4x2", 14, dict(num_kv_heads=2, rotary_fraction=0.5), Execution(scan_layers=True)),
    ("1x8x1", 11, dict(num_kv_heads=2), Execution(remat="block")),
    ("2x3x1", 14, dict(attn_softcap=5.0, **SLIDING),
     Execution(scan_layers=True, remat="block", fsdp=True)),
    ("2x2x2", 15, dict(rotary_fraction=0.5, num_kv_heads=2),
     Execution(fsdp=True, scan_layers=True, sequence_parallel=True)),
    ("1x2x4", 9, dict(tie_embeddings=False, **SLIDING), Execution(sequence_parallel=True)),
]
RING = "ring"  # Execution(context_parallel=RING): the k/v blocks go around the ring
FAST_RING = [
    ("2x2x2", 13, dict(num_kv_heads=2), Execution(context_parallel=RING,
                                                  sequence_parallel=True)),
]
SLOW_RING = [
    ("1x3x2", 17, dict(num_kv_heads=3, qk_norm=True, norm="rmsnorm", mlp="swiglu"),
     Execution(context_parallel=RING, fsdp=True, sequence_parallel=True)),
    ("1x4x2", 14, dict(num_kv_heads=2, rotary_fraction=0.5),  # (a named policy)
     Execution(context_parallel=RING, scan_layers=True, remat="save_qkv_proj")),
    ("2x3x1", 14, dict(attn_softcap=5.0, **SLIDING),
     Execution(context_parallel=RING, scan_layers=True, remat="block", fsdp=True)),
    ("1x8x1", 11, dict(num_kv_heads=2, tie_embeddings=False),
     Execution(context_parallel=RING)),
]


@pytest.mark.parametrize("mesh_spec,seq_len,options,execution",
                         FAST + FAST_RING + [pytest.param(*case, marks=pytest.mark.slow)
                                             for case in SLOW + SLOW_RING])
def test_context_parallel_model_is_the_one_device_model(mesh_spec, seq_len, options, execution):
  _check_against_reference(mesh_spec, seq_len, options, execution)


@pytest.mark.parametrize("mesh_spec,options,strategy", [
    ("1x8x1", dict(num_kv_heads=2), "all_gather"),
    pytest.param("2x3x1", dict(attn_softcap=5.0, **SLIDING), "all_gather",
                 marks=pytest.mark.slow),
    pytest.param("1x4x2", dict(num_kv_heads=3, **SLIDING), RING, marks=pytest.mark.slow),
])
def test_dropout_masks_do_not_depend_on_the_context_split(mesh_spec, options, strategy):
  _check_against_reference(mesh_spec, 11, dict(dropout=0.1, **options),
                           Execution(context_parallel=strategy),
                           dropout_key=jax.random.key(3))


def _step_collectives(cfg, execution, mesh_spec="2x2x2"):
  """The collectives of a compiled train step on ``mesh_spec``, batch 8 x 13 tokens."""
  mesh = flax_tp.make_mesh(mesh_spec)
  trainer = Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0), execution=execution),
                    make_optimizer(lr=1e-3, steps=1))
  tokens = jax.random.randint(jax.random.key(1), (8, 14), 0, cfg.vocab_size)
  hlo = trainer.train_step.lower(trainer.params, trainer.init_opt_state(trainer.params),
                                 jax.device_put(tokens, trainer.batch_sharding),
                                 None).compile().as_text()
  return collectives(hlo, mesh)


def test_context_collectives_are_the_kv_gathers_and_one_gradient_reduction():
  """On 2x2x2, over "context" the compiled step holds one all-gather of k and one of v
  per block (forward), their transposes (reduce-scatters, backward), and one all-reduce
  over ("data", "context"): the gradients and the loss, together with data parallelism's."""
  layers = 2
  cfg = TransformerConfig.tiny(num_layers=layers)
  found = _step_collectives(cfg, Execution())
  over_context = [c for c in found if "context" in c.axes]
  split = ContextSplit(13, 2)
  kv_bytes = 4 * split.local_len * (cfg.num_heads // 2) * cfg.head_dim * 4  # b=4 rows, f32
  gathers = [c for c in over_context if c.kind == "all-gather"]
  scatters = [c for c in over_context if c.kind == "reduce-scatter"]
  reduces = [c for c in over_context if c.kind == "all-reduce"]
  assert len(gathers) == 2 * layers and all(c.axes == ("context",) for c in gathers)
  assert {c.bytes for c in gathers} == {2 * kv_bytes}  # the gathered k (or v)
  assert len(scatters) == 2 * layers and {c.bytes for c in scatters} == {kv_bytes}
  assert len(reduces) == 1 and reduces[0].axes == ("data", "context")
  assert len(over_context) == 4 * layers + 1
  # no collective over "data" alone is left: its reduction is the shared one
  assert not [c for c in found if c.axes == ("data",)]


def test_ring_collectives_are_the_block_shifts_and_one_gradient_reduction():
  """On 2x2x2 (C = 2) the ring moves each block's stacked k/v once forward (C - 1
  shifts) and its gradient home backward (C); the backward's own C - 1 shifts of k/v
  are, at C = 2 only, the forward's (both rings swap the two devices' blocks), and XLA
  keeps the forward's one block instead. Nothing is gathered over "context"; the
  gradients share data parallelism's one all-reduce."""
  layers = 2
  cfg = TransformerConfig.tiny(num_layers=layers)
  found = _step_collectives(cfg, Execution(context_parallel=RING))
  over_context = [c for c in found if "context" in c.axes]
  split = ContextSplit(13, 2)
  block = 2 * 4 * split.local_len * (cfg.num_heads // 2) * cfg.head_dim * 4  # k+v, b=4
  shifts = [c for c in over_context if c.kind == "collective-permute"]
  assert len(shifts) == (1 + 2) * layers
  assert {(c.axes, c.bytes) for c in shifts} == {(("context",), block)}
  reduces = [c for c in over_context if c.kind == "all-reduce"]
  assert len(reduces) == 1 and reduces[0].axes == ("data", "context")
  assert len(over_context) == len(shifts) + 1
  assert not [c for c in found if c.axes == ("data",)]


# A mixture of experts on a context mesh: every context shard's tokens routed, the
# padding slots in no expert's queue and no statistic, and a capacity's drops those of
# one device over the whole batch (the load-balancing loss is in both losses).
# With Execution(expert_axes=...) the experts split over data x context (each context
# shard's tokens dispatched to the experts on the others) or also over model (each
# expert whole on one device).
MOE = [
    ("2x2x2", 13, {}, Execution()),
]
SLOW_MOE = [
    ("2x2x2", 13, dict(expert_capacity_factor=0.75),
     Execution(sequence_parallel=True, expert_axes=("data", "context"))),
    ("1x4x2", 13, dict(expert_capacity_factor=1.0), Execution(sequence_parallel=True)),
    ("2x2x2", 11, dict(expert_capacity_factor=0.75, expert_drop_policy="position"),
     Execution(context_parallel=RING, sequence_parallel=True, scan_layers=True)),
    ("2x3x1", 14, dict(expert_capacity_factor=1.0, shared_expert_d_ff=20),
     Execution(fsdp=True, remat="block")),
    ("4x2x1", 9, dict(expert_capacity_factor=1.25), Execution(context_parallel=RING)),
    ("2x3x1", 14, dict(shared_expert_d_ff=20),
     Execution(fsdp=True, remat="block", expert_axes=("data", "context"))),
    ("1x4x2", 11, dict(expert_capacity_factor=1.0, expert_drop_policy="position"),
     Execution(context_parallel=RING, scan_layers=True, expert_axes=("data", "context", "model"))),
    ("2x2x2", 13, {}, Execution(sequence_parallel=True, expert_axes=("data", "model"))),
]


@pytest.mark.parametrize("mesh_spec,seq_len,options,execution",
                         MOE + [pytest.param(*case, marks=pytest.mark.slow)
                                for case in SLOW_MOE])
def test_a_mixture_of_experts_on_a_context_mesh_is_the_one_device_model(
    mesh_spec, seq_len, options, execution):
  _check_against_reference(mesh_spec, seq_len, options, execution, preset="moe-tiny")


def test_experts_over_data_and_context_dispatch_over_both_and_hold_a_share_each():
  """moe-tiny (6 experts, FFN 90) on 2x2x2 with the experts over data x context: each
  device holds 2 experts (6 over 4, padded) and half of their FFN, 1/(D*C*M) of the
  expert weights; the step's dispatch gathers the tokens and their routing over
  ("data", "context") together and reduce-scatters the outputs back, and no expert
  weight or gradient crosses a device. Over data alone, the experts are replicated over
  context and their gradients are all-reduced over it (the bytes this layout saves)."""
  cfg = TransformerConfig.preset("moe-tiny", num_layers=1)
  model = Transformer(cfg, mesh=flax_tp.make_mesh("2x2x2"), rngs=nnx.Rngs(0),
                      execution=Execution(expert_axes=("data", "context")))
  gate = model.blocks[0].mlp.gate[...]
  assert gate.addressable_shards[0].data.shape == (2, cfg.d_model, 45)
  expert_shapes = {(2, cfg.d_model, 45), (2, 45, cfg.d_model), tuple(gate.shape)}
  tokens = 8 * 14  # the step's rows and S + 1 tokens
  found = _step_collectives(cfg, Execution(expert_axes=("data", "context")))
  for c in found:
    assert not {shape for _, shape in c.operands} & expert_shapes, c
  dispatch = [(c.kind, c.operands[0][1]) for c in found if c.axes == ("data", "context")
              and c.kind in ("all-gather", "reduce-scatter")]
  slots = 4 * ContextSplit(14, 2).local_len  # this device's rows x slots
  assert sorted(dispatch) == sorted(
      [("all-gather", (2 * 2 * slots, cfg.d_model))] * 2  # tokens; output cotangents
      + [("all-gather", (2 * 2 * slots, 2))] * 3  # weights, experts, kept choices
      # outputs; token cotangents; the weights' cotangents
      + [("reduce-scatter", (slots, cfg.d_model))] * 2 + [("reduce-scatter", (slots, 2))])
  assert slots * 4 >= tokens
  assert not [c for c in found if c.axes == ("data",)]
  over_data = _step_collectives(cfg, Execution())
  context_sums = [shape for c in over_data if c.axes == ("context",) and c.kind == "all-reduce"
                  for _, shape in c.operands]
  assert sorted(context_sums) == sorted([(3, cfg.d_model, 45)] * 2 + [(3, 45, cfg.d_model)])


def test_a_capacity_on_a_context_mesh_drops_what_one_device_drops():
  """The drops (and every router statistic) of a step on 1x4x2 with a capacity that
  binds are those of the same model on 1x1 (one device, one dispatch of the whole
  batch), at a length 2C does not divide."""
  cfg = TransformerConfig.preset("moe-tiny", expert_capacity_factor=0.5)
  tokens = jax.random.randint(jax.random.key(2), (4, 14), 0, cfg.vocab_size)
  figures = []
  for spec in ("1x1", "1x4x2"):
    trainer = Trainer(Transformer(cfg, mesh=flax_tp.make_mesh(spec), rngs=nnx.Rngs(0)),
                      make_optimizer(lr=1e-3, steps=1))
    _, _, metrics = trainer.train_step(trainer.params, trainer.init_opt_state(trainer.params),
                                       jax.device_put(tokens, trainer.batch_sharding), None)
    figures.append({k: np.asarray(v) for k, v in metrics.items() if k != "grad_norm"})
  one, context = figures
  assert one["expert_dropped"] > 0  # the capacity binds
  assert one.keys() == context.keys()
  for name in one:
    np.testing.assert_allclose(context[name], one[name], rtol=1e-5, err_msg=name)


def test_the_strategy_is_a_field_named_in_its_error():
  assert Execution().context_parallel == "all_gather"
  assert "ring attention over context" in Execution(context_parallel=RING).describe()
  with pytest.raises(ValueError, match=r"one of \('all_gather', 'ring'\), got 'gather'"):
    Execution(context_parallel="gather")
