"""Recomputation in backward, and the block runner (a loop or a scan, remat, FSDP gather).

``run_blocks`` runs a model's blocks in order: a Python loop over an ``nnx.List`` of
blocks, or one ``jax.lax.scan`` over a module holding their params stacked
(``flax_tp.stack_layers``); each block recomputed in backward as ``remat`` says
(``REMAT_CHOICES``); each block's params split over ``"data"`` (FSDP) gathered at the
start of that block, inside its recomputation, so backward gathers them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flax_tp.data_parallel import gather_block

# The names a block gives its intermediates (``jax.ad_checkpoint.checkpoint_name``), for
# the named policies below to save: each ``[b, s, ...]`` on this device's heads / columns.
QUERY_PROJ, KEY_PROJ, VALUE_PROJ = "query_proj", "key_proj", "value_proj"  # before rotary
ATTENTION_OUT = "attention_out"  # the attention core's output (and a fused kernel's
# residuals: splash's log-sum-exp), before the output projection
OUT_PROJ = "out_proj"  # the output projection's, before the residual add

# Between none and "block", by what a block keeps for its backward (MaxText's names):
# "save_qkv_proj" keeps q, k and v (the backward recomputes attention and the MLP);
# "save_out_proj" keeps the attention branch's output; "save_attention" keeps q, k, v,
# attention's output and residuals and its projection: only norms and the MLP are
# recomputed, never the attention kernel.
NAMED_POLICIES = {
    "save_qkv_proj": (QUERY_PROJ, KEY_PROJ, VALUE_PROJ),
    "save_out_proj": (OUT_PROJ,),
    "save_attention": (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTENTION_OUT, OUT_PROJ),
}

# "block" recomputes a whole block (nothing saved); then the named policies; the rest are
# jax.checkpoint_policies.
REMAT_CHOICES = ("none", "block", *NAMED_POLICIES, "nothing_saveable", "dots_saveable",
                 "dots_with_no_batch_dims_saveable", "checkpoint_dots",
                 "checkpoint_dots_with_no_batch_dims", "everything_saveable")


def remat_policy(remat: str) -> Callable | None:
  """The ``jax.checkpoint`` policy of ``remat`` (one of ``REMAT_CHOICES``), or None
  (no recomputation)."""
  if remat not in REMAT_CHOICES:
    raise ValueError(f"remat must be one of {REMAT_CHOICES}, got {remat!r}")
  if remat == "none":
    return None
  if remat in NAMED_POLICIES:
    return jax.checkpoint_policies.save_only_these_names(*NAMED_POLICIES[remat])
  return getattr(jax.checkpoint_policies, "nothing_saveable" if remat == "block" else remat)


def recompute_in_backward(f: Callable, state: Any, x: jax.Array, *extra: Any) -> jax.Array:
  """``f(state, x, *extra)`` keeping only its inputs for the backward pass, which
  recomputes it there: ``jax.checkpoint`` with nothing saved, made to hold on XLA's CPU
  backend in an unrolled loop. ``extra`` (keys, row ids) gets no gradient.

  There ``jax.checkpoint``'s recomputation is merged back into the forward pass
  (its optimization barriers are gone before common-subexpression elimination),
  so it saves nothing (BENCHMARKS.md §10). Here the recomputation's input carries
  a zero computed from the incoming cotangent: it can neither be merged with the
  forward nor run before the gradient of its own block arrives.
  """
  @jax.custom_vjp
  def run(state, x, *extra):
    return f(state, x, *extra)

  def forward(state, x, *extra):
    return f(state, x, *extra), (state, x, extra)

  def backward(saved, cotangent):
    state, x, extra = saved
    # nan_to_num: a non-finite cotangent must not turn the zero into NaN. (The output may
    # be a pytree, the block's output first: its first element's cotangent.)
    first = jax.tree.leaves(cotangent)[0]
    zero = jnp.nan_to_num(first.reshape(-1)[0].astype(jnp.float32) * 0.0)
    _, vjp = jax.vjp(lambda s, x: f(s, x, *extra), state, x + zero.astype(x.dtype))
    return (*vjp(cotangent), *(None for _ in extra))

  run.defvjp(forward, backward)
  return run(state, x, *extra)


def run_blocks(blocks: nnx.Module, x: jax.Array, call: Callable, *extra: Any,
               num_layers: int, scanned: bool, remat: str = "none",
               with_aux: bool = False) -> Any:
  """``x`` through ``num_layers`` blocks in order: ``call(block, x, layer, *extra)`` each.

  blocks: an ``nnx.List`` of blocks, or (``scanned``) one module of their params
  stacked ``[num_layers, ...]``, which ``jax.lax.scan`` reads in place (``layer`` is
  then a traced int). ``extra`` (keys, row ids) is passed through unchanged and gets
  no gradient. Inside a ``shard_map`` over ``"data"``, each block's params split over
  it (FSDP) are gathered at the block's start.

  ``with_aux``: ``call`` returns ``(x, aux)``, ``aux`` a pytree of a block's side results
  (a MoE block's router statistics) or None (a block with none; never under
  ``scanned``). Returns ``(x, the blocks' aux stacked on a new leading axis)``, or
  ``(x, None)`` when no block gave any.
  """
  policy = remat_policy(remat)
  if scanned:
    graphdef, stacked = nnx.split(blocks)

    def layer_step(state, x, layer):  # FSDP: this layer's params gathered here
      return call(nnx.merge(graphdef, gather_block(state)), x, layer, *extra)

    if policy is not None:
      layer_step = jax.checkpoint(layer_step, policy=policy)
    if with_aux:
      return jax.lax.scan(lambda x, sl: layer_step(sl[0], x, sl[1]), x,
                          (stacked, jnp.arange(num_layers)))
    x, _ = jax.lax.scan(lambda x, sl: (layer_step(sl[0], x, sl[1]), None), x,
                        (stacked, jnp.arange(num_layers)))
    return x
  auxes = []
  for layer, block in enumerate(blocks):
    graphdef, state = nnx.split(block)  # blocks may differ (dense and MoE layers)

    def block_step(state, x, layer, graphdef=graphdef):  # FSDP: gathered here
      return call(nnx.merge(graphdef, gather_block(state)), x, layer, *extra)

    if remat == "block":
      out = recompute_in_backward(
          lambda s, x, *e, layer=layer, graphdef=graphdef: call(
              nnx.merge(graphdef, gather_block(s)), x, layer, *e), state, x, *extra)
    elif policy is not None:
      out = jax.checkpoint(block_step, policy=policy, static_argnums=(2,))(state, x, layer)
    else:
      out = block_step(state, x, layer)
    if not with_aux:
      x = out
      continue
    x, aux = out
    if aux is not None:
      auxes.append(aux)
  if not with_aux:
    return x
  return x, (jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes else None)
