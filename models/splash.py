"""jax's Pallas splash attention kernel, called per device inside the step's ``shard_map``,
and when a model runs it (``choose_kernel``: ``Execution.attention``'s choice).

``attend(key, q, k, v, sinks)`` runs the kernel (``jax.experimental.pallas.ops.tpu
.splash_attention``) that ``key`` names over a batch: ``q [b, h, S, d]`` over ``k, v [b,
h, S, d]``, or, with ``key.shared_kv``, ``q [b, g, h/g, S, d]`` over ``k, v [b, g, S,
d]`` (grouped-query attention: one kv head per group). ``S`` is a multiple of the
kernel's block (``block_for``); q is already scaled. Its output is q-shaped, in q's
dtype, and it has a derivative: the kernel's own backward kernels.

Why not the kernel's own call: flax_tp's step runs under ``shard_map`` with
``check_vma``, which types every value by the mesh axes it varies over, and the kernel
types none of its outputs (its ``pallas_call`` ``out_shape``s carry no
``manual_axis_type``), which the check refuses. So the kernel's forward and backward
rules (``_splash_attention_fwd`` / ``_bwd`` of jax 0.10.2, the functions its own
``custom_vjp`` is made of) run here with the check off, under a ``custom_vjp`` of ours
that types what leaves it. Its inputs are first typed as varying over every axis any of
them varies over (so the cotangent of one that is the same on several devices, such as
the sinks over "data", is summed over them by that cast's transpose); its output, every
residual and every input cotangent are typed so too (what a per-device kernel's values
are; a residual typed invariant would leave a ``shard_map`` as one device's value).
The result is the kernel's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flax_tp.remat import ATTENTION_OUT

# Execution.attention's choices: "auto" is splash on a TPU where the model allows it,
# XLA elsewhere; "xla" and "splash" are asked for (splash where it cannot run: an error).
KERNELS = ("auto", "xla", "splash")


def splash_unavailable(cfg, context: int) -> str | None:
  """Why the splash kernel cannot serve this model's training attention, or None.

  context: the mesh's context-axis size. The kernel computes one device's whole causal
  sequence; a context shard's blocks (its zigzag slots, the ring's log-sum-exp merge)
  are not written for it yet. Dropout on the probabilities has no place in the kernel.
  """
  if context > 1:
    return (f"the mesh splits the sequence over {context} context devices, whose blocks "
            "the kernel does not compute yet")
  if cfg.dropout > 0.0:
    return f"dropout {cfg.dropout} on the attention probabilities, which the kernel has not"
  return None


def choose_kernel(asked: str, cfg, *, platform: str,
                  context: int = 1) -> tuple[str, str]:
  """The kernel every layer's training attention runs, and why, in words: ``("xla" |
  "splash", reason)``. ``asked``: ``Execution.attention``; ``platform``: the mesh's
  devices' (``"tpu"``, ``"cpu"``, ...). Splash asked where it cannot run is a
  ValueError naming the reason; splash asked off a TPU runs in Pallas interpret mode
  (exact, and slow: for tests). Cached decoding always runs XLA's (one query a row)."""
  if asked not in KERNELS:
    raise ValueError(f"attention must be one of {KERNELS}, got {asked!r}")
  why_not = splash_unavailable(cfg, context)
  if asked == "xla":
    return "xla", "asked for"
  if asked == "splash":
    if why_not:
      raise ValueError(f"attention 'splash' cannot run here: {why_not}; use 'auto' or 'xla'")
    return "splash", ("asked for" if platform == "tpu" else
                      f"asked for, in Pallas interpret mode on {platform} (slow)")
  if platform != "tpu":
    return "xla", f"auto: the kernel is for a TPU, this is {platform}"
  if why_not:
    return "xla", f"auto: {why_not}"
  return "splash", "auto: on a TPU"


# The kernel's blocks: a multiple of 128 (its lanes) and at most 512, MaxText's choice on
# v5e (jax's default 128 is slower there); the sequence is padded to a block.
MAX_BLOCK = 512


def block_for(seq: int) -> int:
  """The q and kv block the kernel uses on a ``seq``-token sequence."""
  return min(MAX_BLOCK, -(-seq // 128) * 128)


class KernelKey(NamedTuple):
  """Which kernel: ``seq`` (padded), query ``heads`` per call, causal ``window`` (None:
  every earlier key), the scores' ``softcap``, ``shared_kv`` (one kv head for the call's
  query heads), Pallas ``interpret`` mode."""

  seq: int
  heads: int
  window: int | None
  softcap: float | None
  shared_kv: bool
  interpret: bool


@functools.lru_cache(maxsize=64)
def kernel_of(key: KernelKey):
  """The kernel ``key`` names, forward and backward blocks given, built once: its mask
  tables as concrete arrays (``ensure_compile_time_eval``: built inside a trace they
  would be that trace's, and leak into the next)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  block = block_for(key.seq)
  shape = (key.seq, key.seq)
  one = (sa.CausalMask(shape) if key.window is None or key.window >= key.seq
         else sa.LocalMask(shape, (key.window - 1, 0), 0))  # q - window < kv <= q
  sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  make = sa.make_splash_mqa if key.shared_kv else sa.make_splash_mha
  with jax.ensure_compile_time_eval():
    return make(sa.MultiHeadMask([one] * key.heads), block_sizes=sizes, head_shards=1,
                q_seq_shards=1, attn_logits_soft_cap=key.softcap, interpret=key.interpret)


def _rules():
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak
  return sak._splash_attention_fwd, sak._splash_attention_bwd


def _static(kernel) -> tuple:
  """The kernel's static arguments, in its rules' order after the arrays."""
  kw = kernel.kwargs
  return (kw["save_residuals"], kw["mask_value"], kw["is_mqa"], kw["block_sizes"],
          kw["residual_checkpoint_name"], kw["mask_function"], kw["attn_logits_soft_cap"],
          kw["interpret"])


def _collapsed(info):
  """A mask table as the kernel's call passes it (its partial blocks ``[n, bq, bkv]``)."""
  if info is None or info.partial_mask_blocks is None:
    return info
  blocks = info.partial_mask_blocks
  return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def _per_example(one, key: KernelKey, sinks_batched: bool):
  """``one`` (a call on ``q [h, S, d]``) over the batch, and over the kv groups too."""
  if key.shared_kv:
    one = jax.vmap(one, in_axes=(0, 0, 0, 0 if sinks_batched else None))
  return jax.vmap(one, in_axes=(0, 0, 0, None))


# _forward and _backward are jitted (closed calls): their outputs keep the types they
# were traced with (none, under the check off) when jax evaluates a step's jaxpr again
# with the check on (a scan's or a cond's linearisation), so the casts ``_attend``
# records after them hold both times.
@functools.partial(jax.jit, static_argnums=0)
def _forward(key: KernelKey, q, k, v, sinks):
  kernel, (fwd, _) = kernel_of(key), _rules()
  infos = tuple(map(_collapsed, (kernel.fwd_mask_info, kernel.dq_mask_info,
                                 kernel.dkv_mask_info)))
  def one(q_, k_, v_, s_):
    out, residuals = fwd(*infos, q_, k_, v_, None, s_, *_static(kernel))
    return out, residuals[:-2]  # not the backward's mask tables: constants (_backward)
  return _per_example(one, key, sinks is not None)(q, k, v, sinks)


@functools.partial(jax.jit, static_argnums=0)
def _backward(key: KernelKey, residuals, d_out):
  """The kernel's backward over the batch (and kv groups). Its mask tables are the
  kernel's constants, given here unbatched: returned by the vmapped forward they would be
  copies per example, and a Pallas call whose block tables vary over a vmapped axis runs
  as a loop of one call per example (on a TPU v5e, 125m at 8 x 1024: 20% slower)."""
  kernel, (_, bwd) = kernel_of(key), _rules()
  tables = tuple(map(_collapsed, (kernel.dq_mask_info, kernel.dkv_mask_info)))
  # dq, dk, dv, segment ids, dsinks
  one = lambda r, d: bwd(*_static(kernel), (*r, *tables), d)[3:]
  if key.shared_kv:
    one = jax.vmap(one)
  dq, dk, dv, _, d_sinks = jax.vmap(one)(residuals, d_out)
  return dq, dk, dv, None if d_sinks is None else d_sinks.sum(0)  # sinks: one per head


def _varies(x) -> frozenset:
  return jax.typeof(x).manual_axis_type.varying


def _typed(tree, axes: frozenset):
  """``tree``'s leaves typed as varying over ``axes`` too (no data moves)."""
  def cast(x):
    missing = tuple(sorted(axes - _varies(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(cast, tree)


def _unchecked():
  from jax._src import config
  return config._check_vma(False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(key, varying, q, k, v, sinks):
  return _attend_fwd(key, varying, q, k, v, sinks)[0]


def _attend_fwd(key, varying, q, k, v, sinks):
  with _unchecked():
    out, residuals = _forward(key, q, k, v, sinks)
  axes = frozenset(varying)  # every input's (``attend``)
  out, residuals = _typed(out, axes), _typed(residuals, axes)
  # A recomputing block (``remat``'s "save_attention") keeps the residuals past q, k and v
  # (the output, its log-sum-exp, the sinks) so that its
  # backward never runs the forward kernel again; q, k and v are the block's own, saved
  # (or not) under their own names.
  q_k_v, rest = residuals[:3], residuals[3:]
  return out, (*q_k_v, *jax.tree.map(lambda r: checkpoint_name(r, ATTENTION_OUT), rest))


def _attend_bwd(key, varying, residuals, d_out):
  with _unchecked():
    grads = _backward(key, residuals, d_out)
  return tuple(None if g is None else _typed(g, frozenset(varying)) for g in grads)


_attend.defvjp(_attend_fwd, _attend_bwd)


def alike(*arrays):
  """``arrays`` (None passes) typed as varying over every axis any of them varies over:
  ``attend``'s inputs, cast where jax's AD sees it, so that the cotangent of an input that
  is the same on some devices (GPT-OSS's sinks over "data") is summed over them by the
  cast's transpose, as any use of it would be. (Cast before a ``lax.cond`` choosing
  between kernels, not inside its branches.)"""
  axes = frozenset().union(*(_varies(a) for a in arrays if a is not None))
  return tuple(None if a is None else _typed(a, axes) for a in arrays)


def attend(key: KernelKey, q, k, v, sinks=None):
  """The kernel ``key`` names over a batch (the module docstring's shapes); ``sinks``
  ``[h]`` (``[g, h/g]`` with ``shared_kv``) logits, or None."""
  if sinks is not None:
    sinks = sinks.astype(jnp.float32)
  q, k, v, sinks = alike(q, k, v, sinks)
  return _attend(key, tuple(sorted(_varies(q))), q, k, v, sinks)
