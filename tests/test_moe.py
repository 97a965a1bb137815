"""flax_tp.MoE against a loop over experts in plain JAX (MaxText's MoeLoopBlock idea):
outputs, router statistics and losses, and every param's gradient, on meshes whose
axes divide neither the experts nor the FFN width."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_tp
from flax_tp.moe import (
  MoE,
  RouterStats,
  grouped_swiglu,
  load_balancing_loss,
  route,
  router_z_loss,
)

D_MODEL, D_FF, EXPERTS, TOP_K, SHARED_FF = 12, 10, 6, 2, 7
TOKENS = 24  # divisible by every data axis below


def loop_moe(p: dict, x, top_k: int, normalize: bool, capacity=None, policy="probs"):
  """The reference: every expert on every token, weighted by the routing (zero where a
  token did not choose it, or, with a ``capacity``, where its expert dropped the choice:
  ``models.reference.capacity_kept``); the shared expert as a plain SwiGLU with its
  sigmoid gate."""
  from models.reference import capacity_kept
  logits = x @ p["router"]
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if normalize:
    weights = weights / weights.sum(-1, keepdims=True)
  if capacity is not None:
    weights = jnp.where(capacity_kept(experts, weights, capacity, policy), weights, 0)
  y = jnp.zeros_like(x)
  for e in range(p["gate"].shape[0]):
    out = (jax.nn.silu(x @ p["gate"][e]) * (x @ p["up"][e])) @ p["down"][e]
    y = y + jnp.sum(jnp.where(experts == e, weights, 0), -1)[:, None] * out
  if "shared_gate" in p:
    shared = (jax.nn.silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_down"]
    y = y + jax.nn.sigmoid(x @ p["shared_expert_gate"]) * shared
  # transformers' load_balancing_loss_func, written as it is there.
  mask = jax.nn.one_hot(experts, probs.shape[-1])  # [t, k, E]
  aux = jnp.sum(jnp.mean(mask, 0) * jnp.mean(probs, 0)[None]) * probs.shape[-1]
  z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
  return y, aux, z


def logical_params(moe: MoE) -> dict:
  state = flax_tp.unshard(moe)
  out = {k: jnp.asarray(state[k][...]) for k in ("router", "gate", "up", "down")}
  if moe.shared_d_ff:
    out.update(shared_gate=state["shared_gate"]["kernel"][...],
               shared_up=state["shared_up"]["kernel"][...],
               shared_down=state["shared_down"]["kernel"][...],
               shared_expert_gate=state["shared_expert_gate"][...])
  return out


def flat_grads(grads) -> dict:
  state = flax_tp.unshard(grads)
  flat = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(state)}
  rename = {"shared_gate.kernel": "shared_gate", "shared_up.kernel": "shared_up",
            "shared_down.kernel": "shared_down"}
  return {rename.get(k, k): v for k, v in flat.items()}


def make_inputs():
  return jax.random.normal(jax.random.key(1), (TOKENS // 4, 4, D_MODEL))  # [b, s, d]


@pytest.mark.parametrize("mesh_spec,normalize,shared", [
    ("1x1", True, False), ("1x3", False, True), ("2x4", True, True), ("1x8", True, False),
    ("4x2", False, True), ("8x1", True, False)])
def test_moe_equals_a_loop_over_experts(meshes, mesh_spec, normalize, shared):
  mesh = meshes[mesh_spec]
  moe = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=mesh, normalize_top_k=normalize,
            shared_d_ff=SHARED_FF if shared else None, rngs=nnx.Rngs(0))
  p = logical_params(moe)
  # The same draws whatever the mesh: the params are drawn whole, then placed.
  ref_moe = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=meshes["1x1"], normalize_top_k=normalize,
                shared_d_ff=SHARED_FF if shared else None, rngs=nnx.Rngs(0))
  for name, value in logical_params(ref_moe).items():
    np.testing.assert_array_equal(p[name], value, err_msg=name)
  x = make_inputs()
  tokens = x.reshape(-1, D_MODEL)
  # Top-k on near-ties would make the choice fragile: these inputs' margins between
  # the k-th and the (k+1)-th probability are checked to be far above rounding.
  probs = np.sort(np.asarray(jax.nn.softmax(tokens @ p["router"], -1)), -1)[:, ::-1]
  assert np.min(probs[:, TOP_K - 1] - probs[:, TOP_K]) > 1e-4

  y, stats = jax.jit(lambda m, x: m(x))(moe, x)
  ref_y, ref_aux, ref_z = jax.jit(loop_moe, static_argnums=(2, 3))(p, tokens, TOP_K, normalize)
  np.testing.assert_allclose(y.reshape(-1, D_MODEL), ref_y, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(load_balancing_loss(stats), ref_aux, rtol=1e-6)
  np.testing.assert_allclose(router_z_loss(stats), ref_z, rtol=1e-6)
  assert float(stats.tokens) == TOKENS and float(stats.counts.sum()) == TOKENS * TOP_K

  def loss(m):
    y, stats = m(x)
    return jnp.sum(y * jnp.cos(y)) + 0.1 * load_balancing_loss(stats) + 0.01 * router_z_loss(stats)

  def ref_loss(p):
    y, aux, z = loop_moe(p, tokens, TOP_K, normalize)
    return jnp.sum(y * jnp.cos(y)) + 0.1 * aux + 0.01 * z

  grads = flat_grads(jax.jit(nnx.grad(loss))(moe))
  ref_grads = jax.jit(jax.grad(ref_loss))(p)
  assert set(grads) == set(ref_grads)
  for name, g in ref_grads.items():
    # float32 sums in another order: within 1e-5 of the gradient's own scale.
    np.testing.assert_allclose(grads[name], g, rtol=2e-5, atol=1e-5 * np.abs(g).max(),
                               err_msg=name)
    assert np.abs(g).max() > 1e-4, name  # every param's gradient is exercised


@pytest.mark.parametrize("mesh_spec,policy,factor", [
    ("1x1", "probs", 1.0), ("2x4", "position", 1.0), ("4x2", "probs", 0.5),
    ("8x1", "position", 1.25), ("1x3", "probs", 3.0)])
def test_capacity_drops_the_choices_the_policy_says(meshes, mesh_spec, policy, factor):
  """With a capacity factor each expert keeps ceil(factor * 24 * 2 / 6) choices of the
  24 tokens (whatever the mesh: the dispatch sees every shard's tokens), by weight or by
  position; the output, the dropped count and every gradient equal the loop's with the
  same choices zeroed. Factor 3 = E / k keeps everything: equal to the dropless MoE."""
  from flax_tp.moe import expert_capacity
  from models.reference import capacity_kept
  mesh = meshes[mesh_spec]
  moe = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=mesh, shared_d_ff=SHARED_FF,
            capacity_factor=factor, drop_policy=policy, rngs=nnx.Rngs(0))
  p = logical_params(moe)
  x = make_inputs()
  tokens = x.reshape(-1, D_MODEL)
  capacity = expert_capacity(TOKENS, TOP_K, EXPERTS, factor)
  assert capacity == -(-int(factor * TOKENS * TOP_K) // EXPERTS)
  weights, experts = jax.lax.top_k(jax.nn.softmax(tokens @ p["router"], -1), TOP_K)
  weights = weights / weights.sum(-1, keepdims=True)
  kept = np.asarray(capacity_kept(experts, weights, capacity, policy))
  if factor < EXPERTS / TOP_K:
    assert (~kept).sum() > 0  # the routing overflows some expert: drops are exercised
  else:
    assert kept.all()

  y, stats = jax.jit(lambda m, x: m(x))(moe, x)
  ref_y, ref_aux, _ = loop_moe(p, tokens, TOP_K, True, capacity, policy)
  np.testing.assert_allclose(y.reshape(-1, D_MODEL), ref_y, rtol=1e-5, atol=1e-6)
  assert float(stats.dropped) == (~kept).sum()
  # the load-balancing loss sees the routing before any drop (Megatron's too)
  np.testing.assert_allclose(load_balancing_loss(stats), ref_aux, rtol=1e-6)
  if kept.all():
    dropless = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=mesh, shared_d_ff=SHARED_FF,
                   rngs=nnx.Rngs(0))
    np.testing.assert_allclose(y, jax.jit(lambda m, x: m(x)[0])(dropless, x), rtol=1e-5,
                               atol=1e-6)
  np.testing.assert_allclose(jax.jit(lambda m, x: m(x, dropless=True)[0])(moe, x),
                             loop_moe(p, tokens, TOP_K, True)[0].reshape(x.shape), rtol=1e-5,
                             atol=1e-6)

  grads = flat_grads(jax.jit(nnx.grad(lambda m: jnp.sum(m(x)[0] * jnp.cos(m(x)[0]))))(moe))
  ref_grads = jax.grad(lambda p: jnp.sum(
      (r := loop_moe(p, tokens, TOP_K, True, capacity, policy)[0]) * jnp.cos(r)))(p)
  for name, g in ref_grads.items():
    np.testing.assert_allclose(grads[name], g, rtol=2e-5, atol=1e-5 * np.abs(g).max(),
                               err_msg=name)


# Experts over other axes than "data" (Execution.expert_axes): over data x context (each
# context shard's tokens reach the experts on the others; here a standalone call, the
# tokens the same on every context shard, so each runs its own experts and the outputs
# are summed), and over data x model (each expert whole on one device, its FFN not
# split). 6 experts over 4 and 8 devices: padded with zero experts.
LAYOUTS = [("2x2x2", "data,context", None, "probs"), ("4x2", "data,model", 0.75, "position"),
           ("1x2x4", "data,context,model", 1.0, "probs")]


@pytest.mark.parametrize("mesh_spec,expert_axes,factor,policy", LAYOUTS)
def test_expert_layouts_equal_a_loop_over_experts(mesh_spec, expert_axes, factor, policy):
  """The experts split as ``expert_axes`` says (the FFN whole where "model" is among
  them), at every layout the loop's output, dropped count, losses and every gradient."""
  from flax_tp.moe import expert_capacity
  mesh = flax_tp.make_mesh(mesh_spec)
  axes = flax_tp.MeshAxes.of(mesh)
  moe = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=mesh, shared_d_ff=SHARED_FF,
            capacity_factor=factor, drop_policy=policy, expert_axes=expert_axes,
            rngs=nnx.Rngs(0))
  assert moe.expert_axes == axes.expert_axes(expert_axes)
  over = [a for a in moe.expert_axes]
  assert moe.gate[...].sharding.spec[0] == (over[0] if len(over) == 1 else tuple(over))
  devices = int(np.prod([axes.size(a) for a in over]))
  whole = "model" in expert_axes
  assert moe.expert_layout.parts == devices and moe.ffn_layout.parts == (
      1 if whole else axes.model)
  local = moe.gate[...].addressable_shards[0].data.shape
  assert local == (-(-EXPERTS // devices), D_MODEL, D_FF if whole else -(-D_FF // axes.model))
  p = logical_params(moe)
  for name, value in logical_params(MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=flax_tp.make_mesh(
      "1x1"), shared_d_ff=SHARED_FF, rngs=nnx.Rngs(0))).items():
    np.testing.assert_array_equal(p[name], value, err_msg=name)  # the same draws
  x = make_inputs()
  tokens = x.reshape(-1, D_MODEL)
  capacity = None if factor is None else expert_capacity(TOKENS, TOP_K, EXPERTS, factor)
  y, stats = jax.jit(lambda m, x: m(x))(moe, x)
  ref_y, ref_aux, ref_z = loop_moe(p, tokens, TOP_K, True, capacity, policy)
  np.testing.assert_allclose(y.reshape(-1, D_MODEL), ref_y, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(load_balancing_loss(stats), ref_aux, rtol=1e-6)
  np.testing.assert_allclose(router_z_loss(stats), ref_z, rtol=1e-6)
  if capacity is not None:
    from models.reference import capacity_kept
    weights, experts = jax.lax.top_k(jax.nn.softmax(tokens @ p["router"], -1), TOP_K)
    kept = np.asarray(capacity_kept(experts, weights / weights.sum(-1, keepdims=True),
                                    capacity, policy))
    assert (~kept).sum() > 0 and float(stats.dropped) == (~kept).sum()

  def loss(m):
    y, stats = m(x)
    return jnp.sum(y * jnp.cos(y)) + 0.1 * load_balancing_loss(stats)

  grads = flat_grads(jax.jit(nnx.grad(loss))(moe))
  ref_grads = jax.grad(lambda p: jnp.sum(
      (r := loop_moe(p, tokens, TOP_K, True, capacity, policy))[0] * jnp.cos(r[0]))
      + 0.1 * r[1])(p)
  assert set(grads) == set(ref_grads)
  for name, g in ref_grads.items():
    np.testing.assert_allclose(grads[name], g, rtol=2e-5, atol=1e-5 * np.abs(g).max(),
                               err_msg=name)


def test_expert_axes_are_checked_by_name(meshes):
  with pytest.raises(ValueError, match="bad expert axes 'context': no 'data'"):
    MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=meshes["2x4"], expert_axes="context",
        rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"bad expert axes \('data', 'stage'\): unknown role"):
    MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=meshes["2x4"], expert_axes=("data", "stage"),
        rngs=nnx.Rngs(0))
  # A role with one device here splits nothing: the 2x4 mesh has no context axis.
  moe = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=meshes["2x4"], expert_axes="data,context",
            rngs=nnx.Rngs(0))
  assert moe.expert_axes == ("data",) and moe.expert_layout.parts == 2


def test_checkpoints_move_between_expert_layouts(tmp_path):
  """Saved with the experts over data x model on 2x4 (one whole expert per device, two
  zero ones), restored over data on 4x2, over data x context on 2x2x2 and over data x
  context x model on 1x2x4: the same logical params, the padding zero."""
  from flax_tp.checkpoint import Checkpointer
  source = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=flax_tp.make_mesh("2x4"),
               expert_axes="data,model", rngs=nnx.Rngs(0))
  ck = Checkpointer(tmp_path / "ck")
  ck.save(1, {"params": nnx.state(source, nnx.Param)}, {"step": 1})
  want = logical_params(source)
  for spec, axes in (("4x2", "data"), ("2x2x2", "data,context"),
                     ("1x2x4", "data,context,model")):
    restore_and_check(ck, want, MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=flax_tp.make_mesh(spec),
                                    expert_axes=axes, rngs=nnx.Rngs(7)), spec)


def test_padding_stays_zero_with_zero_gradient(meshes):
  """6 experts over 4 data shards (2, 2, 1, 1 + a zero expert on each of the last two)
  and an FFN of 10 over 2: the stored padding is zero and so is its gradient."""
  moe = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=meshes["4x2"], rngs=nnx.Rngs(0))
  assert moe.gate[...].shape == (4 * 2, D_MODEL, 2 * 5)
  x = make_inputs()
  grads = jax.jit(nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2)))(moe)
  for name in ("gate", "up", "down"):
    stored = np.asarray(getattr(moe, name)[...])
    grad = np.asarray(grads[name][...])
    valid = moe.expert_layout.valid_mask()
    assert np.all(stored[~valid] == 0) and np.all(grad[~valid] == 0), name
    assert np.abs(grad[valid]).max() > 0, name


def test_permute_then_unpermute_is_the_identity():
  """With identity experts (gate = up = a scaled identity, down = identity) and weights
  that sum to one, ``grouped_swiglu`` gives back each token's own vector through silu:
  sorting by expert and scattering back loses and moves nothing."""
  n, d, e, k = 9, 4, 3, 2
  x = jax.random.normal(jax.random.key(0), (n, d))
  slots = jnp.array([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0], [1, 2], [0, 2], [1, 0], [2, 1]])
  weights = jnp.full((n, k), 0.5)
  eye = jnp.broadcast_to(jnp.eye(d), (e, d, d))
  y = grouped_swiglu(x, slots, weights, eye, eye, eye)  # each expert: silu(x) * x
  np.testing.assert_allclose(y, jax.nn.silu(x) * x, rtol=1e-6)
  # A choice handled on another shard (slot == number of local experts) adds nothing.
  elsewhere = slots.at[:, 1].set(e)
  y = grouped_swiglu(x, elsewhere, weights, eye, eye, eye)
  np.testing.assert_allclose(y, 0.5 * jax.nn.silu(x) * x, rtol=1e-6)


def test_route_normalises_only_when_asked():
  logits = jnp.array([[2.0, 1.0, 0.5, -1.0]])
  w, e, probs = route(logits, 2, normalize=False)
  np.testing.assert_array_equal(e, [[0, 1]])
  np.testing.assert_allclose(w, probs[:, :2], rtol=1e-7)
  w, _, _ = route(logits, 2, normalize=True)
  np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-7)


def test_a_grouped_sigmoid_router_picks_from_the_best_groups_with_its_bias():
  """DeepSeek-V3 / GLM-4.5's router on one token, worked by hand: 6 experts in 3 groups,
  the best 2 groups by their two best biased scores, top-2 of those by biased score,
  weighted by the unbiased scores, renormalised, times 2.5."""
  from flax_tp import Router
  logits = jnp.array([[0.0, 3.0, 0.0, 1.2, -2.0, 2.0]])
  scores = jax.nn.sigmoid(logits[0])
  bias = jnp.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.4])
  # Scores .5 .95 | .5 .77 | .12 .88; biased group sums 1.45, 1.27, 1.40: groups 0 and 2,
  # whose best are expert 5 (1.28 biased) and 1 (.95), though expert 3 (.77) outscores
  # expert 0 (.5): its group lost.
  w, e, probs = Router(2, score="sigmoid", groups=3, top_groups=2, scale=2.5)(logits, bias)
  np.testing.assert_array_equal(np.sort(np.asarray(e[0])), [1, 5])
  picked = scores[jnp.asarray(e[0])]
  np.testing.assert_allclose(w[0], 2.5 * picked / picked.sum(), rtol=1e-6)
  np.testing.assert_allclose(probs[0], scores / scores.sum(), rtol=1e-6)
  # Without the bias, group 1 (1.27) beats group 2 (1.0) and expert 3 is picked.
  _, e, _ = Router(2, score="sigmoid", groups=3, top_groups=2)(logits)
  np.testing.assert_array_equal(np.sort(np.asarray(e[0])), [1, 3])
  # The bias gets no gradient: it picks, it never weighs.
  grad = jax.grad(lambda b: jnp.sum(Router(2, score="sigmoid", groups=3, top_groups=2)(
      logits, b)[0]))(bias)
  np.testing.assert_array_equal(grad, np.zeros(6))
  for bad, match in ((dict(score="relu"), "router score must be one of"),
                     (dict(groups=2, top_groups=3), "top_groups 3 is more than its groups 2")):
    with pytest.raises(ValueError, match=match):
      Router(2, **bad)
  with pytest.raises(ValueError, match="groups 4 do not divide num_experts 6"):
    MoE(D_MODEL, D_FF, 6, 2, mesh=flax_tp.make_mesh("1x1"), rngs=nnx.Rngs(0),
        router=Router(2, groups=4))


def test_stats_add_over_layers_as_transformers_concatenates():
  """Two layers' stats added give transformers' loss of the two layers' logits
  concatenated (its means run over the concatenation, not per layer)."""
  keys = jax.random.split(jax.random.key(3), 2)
  logits = [jax.random.normal(k, (5, EXPERTS)) * 2 for k in keys]
  from flax_tp.moe import router_stats
  stats = None
  for lg in logits:
    _, e, probs = route(lg, TOP_K, True)
    s = router_stats(lg, probs, e)
    stats = s if stats is None else stats + s
  both = jnp.concatenate(logits)
  probs = jax.nn.softmax(both, -1)
  _, e = jax.lax.top_k(probs, TOP_K)
  mask = jax.nn.one_hot(e, EXPERTS)
  expected = jnp.sum(jnp.mean(mask, 0) * jnp.mean(probs, 0)[None]) * EXPERTS
  np.testing.assert_allclose(load_balancing_loss(stats), expected, rtol=1e-6)
  assert isinstance(stats, RouterStats)


def test_bad_arguments_name_the_value(meshes):
  with pytest.raises(ValueError, match="top_k 7 is more than num_experts 6"):
    MoE(D_MODEL, D_FF, 6, 7, mesh=meshes["1x1"], rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_experts must be a positive integer, got 0"):
    MoE(D_MODEL, D_FF, 0, 1, mesh=meshes["1x1"], rngs=nnx.Rngs(0))
  moe = MoE(D_MODEL, D_FF, 6, 2, mesh=meshes["1x1"], rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"expects inputs \[\.\.\., 12\], got \(2, 5\)"):
    moe(jnp.ones((2, 5)))


def test_checkpoints_move_between_meshes_with_and_without_expert_parallelism(meshes, tmp_path):
  """Saved on 2x4 (experts 3 + 3 over "data", FFN 5 + 5 over "model"); restored on 4x2
  (2, 2, 1, 1 + zero experts), 1x8 (all experts on each shard: no expert parallelism)
  and 1x1: the same logical params; the file holds each logical element once."""
  from flax_tp.checkpoint import Checkpointer
  source = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=meshes["2x4"], shared_d_ff=SHARED_FF,
               rngs=nnx.Rngs(0))
  params = nnx.state(source, nnx.Param)
  ck = Checkpointer(tmp_path / "ck")
  ck.save(1, {"params": params}, {"step": 1})
  logical = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(flax_tp.unshard(params)))
  assert (tmp_path / "ck" / "1" / "shards.0.bin").stat().st_size == logical
  want = logical_params(source)
  for spec in ("4x2", "1x8", "1x1"):
    restore_and_check(ck, want, MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=meshes[spec],
                                    shared_d_ff=SHARED_FF, rngs=nnx.Rngs(7)), spec)


def restore_and_check(ck, want: dict, target: MoE, label: str) -> None:
  """Restores ``ck`` into ``target`` (drawn from another seed: the restore must replace
  every value) and checks its logical params are ``want`` and its padding zero."""
  restored, _ = ck.restore({"params": nnx.state(target, nnx.Param)})
  nnx.update(target, restored["params"])
  for name, value in logical_params(target).items():
    np.testing.assert_array_equal(value, want[name], err_msg=f"{label} {name}")
  stored = np.asarray(target.gate[...])
  assert np.all(stored[~target.expert_layout.valid_mask()] == 0), label


def test_dispatch_sends_tokens_and_never_an_expert_weight(meshes):
  """The compiled forward and backward on 2x4 (3 experts per data shard, FFN split in
  4): over "data" the tokens, their routing and the outputs (all-gather and
  reduce-scatter, both ways), the router statistics' sums and the replicated params'
  gradients; over "model" the outputs' sum and the routing weights' gradient. No
  collective carries an expert weight (each expert is used where it lives)."""
  from flax_tp.hlo import collectives
  mesh = meshes["2x4"]
  moe = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=mesh, rngs=nnx.Rngs(0))
  x = make_inputs()
  step = jax.jit(nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2) + load_balancing_loss(m(x)[1])))
  found = collectives(step.lower(moe).compile().as_text(), mesh)
  local_tokens, all_tokens = TOKENS // 2, TOKENS
  expert_shapes = {tuple(moe.gate[...].shape), tuple(moe.down[...].shape), (3, D_MODEL, 3),
                   (3, 3, D_MODEL)}  # global and per-device blocks
  for c in found:
    assert not {shape for _, shape in c.operands} & expert_shapes, c
  gathers = sorted((c.operands[0][1], c.axes) for c in found if c.kind == "all-gather")
  # Forward: tokens, routing weights and expert ids; backward: the output cotangents.
  assert gathers == sorted([((all_tokens, D_MODEL), ("data",)), ((all_tokens, TOP_K), ("data",)),
                            ((all_tokens, TOP_K), ("data",)), ((all_tokens, D_MODEL), ("data",))])
  scatters = sorted((c.operands[0][1], c.axes) for c in found if c.kind == "reduce-scatter")
  # Forward: the outputs back to their shards; backward: the routing weights' cotangents.
  assert scatters == sorted([((local_tokens, D_MODEL), ("data",)),
                             ((local_tokens, TOP_K), ("data",))])
  model_sums = [c for c in found if c.kind == "all-reduce" and c.axes == ("model",)]
  assert sorted(s for c in model_sums for _, s in c.operands) == sorted(
      [(local_tokens, D_MODEL), (all_tokens * TOP_K, 1)])


# -- the all-to-all dispatcher ------------------------------------------------------------

A2A_EXPERTS, A2A_TOP_K = 16, 2


def _moe_pair(mesh, factor, expert_axes="data", policy="probs"):
  """The same MoE (top-2 of 16, FFN 10) with each dispatcher."""
  return [MoE(D_MODEL, D_FF, A2A_EXPERTS, A2A_TOP_K, mesh=mesh, capacity_factor=factor,
              drop_policy=policy, expert_axes=expert_axes, dispatcher=d, rngs=nnx.Rngs(0))
          for d in ("all_gather", "all_to_all")]


def _value_and_grads(moe, x):
  def loss(m):
    y, stats = m(x)
    return jnp.sum(y * jnp.cos(y)) + 0.1 * load_balancing_loss(stats), (y, stats)
  (_, (y, stats)), grads = nnx.value_and_grad(loss, has_aux=True)(moe)
  return y, stats, flat_grads(grads)


@pytest.mark.parametrize("mesh_spec,expert_axes", [
    ("3x2", "data"),
    pytest.param("4x2", "data", marks=pytest.mark.slow),
    pytest.param("8x1", "data", marks=pytest.mark.slow),
    pytest.param("2x4", "data,model", marks=pytest.mark.slow)])
def test_all_to_all_equals_all_gather_where_nothing_can_drop(mesh_spec, expert_axes):
  """At capacity factor E / k each expert can take every choice of a source shard:
  nothing drops, and the all-to-all dispatcher's outputs, router statistics and every
  gradient are the all-gather's."""
  mesh = flax_tp.make_mesh(mesh_spec)
  gathered, to_all = _moe_pair(mesh, A2A_EXPERTS / A2A_TOP_K, expert_axes)
  x = jax.random.normal(jax.random.key(2), (24, D_MODEL))  # 24 tokens: split over 8, 4, 3
  y1, s1, g1 = _value_and_grads(gathered, x)
  y2, s2, g2 = _value_and_grads(to_all, x)
  np.testing.assert_allclose(y2, y1, rtol=1e-6, atol=1e-6)
  for a, b in zip(s1, s2, strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-6)
  assert float(s2.dropped) == 0
  for key in g1:
    np.testing.assert_allclose(g2[key], g1[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_dispatcher_says_whether_its_drops_depend_on_the_mesh(meshes):
  """Only the all-to-all with a capacity queues per source shard (the test below shows its
  drops moving with the data axis); the all-gather's queues are the global batch's, and
  dropless nothing drops."""
  depends = {("all_gather", None): False, ("all_gather", 1.0): False,
             ("all_to_all", 1.0): True}
  for (dispatcher, factor), expected in depends.items():
    moe = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=meshes["2x4"], capacity_factor=factor,
              dispatcher=dispatcher, rngs=nnx.Rngs(0))
    assert moe.dispatch().drops_depend_on_mesh is expected, (dispatcher, factor)


@pytest.mark.parametrize("mesh_spec,policy,factor", [
    ("4x2", "probs", 1.0), pytest.param("2x4", "position", 0.75, marks=pytest.mark.slow),
    pytest.param("8x1", "probs", 1.25, marks=pytest.mark.slow)])
def test_all_to_all_drops_per_source_shard(mesh_spec, policy, factor):
  """With drops, each expert keeps at most ceil(F * t_local * k / E) of each source
  shard's choices by the policy: the loop over experts on each data shard's own tokens
  with that capacity (so what drops depends on the data axis, as Megatron's per-rank
  capacity does), the drops counted, every gradient."""
  from flax_tp.moe import expert_capacity
  mesh = flax_tp.make_mesh(mesh_spec)
  _, moe = _moe_pair(mesh, factor, policy=policy)
  x = jax.random.normal(jax.random.key(2), (24, D_MODEL))
  data = mesh.shape["data"]
  capacity = expert_capacity(24 // data, A2A_TOP_K, A2A_EXPERTS, factor)
  p = logical_params(moe)

  def reference(p):
    return jnp.concatenate([loop_moe(p, part, A2A_TOP_K, True, capacity, policy)[0]
                            for part in jnp.split(x, data)])
  y_ref = reference(p)
  y, stats = moe(x)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  from models.reference import capacity_kept
  dropped = 0
  for part in jnp.split(x, data):
    probs = jax.nn.softmax(part @ p["router"], axis=-1)
    w, e = jax.lax.top_k(probs, A2A_TOP_K)
    w = w / w.sum(-1, keepdims=True)
    dropped += int(jnp.sum(~capacity_kept(e, w, capacity, policy)))
  assert dropped > 0 and float(stats.dropped) == dropped
  grads = flat_grads(nnx.grad(lambda m: jnp.sum(m(x)[0] * jnp.cos(m(x)[0])))(moe))
  ref = jax.grad(lambda p: jnp.sum(reference(p) * jnp.cos(reference(p))))(p)
  for key in ("router", "gate", "up", "down"):
    np.testing.assert_allclose(grads[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("mesh_spec", ["8x1", "4x2"])
def test_all_to_all_sends_the_routed_copies_not_every_token(mesh_spec):
  """Top-2 of 16 experts at factor 1.25, the compiled forward and backward (the input's
  gradient too, as a step needs it): the all-to-all dispatcher exchanges by four
  all-to-alls (the tokens out and back, and their cotangents), no token is all-gathered
  or reduce-scattered over "data", and each device sends at most half the all-gather
  dispatcher's bytes over "data" on 8x1 (counted as a ring sends them:
  flax_tp.hlo.sent_bytes); on 4x2, at top-2 over 4 shards, F * k / D of them."""
  from flax_tp.hlo import collectives, sent_bytes
  from flax_tp.moe import expert_capacity
  mesh = flax_tp.make_mesh(mesh_spec)
  x = jax.random.normal(jax.random.key(2), (64, D_MODEL))
  found = {}
  for moe in _moe_pair(mesh, 1.25):
    step = jax.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2), argnums=(0, 1)))
    found[moe.dispatcher] = collectives(step.lower(moe, x).compile().as_text(), mesh)
  kinds = [c.kind for c in found["all_to_all"] if c.axes == ("data",)
           and c.kind != "all-reduce"]  # (the replicated router's gradient: both)
  assert sorted(kinds) == ["all-to-all"] * 4, kinds
  dispatch = {d: sum(sent_bytes(c, mesh) for c in f
                     if c.axes == ("data",) and c.kind != "all-reduce")
              for d, f in found.items()}
  # Each all-to-all: [D * E_local * C, d] float32, all but this device's block sent.
  data = mesh.shape["data"]
  e_local = -(-A2A_EXPERTS // data)
  capacity = expert_capacity(64 // data, A2A_TOP_K, A2A_EXPERTS, 1.25)
  assert dispatch["all_to_all"] == 4 * (data - 1) * e_local * capacity * D_MODEL * 4
  # Against the all-gather's (D - 1) * t * d per direction the all-to-all sends about
  # F * k / D of it (at most 0.31 on 8x1; 0.625 on 4x2, 0.75 with C rounded up): half
  # on 8x1, and never more than F * k / D with the rounding on 4x2.
  bound = 0.5 if data == 8 else 1.25 * A2A_TOP_K / data * (
      A2A_EXPERTS * capacity / (1.25 * (64 // data) * A2A_TOP_K))
  assert dispatch["all_to_all"] <= bound * dispatch["all_gather"], dispatch


@pytest.mark.parametrize("mesh_spec,options,factor", [
    ("4x2", {"sequence_parallel": True, "scan_layers": True}, 3.0),
    pytest.param("2x2x2", {"expert_axes": "data,context"}, 3.0, marks=pytest.mark.slow),
    pytest.param("2x4", {"expert_axes": "data,model", "fsdp": True}, 3.0,
                 marks=pytest.mark.slow),
    # dropless: ragged_all_to_all (emulated on CPU)
    pytest.param("4x2", {"sequence_parallel": True, "scan_layers": True}, None,
                 marks=pytest.mark.slow),
    pytest.param("2x2x2", {"expert_axes": "data,context", "context_parallel": "ring"}, None,
                 marks=pytest.mark.slow)])
def test_a_transformer_step_is_the_same_with_either_dispatcher(monkeypatch, mesh_spec,
                                                               options, factor):
  """Execution(expert_dispatcher="all_to_all") at capacity factor E / k (nothing can
  drop), or dropless (``jax.lax.ragged_all_to_all``, emulated as XLA:CPU lacks it): the
  step's loss, router figures and every gradient are the all-gather's."""
  from models.config import TransformerConfig
  from models.execution import Execution
  from models.transformer import Transformer
  from train.step import Trainer, make_optimizer
  if factor is None:
    monkeypatch.setattr(flax_tp.moe.dispatch, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(flax_tp.moe.dispatch, "RAGGED_ALL_TO_ALL_PLATFORMS",
                        frozenset({"cpu"}))
  mesh = flax_tp.make_mesh(mesh_spec)
  cfg = TransformerConfig.preset("moe-tiny", expert_capacity_factor=factor)
  tokens = jax.random.randint(jax.random.key(1), (4, cfg.max_seq_len + 1), 0, cfg.vocab_size)
  results = []
  for dispatcher in ("all_gather", "all_to_all"):
    model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0),
                        execution=Execution(expert_dispatcher=dispatcher, **options))
    trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
    placed = jax.device_put(tokens, trainer.batch_sharding)
    results.append(jax.jit(trainer.loss_and_grads)(trainer.params, placed))
  (loss1, grads1), (loss2, grads2) = results
  np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
  g1, g2 = flat_grads(grads1), flat_grads(grads2)
  for key in g1:
    np.testing.assert_allclose(g2[key], g1[key], rtol=1e-5, atol=1e-7, err_msg=key)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """``jax.lax.ragged_all_to_all`` as its docstring defines it (one slice per device),
  built from ``jax.lax.all_to_all`` for XLA:CPU, which lacks the collective: slice ``j``
  of this device's ``operand`` (``input_offsets[j]``, ``send_sizes[j]`` rows) is written
  into device ``j``'s ``output`` at the offset this device names (``output_offsets[j]``);
  ``recv_sizes[i]`` rows arrive from device ``i``."""
  m, rows = operand.shape[0], jnp.arange(operand.shape[0])
  taken = jnp.clip(input_offsets[:, None] + rows[None, :], 0, m - 1)  # [D, m]
  blocks = jnp.where((rows[None, :] < send_sizes[:, None])[..., None], operand[taken], 0)
  got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # block i: from device i
  at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where i writes
  target = jnp.where(rows[None, :] < recv_sizes[:, None], at[:, None] + rows[None, :],
                     output.shape[0])  # (beyond the output: dropped)
  return output.at[target.reshape(-1)].set(got.reshape(-1, operand.shape[-1]), mode="drop")


def test_the_emulated_ragged_all_to_all_is_the_documented_one():
  """The emulation on an example worked by hand from ``jax.lax.ragged_all_to_all``'s
  definition (two devices): device 0 sends its row 0 to itself at offset 0 and rows 1-2
  to device 1 at offset 3; device 1 sends its rows 0-2 to device 0 at offset 1."""
  mesh = flax_tp.make_mesh("2x1")
  operand = jnp.asarray([[1., 2, 3, 0], [4, 5, 6, 7]])[..., None]  # a row per device
  args = dict(input_offsets=[[0, 1], [0, 0]], send_sizes=[[1, 2], [3, 0]],
              output_offsets=[[0, 3], [1, 0]], recv_sizes=[[1, 3], [2, 0]])
  args = {k: jnp.asarray(v, jnp.int32) for k, v in args.items()}

  def run(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
    return emulated_ragged_all_to_all(operand[0], -jnp.ones((5, 1)), input_offsets[0],
                                      send_sizes[0], output_offsets[0], recv_sizes[0],
                                      axis_name="data")[None]
  spec = jax.sharding.PartitionSpec("data")
  out = jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec)(operand, *args.values())
  np.testing.assert_array_equal(out[..., 0], [[1, 4, 5, 6, -1], [-1, -1, -1, 2, 3]])


@pytest.mark.parametrize("mesh_spec,expert_axes", [
    ("4x2", "data"),
    pytest.param("8x1", "data", marks=pytest.mark.slow),
    pytest.param("2x4", "data,model", marks=pytest.mark.slow),
    pytest.param("2x2x2", "data,context", marks=pytest.mark.slow)])
def test_the_dropless_all_to_all_equals_the_all_gather(monkeypatch, mesh_spec, expert_axes):
  """Dropless, the all-to-all dispatcher sends each routed choice to its expert's device
  with ``jax.lax.ragged_all_to_all`` (here its emulation: XLA:CPU lacks it) and gives
  the dropless all-gather's outputs, router statistics and every gradient."""
  monkeypatch.setattr(flax_tp.moe.dispatch, "ragged_all_to_all", emulated_ragged_all_to_all)
  monkeypatch.setattr(flax_tp.moe.dispatch, "RAGGED_ALL_TO_ALL_PLATFORMS",
                        frozenset({"cpu"}))
  mesh = flax_tp.make_mesh(mesh_spec)
  gathered, to_all = _moe_pair(mesh, None, expert_axes)
  x = jax.random.normal(jax.random.key(2), (24, D_MODEL))
  y1, s1, g1 = _value_and_grads(gathered, x)
  y2, s2, g2 = _value_and_grads(to_all, x)
  np.testing.assert_allclose(y2, y1, rtol=1e-6, atol=1e-6)
  for a, b in zip(s1, s2, strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-6)
  for key in g1:
    np.testing.assert_allclose(g2[key], g1[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_the_all_to_all_dispatcher_needs_a_capacity_where_xla_lacks_ragged_all_to_all():
  with pytest.raises(ValueError, match="without a capacity_factor .dropless. needs "
                     "jax.lax.ragged_all_to_all, which XLA on 'cpu' does not implement"):
    MoE(D_MODEL, D_FF, 6, 2, mesh=flax_tp.make_mesh("2x1"), dispatcher="all_to_all",
        rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dispatcher must be one of"):
    MoE(D_MODEL, D_FF, 6, 2, mesh=flax_tp.make_mesh("2x1"), dispatcher="ring",
        rngs=nnx.Rngs(0))


# -- the transformer with MoE layers ----------------------------------------------------

MOE_CFG = dict(num_experts=6, experts_per_token=2, expert_d_ff=10, shared_expert_d_ff=7,
               router_aux_loss_coef=0.1)


def moe_reference_run(cfg, tokens, steps=3):
  """Losses (with the load-balancing term), first gradients and final params of
  plain-Flax training of the loop-over-experts reference."""
  import optax

  from models.reference import ReferenceTransformer, reference_loss
  from train.step import make_optimizer
  model = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  opt = make_optimizer(lr=1e-3, steps=steps, warmup_steps=0, weight_decay=0.1, grad_clip=1.0)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(
        lambda p: reference_loss(nnx.merge(graphdef, p), tokens))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  losses, first = [], None
  for _ in range(steps):
    params, opt_state, loss, grads = step(params, opt_state)
    losses.append(float(loss))
    first = grads if first is None else first
  return model, losses, first, params


@pytest.fixture(scope="module")
def moe_reference():
  from models.config import TransformerConfig
  cfg = TransformerConfig.preset("llama-tiny", **MOE_CFG)
  tokens = jax.random.randint(jax.random.key(1), (8, cfg.max_seq_len + 1), 0, cfg.vocab_size)
  return (cfg, tokens, *moe_reference_run(cfg, tokens))


@pytest.mark.parametrize("mesh_spec,options", [
    pytest.param("2x4", {}, marks=pytest.mark.slow),
    # (the fast case; the same without sequence parallelism is no separate case: SP's
    # part is 2x4's below)
    ("4x2", {"scan_layers": True, "fsdp": True, "remat": "block", "sequence_parallel": True}),
    pytest.param("2x4", {"sequence_parallel": True}, marks=pytest.mark.slow),
    pytest.param("1x1", {}, marks=pytest.mark.slow),
    pytest.param("1x3", {"remat": "dots_saveable"}, marks=pytest.mark.slow),
    pytest.param("1x8", {"scan_layers": True}, marks=pytest.mark.slow),
    pytest.param("2x4", {"fsdp": True}, marks=pytest.mark.slow)])
def test_transformer_with_experts_trains_as_the_reference(meshes, moe_reference, mesh_spec,
                                                          options):
  """A Llama-style model whose MLPs are MoE (6 experts, FFN 10, a shared expert of 7,
  load-balancing loss at 0.1), against the plain-Flax reference that loops over
  experts: init, logits, loss and every gradient (the load-balancing term's too, so its
  gradient does not depend on the mesh), then 3 AdamW steps."""
  from models.execution import Execution
  from models.transformer import Transformer
  from tests.helpers import assert_padding_zero, assert_state_close
  from train.step import Trainer, make_optimizer
  cfg, tokens, ref_model, ref_losses, ref_grads, ref_params = moe_reference
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0),
                      execution=Execution(**options))
  assert_state_close(model, ref_model, rtol=0, atol=0)
  np.testing.assert_allclose(jax.jit(lambda t: model(t))(tokens[:, :-1]),
                             jax.jit(lambda t: ref_model(t))(tokens[:, :-1]), rtol=1e-5,
                             atol=1e-5)
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=3, warmup_steps=0, weight_decay=0.1,
                                          grad_clip=1.0))
  placed = jax.device_put(tokens, trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, placed)
  np.testing.assert_allclose(loss, ref_losses[0], rtol=1e-6)
  assert_state_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
  params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)
  losses = []
  for _ in range(3):
    params, opt_state, out = trainer.train_step(params, opt_state, placed, None)
    losses.append(float(out["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_state_close(params, ref_params, rtol=1e-5, atol=1e-5)
  assert out["expert_load"].shape == (6,)
  np.testing.assert_allclose(float(out["expert_load"].sum()), 1.0, rtol=1e-6)  # shares
  if mesh_spec in ("2x4", "4x2"):
    assert assert_padding_zero(params) > 0


# DeepSeek-V3 / GLM-4.5's MoE: a sigmoid router picking top-3 of 9 experts from the best
# 2 of 3 groups with a selection bias, weights renormalised and scaled by 2.5, an ungated
# shared expert, the first layer dense; the balance loss over normalised scores.
GROUPED_CFG = dict(num_layers=3, num_experts=9, experts_per_token=3, expert_d_ff=10,
                   shared_expert_d_ff=14, shared_expert_gated=False, router_score="sigmoid",
                   router_selection_bias=True, expert_groups=3, expert_groups_per_token=2,
                   routed_scale=2.5, moe_layers=(1, 2), router_aux_loss_coef=0.1)
SELECTION_BIAS = np.linspace(-0.3, 0.3, 9).astype(np.float32)[::-1]


@pytest.fixture(scope="module")
def grouped_reference():
  from models.config import TransformerConfig
  cfg = TransformerConfig.preset("llama-tiny", **GROUPED_CFG)
  tokens = jax.random.randint(jax.random.key(1), (8, cfg.max_seq_len + 1), 0, cfg.vocab_size)

  def with_bias(ref):
    for block in ref.blocks:
      if hasattr(block.mlp, "selection_bias"):
        block.mlp.selection_bias[...] = jnp.asarray(SELECTION_BIAS)
  return cfg, tokens, with_bias


@pytest.fixture(scope="module")
def grouped_expected(grouped_reference):
  """The biased reference's logits, loss and gradients, computed once (jitted)."""
  from models.reference import ReferenceTransformer, reference_loss
  cfg, tokens, with_bias = grouped_reference
  ref = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  with_bias(ref)
  logits = nnx.jit(lambda m, t: m(t))(ref, tokens[:, :-1])
  loss, grads = nnx.jit(nnx.value_and_grad(lambda m: reference_loss(m, tokens)))(ref)
  return ref, logits, loss, nnx.split_state(nnx.state(grads, nnx.Param), flax_tp.TRAINED, ...)[0]


@pytest.mark.parametrize("mesh_spec,options", [
    # (slow: the fast lane has this router against transformers, glm4_moe and deepseek_v3)
    pytest.param("4x2", {"scan_layers": True, "fsdp": True, "sequence_parallel": True},
                 marks=pytest.mark.slow),
    pytest.param("1x3", {}, marks=pytest.mark.slow),
    pytest.param("2x4", {"expert_axes": "data,model"}, marks=pytest.mark.slow)])
def test_a_grouped_sigmoid_router_trains_as_the_reference(meshes, grouped_reference,
                                                         grouped_expected, mesh_spec, options):
  """The reference loops over experts with transformers' Glm4MoeTopkRouter written out;
  flax_tp's MoE with the same declarations gives its logits, loss and every gradient, and
  3 AdamW steps; the selection bias is a checkpointed param the optimizer never moves."""
  from models.execution import Execution
  from models.reference import ReferenceTransformer
  from models.transformer import Transformer
  from tests.helpers import assert_state_close
  from train.step import Trainer, make_optimizer
  cfg, tokens, _ = grouped_reference
  ref, ref_logits, ref_loss, ref_grads = grouped_expected  # (the reference biased)
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0),
                      execution=Execution(**options))
  # the same seed draws the same model
  assert_state_close(model, ReferenceTransformer(cfg, rngs=nnx.Rngs(0)), rtol=0, atol=0)
  flax_tp.load_unsharded(model, ref)  # (then both pick with a bias that changes picks)
  np.testing.assert_allclose(jax.jit(lambda t: model(t))(tokens[:, :-1]), ref_logits,
                             rtol=1e-5, atol=1e-5)
  opt = make_optimizer(lr=1e-3, steps=3, warmup_steps=0, weight_decay=0.1, grad_clip=1.0)
  trainer = Trainer(model, opt)
  placed = jax.device_put(tokens, trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, placed)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert_state_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
  assert not jax.tree.leaves(nnx.state(grads, flax_tp.SelectionBias))  # not trained
  params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)
  for _ in range(3):
    params, opt_state, out = trainer.train_step(params, opt_state, placed, None)
  biases = nnx.to_flat_state(flax_tp.unshard(nnx.state(params, flax_tp.SelectionBias)))
  assert biases
  for _, v in biases:  # (per layer, or stacked [layers, 9])
    for row in np.asarray(v[...]).reshape(-1, 9):
      np.testing.assert_array_equal(row, SELECTION_BIAS)
  assert trainer.saved(params) is params  # a checkpoint holds the biases
  np.testing.assert_allclose(float(out["expert_load"].sum()), 1.0, rtol=1e-6)  # shares


@pytest.mark.parametrize("mesh_spec,options", [
    ("2x4", {"scan_layers": True}),
    pytest.param("1x8", {"fsdp": True, "sequence_parallel": True}, marks=pytest.mark.slow)])
def test_loss_free_balancing_moves_each_bias_toward_its_layers_mean_load(
    meshes, grouped_reference, mesh_spec, options):
  """DeepSeek-V3's auxiliary-loss-free balancing: after each step every MoE layer's
  selection bias moves by the rate, up for the experts below the layer's mean load and
  down for those above, from the step's global counts (the reference's picks counted per
  layer); the rest of the step is the step without it."""
  from models.execution import Execution
  from models.reference import ReferenceTransformer
  from models.transformer import Transformer
  from train.step import Trainer, balance_selection_biases, make_optimizer
  cfg, tokens, with_bias = grouped_reference
  ref = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  with_bias(ref)
  _, _, picked = nnx.jit(lambda m, t: m(t, return_picked=True))(ref, tokens)
  loads = [np.bincount(np.asarray(p).reshape(-1), minlength=9) for p in picked]
  expected = [SELECTION_BIAS + 0.01 * np.sign(np.mean(c) - c) for c in loads]
  assert all(np.any(c != np.mean(c)) for c in loads)  # (the fixture is not balanced)
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0),
                      execution=Execution(**options))
  flax_tp.load_unsharded(model, ref)
  opt = make_optimizer(lr=1e-3, steps=3, warmup_steps=0)
  balanced, plain = Trainer(model, opt, bias_update_rate=0.01), Trainer(model, opt)
  placed = jax.device_put(tokens, balanced.batch_sharding)
  start = balanced.params
  params, _, out = balanced.train_step(
      jax.tree.map(jnp.copy, start), balanced.init_opt_state(start), placed, None)
  moved = [np.asarray(v[...]).reshape(-1, 9) for _, v in sorted(nnx.to_flat_state(
      flax_tp.unshard(nnx.state(params, flax_tp.SelectionBias))), key=lambda kv: kv[0])]
  np.testing.assert_allclose(np.concatenate(moved), np.stack(expected), rtol=0, atol=1e-7)
  spread = np.mean([e.max() - e.min() for e in expected])
  np.testing.assert_allclose(float(out["selection_bias_spread"]), spread, rtol=1e-6)
  same, _, plain_out = plain.train_step(
      jax.tree.map(jnp.copy, start), plain.init_opt_state(start), placed, None)
  np.testing.assert_array_equal(plain_out["loss"], out["loss"])
  others = lambda state: nnx.split_state(state, flax_tp.TRAINED, ...)[0]
  assert_close = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  jax.tree.map(assert_close, others(params), others(same))
  # The update rule on its own: ties stay put, a stacked run's rows each their own layer's.
  one = nnx.State({"b": flax_tp.SelectionBias(jnp.zeros((2, 3)))})
  out_state, _ = balance_selection_biases(one, jnp.array([[1.0, 1.0, 1.0], [0.0, 3.0, 0.0]]),
                                          0.5)
  np.testing.assert_array_equal(out_state["b"][...], [[0, 0, 0], [0.5, -0.5, 0.5]])
  with pytest.raises(ValueError, match="this model has none"):
    Trainer(Transformer(dataclasses.replace(cfg, router_selection_bias=False),
                        mesh=meshes["1x1"], rngs=nnx.Rngs(0)), opt, bias_update_rate=0.01)


def test_bad_moe_configs_are_refused_by_name():
  from models.config import TransformerConfig
  with pytest.raises(ValueError, match="expert_capacity_factor must be a number > 0 or None"):
    TransformerConfig.preset("moe-tiny", expert_capacity_factor=0)
  with pytest.raises(ValueError, match="expert_drop_policy must be one of"):
    TransformerConfig.preset("moe-tiny", expert_drop_policy="random")
  with pytest.raises(ValueError, match="experts_per_token must be in \\[1, num_experts=6\\], got 7"):
    TransformerConfig.preset("moe-tiny", experts_per_token=7)
  with pytest.raises(ValueError, match="mlp must be 'swiglu', got 'gelu'"):
    TransformerConfig.preset("moe-tiny", mlp="gelu")
  # True is an int to Python, but no capacity; numpy's numbers are numbers.
  with pytest.raises(ValueError, match="expert_capacity_factor must be a number > 0 or None"):
    TransformerConfig.preset("moe-tiny", expert_capacity_factor=True)
  assert TransformerConfig.preset("moe-tiny", expert_capacity_factor=np.float32(1.5))
  mesh = flax_tp.make_mesh("1x1")
  with pytest.raises(ValueError, match="capacity_factor must be a number > 0 or None"):
    MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=mesh, capacity_factor=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="top_k must be a positive integer, got True"):
    MoE(D_MODEL, D_FF, EXPERTS, True, mesh=mesh, rngs=nnx.Rngs(0))
  MoE(D_MODEL, D_FF, EXPERTS, np.int64(2), mesh=mesh, capacity_factor=np.float64(1.0),
      rngs=nnx.Rngs(0))
  for bad, match in (
      (dict(router_score="tanh"), "router_score must be one of"),
      (dict(expert_groups=4), "expert_groups 4 must divide num_experts 6"),
      (dict(expert_groups=6), "leaves 1 of num_experts 6"),
      (dict(expert_groups=3, expert_groups_per_token=1, experts_per_token=3),
       "experts_per_token 3 is more than the 1 x 2 experts"),
      (dict(routed_scale=0.0), "routed_scale must be a finite number > 0")):
    with pytest.raises(ValueError, match=match):
      TransformerConfig.preset("moe-tiny", **bad)


def test_probs_policy_ranks_weights_an_ulp_apart_by_position():
  """Weights equal in exact arithmetic come out an ulp or two apart, and which is larger
  depends on the mesh's rounding: the ``probs`` policy ranks them as equal (on the
  ``rank_weight`` grid), so the earliest token keeps its place; a weight a grid step
  larger still wins. The reference's pairwise ranking says the same."""
  from flax_tp.moe import PROBS_RANK_GRID, capacity_swiglu
  from models.reference import capacity_kept
  w0 = np.float32(0.3)
  ulp = np.spacing(w0)
  weights = np.array([[w0], [w0 + ulp], [w0 + 2 * ulp], [w0 - ulp],
                      [w0 + 2 * np.float32(PROBS_RANK_GRID)]], np.float32)
  experts = np.zeros((5, 1), np.int32)
  kept = np.asarray(capacity_kept(jnp.asarray(experts), jnp.asarray(weights), 2, "probs"))
  np.testing.assert_array_equal(kept[:, 0], [True, False, False, False, True])
  x = jax.random.normal(jax.random.key(0), (5, D_MODEL))
  ws = [jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate(
      [(1, D_MODEL, D_FF), (1, D_MODEL, D_FF), (1, D_FF, D_MODEL)], start=1)]
  y, dropped = capacity_swiglu(x, jnp.asarray(experts), jnp.asarray(weights), *ws, 2, "probs")
  assert float(dropped) == 3
  rows_kept = np.abs(np.asarray(y)).max(axis=1) > 0
  np.testing.assert_array_equal(rows_kept, [True, False, False, False, True])


@pytest.fixture(scope="module")
def indented_code_step():
  """One step of moe-tiny with capacity factor 1 (the ``probs`` policy) on rows that all
  start with eight spaces, as indented code does: the same token after the same prefix
  in every row, so many routing weights tie exactly. -> (step on a mesh -> (loss,
  dropped choices, expert loads))."""
  from models.config import TransformerConfig
  from models.transformer import Transformer
  from train.step import Trainer, make_optimizer
  cfg = TransformerConfig.preset("moe-tiny", expert_capacity_factor=1.0)
  lines = [b"        return x + y  #", b"        if a:\n            b",
           b"        for i in range(3):", b"        x = foo(bar)", b"        pass\n        pass",
           b"        def f(self):", b"        y = [1, 2, 3]", b"        # comment here"]
  rows = np.stack([np.frombuffer(line.ljust(17)[:17], np.uint8) for line in lines])

  done = {}

  def step(mesh):
    if mesh in done:
      return done[mesh]
    trainer = Trainer(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)),
                      make_optimizer(lr=1e-3, steps=1))
    placed = jax.device_put(rows.astype(np.int32), trainer.batch_sharding)
    _, _, out = trainer.train_step(trainer.params, trainer.init_opt_state(trainer.params),
                                   placed, None)
    done[mesh] = (float(out["loss"]), round(float(out["expert_dropped"]) * 8 * 17 * 2 * 2),
                  np.asarray(out["expert_load"]))
    return done[mesh]

  return step


@pytest.mark.parametrize("mesh_spec", ["1x8", pytest.param("2x4", marks=pytest.mark.slow),
                                       pytest.param("4x2", marks=pytest.mark.slow),
                                       pytest.param("8x1", marks=pytest.mark.slow)])
def test_probs_drops_do_not_depend_on_the_mesh(meshes, indented_code_step, mesh_spec):
  """The README's promise for the ``probs`` policy: the same choices dropped on every
  mesh, so the same loss (before the grid, 1x8 dropped 294 choices where 1x1 dropped 278,
  and the losses differed by 4e-3)."""
  loss, dropped, load = indented_code_step(meshes[mesh_spec])
  ref_loss, ref_dropped, ref_load = indented_code_step(meshes["1x1"])
  assert ref_dropped > 100  # the capacity binds: ties are decided
  assert dropped == ref_dropped
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(load, ref_load, rtol=1e-6)  # equal counts, over equal tokens


def test_a_huge_capacity_factor_is_capped_at_every_token(meshes):
  """An expert is never sent more than every token (each picks it at most once): any
  finite factor runs, with a capacity of the dispatch's tokens, and drops nothing: the
  output equals the dropless MoE's. An empty batch gives an empty output."""
  from flax_tp.moe import capacity_is_capped, expert_capacity
  assert expert_capacity(TOKENS, TOP_K, EXPERTS, 1e4) == TOKENS
  assert expert_capacity(TOKENS, TOP_K, EXPERTS, 1e300) == TOKENS
  assert expert_capacity(TOKENS, TOP_K, EXPERTS, 1.0) == 8
  assert capacity_is_capped(TOKENS, TOP_K, EXPERTS, 1e9)
  assert not capacity_is_capped(TOKENS, TOP_K, EXPERTS, 3.0)
  mesh = meshes["2x4"]
  x = make_inputs()
  dropless = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=mesh, rngs=nnx.Rngs(0))
  huge = MoE(D_MODEL, D_FF, EXPERTS, TOP_K, mesh=mesh, capacity_factor=1e300,
             rngs=nnx.Rngs(0))
  y, stats = huge(x)
  np.testing.assert_allclose(y, dropless(x)[0], rtol=1e-5, atol=1e-6)
  assert float(stats.dropped) == 0
  empty, stats = huge(jnp.zeros((0, 3, D_MODEL)))
  assert empty.shape == (0, 3, D_MODEL) and float(stats.tokens) == 0


@pytest.mark.parametrize("mesh_spec,options", [
    ("2x4", {}),
    pytest.param("4x2", {"scan_layers": True, "fsdp": True, "remat": "block"},
                 marks=pytest.mark.slow),
    pytest.param("1x3", {"scan_layers": True, "sequence_parallel": True},
                 marks=pytest.mark.slow)])
def test_dense_and_moe_layers_mixed(meshes, tmp_path, mesh_spec, options):
  """moe_layers=(1, 2) of 4: blocks 0 and 3 dense SwiGLUs of d_ff 90, 1 and 2 experts;
  loss and every gradient equal the reference's (which builds the same mix). Scanned,
  the runs dense / MoE / dense are stacked apart and scanned in turn, under the
  unstacked model's names: a checkpoint of it restores into the model unscanned."""
  from flax_tp.checkpoint import Checkpointer
  from models.config import TransformerConfig
  from models.execution import Execution
  from models.reference import ReferenceTransformer, reference_loss
  from models.transformer import Transformer
  from tests.helpers import assert_state_close
  from train.step import Trainer, make_optimizer
  cfg = TransformerConfig.preset("moe-tiny", num_layers=4, moe_layers=(1, 2))
  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0),
                      execution=Execution(**options))
  if options.get("scan_layers"):
    assert [(first, count) for _, first, count in flax_tp.layer_runs(model.blocks)] == [
        (0, 1), (1, 2), (3, 1)]
  else:
    assert [b.is_moe for b in model.blocks] == [False, True, True, False]
  ref = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  assert_state_close(model, ref, rtol=0, atol=0)
  tokens = jax.random.randint(jax.random.key(2), (4, 17), 0, cfg.vocab_size)
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1))
  loss, grads = jax.jit(trainer.loss_and_grads)(
      trainer.params, jax.device_put(tokens, trainer.batch_sharding))
  ref_loss, ref_grads = jax.jit(nnx.value_and_grad(lambda m: reference_loss(m, tokens)))(ref)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert_state_close(grads, nnx.state(ref_grads, nnx.Param), rtol=1e-4, atol=1e-6)

  ck = Checkpointer(tmp_path / "ck")
  ck.save(1, {"params": trainer.params}, {"step": 1})
  plain = Transformer(cfg, mesh=meshes["2x4"], rngs=nnx.Rngs(5))
  restored, _ = ck.restore({"params": nnx.state(plain, nnx.Param)})
  nnx.update(plain, restored["params"])
  assert_state_close(plain, ref, rtol=0, atol=0)


@pytest.mark.parametrize("mesh_spec,options", [
    pytest.param("2x4", {"sequence_parallel": True}, marks=pytest.mark.slow),
    pytest.param("1x8", {"scan_layers": True, "remat": "block"}, marks=pytest.mark.slow)])
def test_transformer_with_a_capacity_trains_as_the_reference(meshes, mesh_spec, options):
  """A capacity factor of 1 (each expert takes ceil(8 * 17 * 2 / 6) = 46 of a step's
  choices, kept by weight): loss and every gradient equal the reference's, which zeroes
  the same choices; the metrics file's expert_dropped is the reference's count."""
  from models.config import TransformerConfig
  from models.execution import Execution
  from models.reference import ReferenceTransformer, capacity_kept, reference_loss
  from models.transformer import Transformer
  from tests.helpers import assert_state_close
  from train.step import Trainer, make_optimizer
  cfg = TransformerConfig.preset("llama-tiny", **MOE_CFG, expert_capacity_factor=1.0)
  tokens = jax.random.randint(jax.random.key(1), (8, cfg.max_seq_len + 1), 0, cfg.vocab_size)
  ref = ReferenceTransformer(cfg, rngs=nnx.Rngs(0))
  _, router_logits = jax.jit(lambda t: ref(t, return_router_logits=True))(tokens)
  capacity = -(-8 * 17 * 2 // 6)
  dropped = 0
  for logits in router_logits:
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, -1), 2)
    kept = capacity_kept(experts, weights / weights.sum(-1, keepdims=True), capacity, "probs")
    dropped += int((~np.asarray(kept)).sum())
  assert dropped > 0
  ref_loss, ref_grads = jax.jit(nnx.value_and_grad(lambda m: reference_loss(m, tokens)))(ref)

  model = Transformer(cfg, mesh=meshes[mesh_spec], rngs=nnx.Rngs(0),
                      execution=Execution(**options))
  trainer = Trainer(model, make_optimizer(lr=1e-3, steps=1, warmup_steps=0))
  placed = jax.device_put(tokens, trainer.batch_sharding)
  loss, grads = jax.jit(trainer.loss_and_grads)(trainer.params, placed)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert_state_close(grads, nnx.state(ref_grads, nnx.Param), rtol=1e-4, atol=1e-6)
  _, _, out = trainer.train_step(trainer.params, trainer.init_opt_state(trainer.params),
                                 placed, None)
  np.testing.assert_allclose(float(out["expert_dropped"]), dropped / (2 * 8 * 17 * 2),
                             rtol=1e-6)


def test_a_moe_transformer_builds_from_abstract_shapes(meshes):
  """``nnx.eval_shape`` of a model with experts and selection biases (abstract init: a
  restore target, memory figures) gives the built model's stored shapes and shardings,
  and its train step compiles from them (``bench.memory.abstract_step``: the optimizer's
  moments only for what it trains)."""
  from bench.memory import abstract_step
  from models.config import TransformerConfig
  from models.execution import Execution
  from models.transformer import Transformer
  cfg = TransformerConfig.preset("moe-tiny", router_score="sigmoid",
                                 router_selection_bias=True, shared_expert_d_ff=20,
                                 shared_expert_gated=False)
  mesh = meshes["2x4"]
  build = lambda: Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0),
                              execution=Execution(expert_axes=("data", "model")))
  built = nnx.to_flat_state(nnx.state(build(), nnx.Param))
  abstract = nnx.to_flat_state(nnx.state(nnx.eval_shape(build), nnx.Param))
  assert [path for path, _ in abstract] == [path for path, _ in built]
  for (path, a), (_, b) in zip(abstract, built, strict=True):
    a, b = a.get_value(), b.get_value()
    assert a.shape == b.shape, path
    assert a.sharding.is_equivalent_to(b.sharding, len(a.shape)), path
  compiled, _ = abstract_step(cfg, mesh, 8, 16, execution=dict(expert_axes=("data", "model")))
  assert compiled.memory_analysis().argument_size_in_bytes > 0
