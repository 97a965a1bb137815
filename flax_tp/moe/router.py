"""The router: how a token picks its experts and weighs them, and the statistics its losses
are built from (the load-balancing loss, the router z-loss).

The router runs in float32: the logits ``x @ router`` and their scores, then top-k
(renormalised when ``normalize``, as in Mixtral and Qwen3-MoE; without it, as in
Qwen2-MoE with ``norm_topk_prob: false``). Each MoE call returns ``RouterStats``, the sums
the losses are built from, so that they can be summed over layers and data shards before
the loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_tp.collectives import all_reduce
from flax_tp.mesh import DATA_AXIS

Array = jax.Array


class RouterStats(NamedTuple):
  """Sums over the tokens a router saw (one layer's, or several layers' added up).

  ``counts [E]``: how many of the tokens' top-k choices picked each expert (the
  per-expert load, before any capacity drops); ``probs [E]``: the sum of the router's
  softmax probabilities per expert; ``z``: the sum of ``logsumexp(logits) ** 2``;
  ``tokens``: how many tokens; ``dropped``: how many choices a capacity dropped. Inside a
  map a shard counts the drops of its own experts, over every shard's tokens: like the
  rest, the shards' values sum to the whole. Sums, not means, so layers and data shards
  add up before the losses divide.
  """

  counts: Array
  probs: Array
  z: Array
  tokens: Array
  dropped: Array

  def __add__(self, other: RouterStats) -> RouterStats:  # type: ignore[override]
    return RouterStats(*(a + b for a, b in zip(self, other, strict=True)))

  def all_reduce(self, axis_name: str = DATA_AXIS) -> RouterStats:
    """The sums over every device of ``axis_name`` (inside a ``shard_map``)."""
    return RouterStats(*(all_reduce(x, "sum", axis_name) for x in self))


SCORES = ("softmax", "sigmoid")


class SelectionBias(nnx.Param):
  """A router's selection bias ``[E]`` (DeepSeek-V3's ``e_score_correction_bias``):
  float32, replicated, added to the scores only to pick the experts, never to the weights.
  A param (it is checkpointed, exported and moved with the rest) that the optimizer leaves
  out: ``nnx.Optimizer(model, tx, wrt=flax_tp.TRAINED)``; it gets no gradient."""


# The params an optimizer trains: every param but a router's selection bias.
TRAINED = nnx.All(nnx.Param, nnx.Not(SelectionBias))


@dataclasses.dataclass(frozen=True)
class Router:
  """How a router turns its logits into each token's experts and weights: a declaration,
  the one place the MoE families differ in routing.

  ``score``: ``"softmax"`` over the experts (Mixtral, Qwen) or an independent
  ``"sigmoid"`` per expert (DeepSeek-V3, GLM-4.5). ``groups`` / ``top_groups``
  (HF's ``n_group`` / ``topk_group``): the experts in ``groups`` equal groups, each
  group ranked by the sum of its two best scores (selection bias included), and a token's
  experts picked only from its ``top_groups`` best groups. The top-k are picked by score
  plus the selection bias (if any), and weighted by the score alone; ``normalize``
  renormalises them to sum to one (HF's ``norm_topk_prob``; a sigmoid's with
  transformers' ``1e-20`` in the denominator), and all are then multiplied by ``scale``
  (``routed_scaling_factor``).
  """

  top_k: int
  score: str = "softmax"
  normalize: bool = True
  groups: int = 1
  top_groups: int = 1
  scale: float = 1.0

  def __post_init__(self):
    if self.score not in SCORES:
      raise ValueError(f"router score must be one of {SCORES}, got {self.score!r}")
    for name in ("top_k", "groups", "top_groups"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"router {name} must be a positive integer, got {value!r}")
    if self.top_groups > self.groups:
      raise ValueError(f"router top_groups {self.top_groups} is more than its groups "
                       f"{self.groups}")
    if not (isinstance(self.scale, (int, float)) and 0 < self.scale < math.inf):
      raise ValueError(f"router scale must be a finite number > 0, got {self.scale!r}")

  def check(self, num_experts: int) -> None:
    """``ValueError`` naming what cannot route ``num_experts`` experts."""
    if num_experts % self.groups:
      raise ValueError(f"router groups {self.groups} do not divide num_experts {num_experts}")
    per_group = num_experts // self.groups
    if self.groups > 1 and per_group < 2:
      raise ValueError(f"router groups are ranked by their two best experts: "
                       f"{num_experts} experts in {self.groups} groups leave {per_group}")
    if self.top_k > self.top_groups * per_group:
      raise ValueError(f"top_k {self.top_k} is more than the {self.top_groups} x {per_group} "
                       f"experts of the groups a token may pick")

  def __call__(self, logits: Array, bias: Array | None = None
               ) -> tuple[Array, Array, Array]:
    """``logits [t, E]`` (float32) and ``bias [E]`` (or None) -> ``(weights [t, k],
    experts [t, k] int32, probs [t, E])``: ``probs`` is the softmax, or a sigmoid's scores
    normalised per token (DeepSeek-V3's balance loss's), which the load-balancing loss
    reads."""
    logits = logits.astype(jnp.float32)
    if self.score == "softmax":
      scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
      scores = jax.nn.sigmoid(logits)
      probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    # Picking is not differentiable: the bias moves which experts, never a weight.
    choice = scores if bias is None else scores + jax.lax.stop_gradient(
        bias.astype(jnp.float32))
    if self.groups > 1:
      t, e = choice.shape
      grouped = choice.reshape(t, self.groups, e // self.groups)
      group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [t, groups]
      _, best = jax.lax.top_k(group_scores, self.top_groups)
      allowed = jnp.any(jax.nn.one_hot(best, self.groups, dtype=bool), axis=-2)
      allowed = jnp.repeat(allowed, e // self.groups, axis=-1)
      choice = jnp.where(allowed, choice, -jnp.inf)
    values, experts = jax.lax.top_k(choice, self.top_k)
    weights = (values if choice is scores
               else jnp.take_along_axis(scores, experts, axis=-1))
    if self.normalize:
      total = jnp.sum(weights, axis=-1, keepdims=True)
      weights = weights / (total if self.score == "softmax" else total + 1e-20)
    if self.scale != 1.0:
      weights = weights * self.scale
    return weights, experts.astype(jnp.int32), probs


def route(logits: Array, top_k: int, normalize: bool) -> tuple[Array, Array, Array]:
  """``logits [t, E]`` (float32) -> ``(weights [t, k], experts [t, k], probs [t, E])``:
  the softmax, its top-k, renormalised to sum to one when ``normalize``
  (``Router(top_k, normalize=normalize)``)."""
  return Router(top_k, normalize=normalize)(logits)


def router_stats(logits: Array, probs: Array, experts: Array,
                 valid: Array | None = None) -> RouterStats:
  """The sums of one router call over its ``t`` tokens (``logits, probs [t, E]``,
  ``experts [t, k]``); ``valid [t]`` (bool), if given, leaves the false ones out
  (sequence padding)."""
  num_experts = probs.shape[-1]
  keep = (jnp.ones(probs.shape[:1], jnp.float32) if valid is None
          else valid.astype(jnp.float32))
  picked = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * keep[:, None, None]
  counts = jnp.sum(picked, axis=(0, 1))
  z = jnp.sum(keep * jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))
  return RouterStats(jax.lax.stop_gradient(counts), jnp.sum(probs * keep[:, None], axis=0), z,
                     jnp.sum(keep), jnp.zeros((), jnp.float32))


def load_balancing_loss(stats: RouterStats) -> Array:
  """transformers' ``load_balancing_loss_func`` (Switch Transformer's auxiliary loss) of
  the tokens ``stats`` sums over: ``E * sum_e f_e * P_e``. Here ``f_e`` is the fraction
  of top-k choices that picked expert ``e`` (summed over the k choices, as transformers
  sums its ``[k, E]`` means) and ``P_e`` is the mean router probability of ``e``.
  Several layers' stats added together give the loss of their concatenated router
  logits, as transformers computes it. Multiply by ``router_aux_loss_coef`` for the
  term a fine-tune adds to its loss.
  """
  num_experts = stats.probs.shape[-1]
  return num_experts * jnp.sum((stats.counts / stats.tokens) * (stats.probs / stats.tokens))


def router_z_loss(stats: RouterStats) -> Array:
  """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits) ** 2``."""
  return stats.z / stats.tokens
