"""flax_tp/pipeline.py: the "stage" axis, where each stage's layers sit, and a pipelined
model exact against one device (logits, loss, every gradient, an optimizer step), at layer
counts the stages do not divide, with each other kind of parallelism."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_state_close

import flax_tp
from flax_tp.checkpoint import Checkpointer
from flax_tp.hlo import collectives
from flax_tp.param_info import ParamInfo
from flax_tp.pipeline import StagePlan, one_f_one_b, stash_slots
from models.config import TransformerConfig
from models.execution import Execution, unpipeline, view
from models.reference import ReferenceTransformer, reference_loss
from models.transformer import Transformer
from train.step import Trainer, make_optimizer

GPIPE, CIRCULAR, ONE_F_ONE_B = "gpipe", "circular", "1f1b"


# -- where the layers sit ----------------------------------------------------------


def test_a_stage_plan_places_every_layer_once_and_pads_with_identity_layers():
  """GPipe: consecutive layers per stage; circular: layer l on stage (l // G) mod S, each
  stage's groups in repeat order; identity layers (None) only where L is not divisible."""
  assert StagePlan.of(6, 3).slot_layers == (0, 1, 2, 3, 4, 5)
  gpipe = StagePlan.of(7, 3)
  assert (gpipe.group, gpipe.slots) == (3, 9)
  assert gpipe.slot_layers == (0, 1, 2, 3, 4, 5, 6, None, None)
  circular = StagePlan.of(5, 2, CIRCULAR)
  assert (circular.repeats, circular.group) == (3, 1)
  assert circular.slot_layers == (0, 2, 4, 1, 3, None)
  assert [circular.stage_layers(s) for s in range(2)] == [[0, 2, 4], [1, 3]]
  two_per_group = StagePlan.of(8, 2, CIRCULAR, repeats=2)
  assert two_per_group.slot_layers == (0, 1, 4, 5, 2, 3, 6, 7)
  for layers in range(1, 12):
    for stages in (2, 3, 4, 8):
      for plan in (StagePlan.of(layers, stages), StagePlan.of(layers, stages, CIRCULAR)):
        held = [layer for layer in plan.slot_layers if layer is not None]
        assert sorted(held) == list(range(layers))  # each layer once
        assert len(plan.slot_layers) == plan.slots == stages * plan.repeats * plan.group
        assert plan.slots - layers < stages * plan.repeats  # less than one layer per group
  assert StagePlan.of(5, 2, CIRCULAR).describe(2) == (
      "pipeline of 2 stages (circular, 3 groups per stage), 2 microbatches, bubble 14%; "
      "stage 0: layers 0,2,4; stage 1: layers 1,3 + 1 identity")
  assert StagePlan.of(7, 3).describe(4) == (
      "pipeline of 3 stages (gpipe), 4 microbatches, bubble 33%; stage 0: layers 0-2; "
      "stage 1: layers 3-5; stage 2: layers 6 + 2 identity")
  assert "circular, 1 group per stage: the same as gpipe" in StagePlan.of(2, 2, CIRCULAR).describe(1)


@pytest.mark.parametrize("stages,microbatches,repeats", [
    (2, 1, 1), (2, 4, 1), (4, 4, 1), (3, 7, 1), (2, 2, 3), (4, 4, 2), (4, 8, 3), (3, 2, 2),
])
def test_the_bubble_is_the_idle_share_of_the_iterations(stages, microbatches, repeats):
  """Counted from the schedule itself (which (repeat, microbatch) each stage runs at each
  iteration), and (S - 1) / (R * M + S - 1) whenever M >= S or R = 1."""
  plan = StagePlan(layers=stages * repeats, stages=stages, repeats=repeats,
                   schedule=GPIPE if repeats == 1 else CIRCULAR)
  period = plan.period(microbatches)
  busy, done = 0, set()
  for t in range(plan.iterations(microbatches)):
    for s in range(stages):
      repeat, m = divmod(t - s, period)
      if t - s >= 0 and repeat < repeats and m < microbatches:
        busy += 1
        done.add((s, repeat, m))
  assert len(done) == stages * repeats * microbatches  # every group ran every microbatch
  assert plan.bubble(microbatches) == pytest.approx(
      1 - busy / (stages * plan.iterations(microbatches)))
  if microbatches >= stages or repeats == 1:
    assert plan.bubble(microbatches) == pytest.approx(
        (stages - 1) / (repeats * microbatches + stages - 1))


@pytest.mark.parametrize("stages,microbatches", [
    (2, 1), (2, 4), (3, 2), (3, 5), (4, 4), (4, 9), (8, 3), (8, 16)])
def test_1f1b_runs_each_microbatch_forward_then_backward_keeping_few_inputs(stages,
                                                                            microbatches):
  """The 1F1B schedule simulated from ``one_f_one_b`` as the step's scan runs it: each
  stage runs every microbatch forward once and backward once; a forward at stage s + 1
  follows the one at s by an iteration, a backward at s the one at s + 1 (on the last
  stage, the iteration of its forward); the input a stage keeps in slot ``m % K`` is
  still there when its backward reads it; and no stage holds more than K = min(M, 2S - 1)
  inputs at once (stage 0 that many whenever M >= 2S - 1), where GPipe keeps all M."""
  S, M = stages, microbatches
  K = stash_slots(StagePlan.of(S, S), M)
  assert K == min(M, 2 * S - 1)
  forward, backward, slots, held = {}, {}, [{} for _ in range(S)], [set() for _ in range(S)]
  peak = [0] * S
  for t in range(M + 2 * (S - 1)):
    for s in range(S):
      (f, f_real), (b, b_real) = one_f_one_b(t, s, S, M)
      if f_real:
        assert (s, f) not in forward
        forward[s, f] = t
        slots[s][f % K] = f
        held[s].add(f)
        peak[s] = max(peak[s], len(held[s]))
      if b_real:
        assert (s, b) not in backward and slots[s][b % K] == b  # its input, not another's
        backward[s, b] = t
        held[s].remove(b)
  everything = {(s, m) for s in range(S) for m in range(M)}
  assert set(forward) == set(backward) == everything
  for s, m in everything:
    assert backward[s, m] >= forward[s, m]
    if s + 1 < S:
      assert forward[s + 1, m] == forward[s, m] + 1
      assert backward[s, m] == backward[s + 1, m] + 1
    else:
      assert backward[s, m] == forward[s, m]
  assert max(peak) <= K
  if M >= 2 * S - 1:
    assert peak[0] == K


def test_bad_pipeline_options_are_refused_naming_the_value():
  with pytest.raises(ValueError, match="pipeline_schedule must be one of .* got '1F1B'"):
    Execution(pipeline_schedule="1F1B")
  with pytest.raises(ValueError, match="pipeline_repeats=2 is for the circular schedule"):
    Execution(pipeline_repeats=2)
  with pytest.raises(ValueError, match="pipeline_repeats=3 is for the circular schedule; "
                     "1f1b holds one group"):
    Execution(pipeline_schedule=ONE_F_ONE_B, pipeline_repeats=3)
  with pytest.raises(ValueError, match="microbatches must be a positive integer, got 0"):
    Execution(microbatches=0)
  with pytest.raises(ValueError, match="pipeline_repeats must be a positive integer"):
    Execution(pipeline_schedule=CIRCULAR, pipeline_repeats=0)


def test_the_stage_axis_comes_first_in_any_spelling():
  """The named form in any order; "stage" varies slowest (it may span nodes); a stage of 1
  is no axis, as context's."""
  mesh = flax_tp.make_mesh("model=2,stage=2,data=2")
  assert mesh.axis_names == ("stage", "data", "model")
  assert mesh.devices.shape == (2, 2, 2)
  assert flax_tp.MeshAxes.of(mesh) == flax_tp.MeshAxes(stage=2, data=2, model=2)
  assert [d.id for d in mesh.devices[0].flat] == [0, 1, 2, 3]  # stage 0: the first half
  assert flax_tp.make_mesh("stage=1,data=2,model=4").axis_names == ("data", "model")
  assert flax_tp.make_mesh("stage=2,context=2,model=2").axis_names == (
      "stage", "data", "context", "model")
  assert str(flax_tp.MeshAxes.parse("stage=4,model=2")) == "stage=4,data=1,model=2"
  with pytest.raises(ValueError, match="axis 'stage' has 0 devices"):
    flax_tp.make_mesh("stage=0,model=2")


# -- exact against one device -----------------------------------------------------


@functools.cache
def _reference(preset, layers, options, seq_len, dropout, microbatches=1, batch=4):
  """The plain-Flax reference's params, loss and gradients (and logits) on one device
  (``microbatches``: a mixture of experts routes each on its own)."""
  cfg = TransformerConfig.preset(preset, num_layers=layers, **dict(options))
  tokens = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, cfg.vocab_size)
  key = jax.random.key(3) if dropout else None
  reference = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(reference, nnx.Param)
  loss, grads = jax.jit(jax.value_and_grad(lambda p: reference_loss(
      nnx.merge(graphdef, p), tokens, dropout_key=key, microbatches=microbatches)))(params)
  logits = None if cfg.has_experts else reference(tokens[:, :-1])
  return cfg, tokens, key, reference, logits, loss, grads


def _check_against_reference(mesh_spec, layers, execution, preset="tiny", options=(),
                             seq_len=7, dropout=False, batch=4):
  """The pipelined model's params, logits, loss and every gradient against the plain-Flax
  reference's on one device."""
  experts = TransformerConfig.preset(preset).has_experts
  cfg, tokens, key, reference, logits, loss, grads = _reference(
      preset, layers, tuple(options), seq_len, dropout,
      execution.microbatches if experts else 1, batch)
  model = Transformer(cfg, mesh=flax_tp.make_mesh(mesh_spec), rngs=nnx.Rngs(0),
                      execution=execution)
  # a stage axis pipelines the model on its own; without one, microbatches accumulate
  assert (model.pipeline is not None) == (flax_tp.MeshAxes.parse(mesh_spec).stage > 1)
  assert_state_close(model, reference, rtol=0, atol=0)
  if logits is not None:
    np.testing.assert_allclose(jax.jit(lambda t: model(t))(tokens[:, :-1]), logits,
                               rtol=1e-5, atol=1e-5)
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
  assert trainer.accumulation == (1 if model.pipeline else execution.microbatches)
  got_loss, got_grads = trainer.loss_and_grads(
      trainer.params, jax.device_put(tokens, trainer.batch_sharding), key)
  np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
  assert_state_close(got_grads, grads, rtol=1e-4, atol=1e-6)
  return trainer, tokens


MESHES = ("stage=2,data=2,model=2", "stage=4,model=2", "stage=3,model=2", "stage=8")


def _microbatches(mesh_spec):
  """The most microbatches the 4-row batch gives each data shard (at least the stages
  where it can: the circular schedule's period)."""
  return 4 // flax_tp.MeshAxes.parse(mesh_spec).data


FAST = [("stage=2,data=2,model=2", 5, CIRCULAR), ("stage=4,model=2", 6, ONE_F_ONE_B)]


def _layouts(mesh_spec, schedule, counts=range(4, 9)):
  """One layer count of ``counts`` per kind of layout the plan gives on this mesh: whether
  a group is all identity layers (a stage, or a repeat of one, with nothing to run),
  whether a group mixes real and identity layers, whether a group holds several layers.
  Counts of one kind compile the same program shapes with other numbers; the plan's
  arithmetic at every count is tested on its own above."""
  stages = flax_tp.MeshAxes.parse(mesh_spec).stage
  kinds = {}
  for layers in counts:
    plan = StagePlan.of(layers, stages, schedule)
    slots = plan.slot_layers
    groups = [slots[i:i + plan.group] for i in range(0, len(slots), plan.group)]
    kind = (any(all(s is None for s in g) for g in groups),
            any(None in g and any(s is not None for s in g) for g in groups), plan.group > 1)
    kinds.setdefault(kind, layers)
  return sorted(kinds.values())
# 1F1B runs GPipe's layout (each kind of its padding is run below) on a schedule that
# depends on S and M alone: per mesh one count leaving identity layers.
ONE_F_ONE_B_LAYERS = {"stage=2,data=2,model=2": (5,), "stage=4,model=2": (6,),
                      "stage=3,model=2": (5,), "stage=8": (7,)}


@pytest.mark.parametrize("mesh_spec,layers,schedule", FAST + [
    pytest.param(mesh_spec, layers, schedule, marks=pytest.mark.slow)
    for mesh_spec in MESHES for schedule in (GPIPE, CIRCULAR)
    for layers in _layouts(mesh_spec, schedule) if (mesh_spec, layers, schedule) not in FAST] + [
    pytest.param(mesh_spec, layers, ONE_F_ONE_B, marks=pytest.mark.slow)
    for mesh_spec in MESHES for layers in ONE_F_ONE_B_LAYERS[mesh_spec]
    if (mesh_spec, layers, ONE_F_ONE_B) not in FAST])
def test_a_pipelined_model_is_exact_at_any_layer_count(mesh_spec, layers, schedule):
  _check_against_reference(mesh_spec, layers, Execution(
      microbatches=_microbatches(mesh_spec), pipeline_schedule=schedule))


@pytest.mark.parametrize("mesh_spec,layers,options,execution", [
    # FSDP over data per stage, each block recomputed in backward, Megatron's sequence
    # parallelism, grouped-query attention
    pytest.param("stage=2,data=2,model=2", 6,
                 dict(num_kv_heads=2, mlp="swiglu", norm="rmsnorm"),
                 Execution(microbatches=2, fsdp=True, remat="block", sequence_parallel=True),
                 marks=pytest.mark.slow),
    pytest.param("stage=2,data=2,model=2", 5, (), Execution(
        microbatches=2, pipeline_schedule=CIRCULAR, fsdp=True, remat="block"),
        marks=pytest.mark.slow),
    # a context axis: each stage's microbatches split over it as the unpipelined model's
    pytest.param("stage=2,context=2,model=2", 5, (), Execution(
        microbatches=2, pipeline_schedule=CIRCULAR), marks=pytest.mark.slow),
    pytest.param("stage=2,context=2,model=2", 4, (), Execution(
        microbatches=2, context_parallel="ring", fsdp=True), marks=pytest.mark.slow),
    # 1F1B: each stage's forward recomputed in its backward from the kept input, with
    # FSDP's gathers, remat and sequence parallelism inside
    pytest.param("stage=2,data=2,model=2", 5,
                 dict(num_kv_heads=2, mlp="swiglu", norm="rmsnorm"),
                 Execution(microbatches=2, pipeline_schedule=ONE_F_ONE_B, fsdp=True,
                           remat="block", sequence_parallel=True, loss_chunks=2),
                 marks=pytest.mark.slow),
    # (ring attention's ppermutes inside a stage: run masked, never skipped by a cond)
    pytest.param("stage=2,context=2,model=2", 5, (), Execution(
        microbatches=2, pipeline_schedule=ONE_F_ONE_B, context_parallel="ring", fsdp=True),
        marks=pytest.mark.slow),
    # two microbatches per stage pass (repeats 2 of groups of 2 layers)
    pytest.param("stage=2,data=2,model=2", 7, (), Execution(
        microbatches=1, pipeline_schedule=CIRCULAR, pipeline_repeats=2),
        marks=pytest.mark.slow),
])
def test_a_pipeline_composes_with_the_other_parallelisms(mesh_spec, layers, options,
                                                         execution):
  _check_against_reference(mesh_spec, layers, execution, options=tuple(options.items())
                           if isinstance(options, dict) else options,
                           seq_len=9 if "context" in mesh_spec else 7)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [GPIPE, CIRCULAR])
def test_a_pipelined_mixture_of_experts_is_exact(schedule):
  """Each microbatch's load-balancing loss from its own routing (over every layer, on
  whichever stage), their mean added: the plain-Flax reference run per microbatch."""
  _check_against_reference("stage=2,data=2,model=2", 3, Execution(
      microbatches=2, pipeline_schedule=schedule), preset="moe-tiny")


# A capacity that drops (0.5 of an even share): what a microbatch drops depends on which
# rows it holds, so these tell apart a split that depends on the mesh.
DROPPING = (("expert_capacity_factor", 0.5),)


@pytest.mark.parametrize("mesh_spec,preset,options,execution,dropout", [
    # Without a stage axis, microbatches are gradient accumulation: a dense model's step
    # is the whole batch's (within float rounding), on an uneven mesh...
    ("1x3", "tiny", (), Execution(microbatches=2), False),
    # ... and a mixture of experts routes, caps and balances each microbatch on its own,
    # as a pipeline's stages do: the same rows whatever the data axis, so every mesh
    # gives the per-microbatch reference, and so each other's (the pair).
    # (the head by pieces: the S + 1 tokens a MoE runs, its last one scored nothing;
    # the slow lane, beside the other meshes: the fast lane's MoE case is the stage mesh's)
    pytest.param("2x4", "moe-tiny", DROPPING, Execution(microbatches=2, loss_chunks=2), False,
                 marks=pytest.mark.slow),
    ("stage=2,data=2,model=2", "moe-tiny", DROPPING, Execution(microbatches=2), False),
    pytest.param("1x1", "moe-tiny", DROPPING, Execution(microbatches=4), False,
                 marks=pytest.mark.slow),
    pytest.param("2x2x2", "moe-tiny", DROPPING + (("expert_drop_policy", "position"),),
                 Execution(microbatches=2, sequence_parallel=True), False,
                 marks=pytest.mark.slow),
    pytest.param("model=2,stage=2,data=2", "moe-tiny", DROPPING,
                 Execution(microbatches=2, pipeline_schedule=CIRCULAR), False,
                 marks=pytest.mark.slow),
    # dropout's masks keyed by each row's global id: the whole batch's masks
    pytest.param("2x4", "tiny", (("dropout", 0.1),), Execution(microbatches=2, fsdp=True,
                                                               remat="block"), True,
                 marks=pytest.mark.slow),
])
def test_microbatches_are_the_same_rows_on_every_mesh(mesh_spec, preset, options, execution,
                                                      dropout):
  # 8 rows: each data shard's microbatch holds several (rows m, m + M, ..., not a block)
  trainer, tokens = _check_against_reference(mesh_spec, 3, execution, preset=preset,
                                             options=options, dropout=dropout, batch=8)
  if TransformerConfig.preset(preset).has_experts:  # (the capacity does drop)
    _, _, out = trainer.train_step(trainer.params, trainer.init_opt_state(trainer.params),
                                   jax.device_put(tokens, trainer.batch_sharding), None)
    assert float(out["expert_dropped"]) > 0.1


def test_1f1b_refuses_a_mixture_of_experts_naming_why():
  with pytest.raises(ValueError, match="'1f1b' takes each microbatch's loss as it leaves "
                     "the last stage, and a mixture of experts' load-balancing loss"):
    Transformer(TransformerConfig.preset("moe-tiny", num_layers=2),
                mesh=flax_tp.make_mesh("stage=2,model=2"), rngs=nnx.Rngs(0),
                execution=Execution(microbatches=2, pipeline_schedule=ONE_F_ONE_B))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [CIRCULAR, ONE_F_ONE_B])
def test_dropout_masks_do_not_depend_on_the_stages(schedule):
  _check_against_reference("stage=2,data=2,model=2", 4, Execution(
      microbatches=2, pipeline_schedule=schedule), options=(("dropout", 0.1),), dropout=True)


def _perturbed_adapters(model, seed=5):
  """``model``'s logical params with every adapter's B drawn at random (a fresh B is
  zero, and A's gradient with it)."""
  state = flax_tp.unshard(model)
  flat = nnx.to_flat_state(state)
  for i, (path, var) in enumerate(flat):
    if path[-1] == "lora_b":
      var.set_value(0.1 * jax.random.normal(jax.random.key(seed + i), var[...].shape))
  return nnx.from_flat_state(flat)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [CIRCULAR, ONE_F_ONE_B])
def test_lora_on_a_pipelined_model_is_exact_against_one_device(schedule):
  """Adapters stacked and split over the stages as their base: the adapters' gradients
  (the base frozen) as on 1x1."""
  cfg = TransformerConfig.preset("llama-tiny", num_layers=3)
  lora = flax_tp.LoRAConfig(rank=3, targets=("blocks.*.attn.[qkvo]", "blocks.*.mlp.*"))
  tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, cfg.vocab_size)
  results = []
  for spec, execution in (("1x1", Execution()), ("stage=2,data=2,model=2", Execution(
      microbatches=2, pipeline_schedule=schedule))):
    model = Transformer(cfg, mesh=flax_tp.make_mesh(spec), rngs=nnx.Rngs(0),
                        execution=execution, lora=lora)
    if not results:
      adapted = _perturbed_adapters(model)
    flax_tp.load_unsharded(model, adapted)
    trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
    results.append(trainer.loss_and_grads(
        trainer.params, jax.device_put(tokens, trainer.batch_sharding), None))
  (one_loss, one_grads), (loss, grads) = results
  np.testing.assert_allclose(loss, one_loss, rtol=1e-6)
  assert nnx.to_flat_state(grads)  # the adapters' gradients
  assert_state_close(grads, flax_tp.unshard(one_grads), rtol=1e-4, atol=1e-6)


# -- training and checkpoints ----------------------------------------------------


@pytest.mark.parametrize("schedule", [CIRCULAR, pytest.param(ONE_F_ONE_B,
                                                              marks=pytest.mark.slow)])
def test_a_step_updates_as_on_one_device_and_checkpoints_move_between_meshes(tmp_path,
                                                                           schedule):
  """One AdamW step pipelined (5 layers: one identity layer; with FSDP) equals it on
  1x1; the identity layer's params and moments stay zero; its checkpoint holds the
  model's 5 layers and restores on 1x8 and on another pipeline's stages, and back."""
  cfg = TransformerConfig.preset("tiny", num_layers=5)
  tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, cfg.vocab_size)

  def trainer(spec, execution=Execution()):
    model = Transformer(cfg, mesh=flax_tp.make_mesh(spec), rngs=nnx.Rngs(0),
                        execution=execution)
    return Trainer(model, make_optimizer(lr=1e-2, steps=2, warmup_steps=0))

  def step(t):
    params, opt_state, metrics = t.train_step(
        t.params, t.init_opt_state(t.params), jax.device_put(tokens, t.batch_sharding), None)
    return params, opt_state, metrics

  pipelined = trainer("stage=2,data=2,model=2", Execution(
      microbatches=2, pipeline_schedule=schedule, fsdp=True))
  one = trainer("1x1")
  params, opt_state, metrics = step(pipelined)
  one_params, _, one_metrics = step(one)
  np.testing.assert_allclose(metrics["loss"], one_metrics["loss"], rtol=1e-6)
  np.testing.assert_allclose(metrics["grad_norm"], one_metrics["grad_norm"], rtol=1e-5)
  # AdamW's first update is lr * g / (|g| + eps): +-lr wherever |g| >> eps, so a wrong
  # gradient moves a param by up to 2 lr = 2e-2; float noise on a gradient near zero
  # moves it by a little of lr.
  assert_state_close(params, flax_tp.unshard(one_params), rtol=0, atol=1e-4)
  identity = StagePlan.of(5, 2, schedule).slot_layers.index(None)
  is_var = lambda x: isinstance(x, nnx.Variable)
  slotted = [var for var in jax.tree.leaves((params, opt_state), is_leaf=is_var)
             if is_var(var) and ParamInfo.of(var).layer_slots is not None]
  assert len(slotted) == 3 * len(jax.tree.leaves(nnx.state(pipelined.model(params).blocks)))
  for var in slotted:  # params, AdamW's two moments
    assert not np.any(np.asarray(var[...])[identity]), "an identity layer moved"

  ck = Checkpointer(tmp_path / "ck")
  ck.save(1, {"params": params, "opt_state": opt_state}, {"step": 1})
  for spec, execution in (("1x8", Execution()), ("stage=4,model=2", Execution(
      microbatches=4))):
    target = trainer(spec, execution)
    restored, _ = ck.restore({"params": target.params,
                              "opt_state": target.init_opt_state(target.params)})
    assert_state_close(restored["params"], flax_tp.unshard(params), rtol=0, atol=0)
  back = Checkpointer(tmp_path / "back")
  back.save(1, {"params": one_params}, {"step": 1})
  again = trainer("stage=2,data=2,model=2", Execution(microbatches=2,
                                                         pipeline_schedule=CIRCULAR))
  restored, _ = back.restore({"params": again.params})
  assert_state_close(restored["params"], flax_tp.unshard(one_params), rtol=0, atol=0)


def test_a_pipelined_model_decodes_unpipelined_and_refuses_a_mixed_model():
  """The KV-cached decoder runs layer by layer: on the pipelined model it says what to
  do, and ``unpipeline`` (the same params, replicated over "stage") decodes as 1x1."""
  from models.generate import generate
  cfg = TransformerConfig.preset("tiny", num_layers=3)
  model = Transformer(cfg, mesh=flax_tp.make_mesh("stage=2,data=2,model=2"),
                      rngs=nnx.Rngs(0), execution=Execution(microbatches=2))
  one = Transformer(cfg, mesh=flax_tp.make_mesh("1x1"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="decode models.execution.unpipeline"):
    generate(model, [[1, 2, 3]], max_new_tokens=2)
  with pytest.raises(ValueError, match="a view keeps the pipeline's stages"):
    view(model, Execution(microbatches=2, pipeline_schedule=CIRCULAR))
  unpipeline(model)
  assert model.pipeline is None
  np.testing.assert_array_equal(generate(model, [[1, 2, 3], [4]], max_new_tokens=4),
                                generate(one, [[1, 2, 3], [4]], max_new_tokens=4))
  mixed = TransformerConfig.preset("moe-tiny", moe_layers=(1,))
  with pytest.raises(ValueError, match="mixes dense and mixture-of-experts layers"):
    Transformer(mixed, mesh=flax_tp.make_mesh("stage=2,model=2"), rngs=nnx.Rngs(0))
  plain = Transformer(cfg, mesh=flax_tp.make_mesh("stage=2,model=2"), rngs=nnx.Rngs(0),
                      execution=Execution(microbatches=3))
  with pytest.raises(ValueError, match="a batch of 4 rows .* does not split into 3 "
                     "microbatches"):
    jax.jit(lambda t: plain(t))(jnp.zeros((4, 5), jnp.int32))


# -- what crosses the stage axis --------------------------------------------------


@pytest.mark.parametrize("schedule", [GPIPE, pytest.param(CIRCULAR, marks=pytest.mark.slow),
                                      pytest.param(ONE_F_ONE_B, marks=pytest.mark.slow)])
def test_over_stage_a_step_sends_activations_and_their_cotangents_only(schedule):
  """On stage=2,data=2,model=2 the compiled step's collectives over "stage" are one
  collective-permute of a microbatch's activation [b/M, s, d] forward and one of its
  cotangent backward (each run every iteration, inside the scan), then GPipe's and the
  circular schedule's last stage's output all-reduced to every stage [b, s, d] and its
  transpose for the embedding's cotangent; 1F1B's stage 0's input cotangents [b, s, d]
  and the last stage's gradients of the head and final norm (one all-reduce together);
  and scalars: no block's gradient crosses stages."""
  cfg = TransformerConfig.preset("tiny", num_layers=4)
  mesh = flax_tp.make_mesh("stage=2,data=2,model=2")
  microbatches = 2
  trainer = Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0), execution=Execution(
      microbatches=microbatches, pipeline_schedule=schedule)), make_optimizer(lr=1e-3, steps=1))
  tokens = jax.random.randint(jax.random.key(1), (8, 14), 0, cfg.vocab_size)
  hlo = trainer.train_step.lower(trainer.params, trainer.init_opt_state(trainer.params),
                                 jax.device_put(tokens, trainer.batch_sharding),
                                 None).compile().as_text()
  over_stage = [c for c in collectives(hlo, mesh) if "stage" in c.axes]
  rows = 8 // 2  # per data shard
  activation = (rows // microbatches) * 13 * cfg.d_model * 4
  permutes = [c for c in over_stage if c.kind == "collective-permute"]
  assert [(c.axes, c.bytes) for c in permutes] == [(("stage",), activation)] * 2
  reduces = [c for c in over_stage if c.kind == "all-reduce" and c.bytes > 8]
  if schedule == ONE_F_ONE_B:
    tail = nnx.state(trainer.model(trainer.params), nnx.Param)
    tail = [tail["embed"], tail["ln_f"]]  # (tiny ties its head to the embedding)
    tail_bytes = sum(v[...].addressable_shards[0].data.nbytes
                     for v in jax.tree.leaves(tail))
    assert [c.axes for c in reduces] == [("stage",)]
    assert 0 <= reduces[0].bytes - microbatches * activation - tail_bytes <= 8  # (+ loss)
  else:
    assert [(c.axes, c.bytes) for c in reduces] == [(("stage",), microbatches * activation)] * 2
  assert len(over_stage) - len(permutes) - len(reduces) <= 2  # scalars
  assert {c.kind for c in over_stage} <= {"collective-permute", "all-reduce"}
