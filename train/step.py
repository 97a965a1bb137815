"""One training step as data: a single shard_map for forward + backward, then optax.

    tokens [B, S+1] sharded over "data" (a context axis splits S inside the map)
      -> shard_map over the mesh's axes (Trainer._map):
           Transformer on local shards -> local logits [b, S, vocab_pad] (by pieces of
           the sequence with Execution.loss_chunks; 1F1B: on the last stage)
           -> vocab_parallel_cross_entropy -> this shard's share of the mean loss
           -> jax.grad (Megatron's conjugate collectives come from check_vma)
           -> params entered per-replica over "data" once, so each gradient is
              summed locally and all-reduced over "data" once (data parallelism)
      -> optax update on the global, sharded params (elementwise, stays sharded)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import flax_tp
from flax_tp.collectives import is_varying
from flax_tp.data_parallel import batch_axes, gather_for_step, global_rows
from flax_tp.host_memory import keep_freed_host_memory
from flax_tp.mesh import split_over
from flax_tp.pipeline import split_microbatches
from flax_tp.stack import stacked_layers
from models.transformer import Transformer
from train.job import OptimizerJob


def _is_matrix(param: Any) -> Any:
  """Whether weight decay applies: matrices (kernels, embeddings), not biases or norms.

  A stacked param's leading layer axis (``--scan-layers``) does not count, so the
  same params decay whether the blocks are stacked or not.
  """
  if not isinstance(param, nnx.Variable):
    return param.ndim >= 2
  layers = stacked_layers(param)
  return param.replace(param[...].ndim - (layers is not None) >= 2)


def _decay_mask(params: Any) -> Any:
  return jax.tree.map(_is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(*, lr: float, steps: int, warmup_steps: int = 0,
                   weight_decay: float = OptimizerJob.weight_decay,
                   grad_clip: float = OptimizerJob.grad_clip) -> optax.GradientTransformation:
  """AdamW with linear warm-up and cosine decay to 10%; no decay on biases or norms.

  ``weight_decay`` and ``grad_clip`` default to the training job's (``train.job.OptimizerJob``);
  ``warmup_steps`` to none, so that a library call warms up only when asked (the CLI's
  ``--warmup-steps`` default is the job's).
  """
  warmup_steps = min(warmup_steps, max(steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0 if warmup_steps else lr, lr, warmup_steps, max(steps, warmup_steps + 1), lr * 0.1)
  adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=_decay_mask)
  return optax.chain(clip_by_logical_norm(grad_clip), adamw) if grad_clip > 0 else adamw


def clip_by_logical_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """``optax.clip_by_global_norm`` (the same formula) with the norm of the logical
  gradients (``flax_tp.logical_norm``): padding adds nothing and a replicated kv head
  counts once, so clipping scales the step as it does for the plain model.

  ``update(..., grad_norm=)``: that norm, already computed (the ``Trainer`` step passes
  the one it logs, so that it is computed once); without it, it is computed here."""

  def update(updates, state, params=None, *, grad_norm=None, **extra_args):
    del params, extra_args
    norm = flax_tp.logical_norm(updates) if grad_norm is None else grad_norm
    keep = norm < max_norm
    return jax.tree.map(
        lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


@dataclasses.dataclass(frozen=True)
class LossOptions:
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  # Labels equal to this (HF's -100) are left out of the mean, which is taken
  # over the kept tokens of the whole global batch.
  ignore_index: int | None = None
  # Mixture of experts: the router z-loss's weight (ST-MoE). The load-balancing loss's
  # weight is the model's (TransformerConfig.router_aux_loss_coef, from the HF config).
  router_z_loss: float = 0.0


def balance_selection_biases(params: nnx.State, loads: jax.Array,
                             rate: float) -> tuple[nnx.State, jax.Array]:
  """DeepSeek-V3's auxiliary-loss-free load balancing (its report, section 2.1.2): after
  a step, each MoE layer's selection bias moves by ``rate`` per expert, up for an expert
  that took fewer of the step's choices than the layer's mean, down for one that took
  more (``bias += rate * sign(mean(load) - load)``). ``loads [MoE layers, E]``: the
  step's global counts in layer order (the ``"layer_loads"`` of the model's aux).
  Returns the params with the biases moved, and the biases' mean spread (max - min per
  layer) after the move, which the metrics log."""
  flat = nnx.to_flat_state(params)
  in_layer_order = sorted(path for path, var in flat if isinstance(var, flax_tp.SelectionBias))
  vars_at = dict(flat)
  row, spreads, moved = 0, [], {}
  for path in in_layer_order:
    bias = vars_at[path][...]
    layers = bias.reshape(-1, bias.shape[-1]).shape[0]  # a stacked run's [layers, E]
    load = loads[row:row + layers].reshape(bias.shape)
    row += layers
    nudged = bias + (rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
                     ).astype(bias.dtype)
    spreads.append(jnp.reshape(jnp.max(nudged, axis=-1) - jnp.min(nudged, axis=-1), (-1,)))
    moved[path] = vars_at[path].replace(nudged)
  if row != loads.shape[0]:
    raise ValueError(f"{loads.shape[0]} MoE layers' loads for {row} selection biases")
  return (nnx.from_flat_state([(path, moved.get(path, var)) for path, var in flat]),
          jnp.mean(jnp.concatenate(spreads)))


class Trainer:
  """Compiled train and eval steps for one model on its mesh.

  ``params`` is the model's ``nnx.Param`` state (global arrays sharded as the
  layers placed them); the steps take and return it functionally. A model with LoRA
  adapters (``nnx.LoRAParam``) trains them alone: the gradients, the optimizer and its
  state are the adapters'; the base params pass through each step unchanged. A router's
  selection bias (``flax_tp.SelectionBias``) is never the optimizer's: it is a param
  (checkpointed, exported) that no gradient or weight decay moves.
  """

  def __init__(self, model: Transformer, tx: optax.GradientTransformation,
               loss: LossOptions = LossOptions(), *, bias_update_rate: float = 0.0):
    self.graphdef, self.params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
      raise ValueError(f"the model holds non-Param state the step would drop: {rest}")
    self.mesh = model.mesh
    self.cfg = model.cfg
    self.tx = tx
    self.loss_options = loss
    self.specs = nnx.get_partition_spec(self.params)
    self.adapters_only = bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    # What the optimizer updates: the adapters, or every param but selection biases
    # (None: all of them, the params state itself).
    self.trained_filter = (nnx.LoRAParam if self.adapters_only else flax_tp.TRAINED
                           if jax.tree.leaves(nnx.state(model, flax_tp.SelectionBias))
                           else None)
    self.trained_specs = nnx.get_partition_spec(self.trained(self.params))
    # On XLA:CPU the trained params' data-parallel gradient sums travel packed
    # (flax_tp.copy_all_to_parallel), as the dense layers pick their CPU matmul: by the
    # mesh's platform. None elsewhere: one all-reduce per param, XLA's to combine.
    on_cpu = self.mesh.devices.flat[0].platform == "cpu"
    self.packed_gradients = (self.trained_filter or nnx.Param) if on_cpu else None
    # XLA:CPU mallocs each step's temporary buffers and frees them after; glibc's
    # default policy returns them to the kernel, and every step page-faults them back
    # (flax_tp.host_memory). False off CPU, off glibc, or turned off by the user.
    self.keeps_freed_host_memory = on_cpu and keep_freed_host_memory()
    # DeepSeek-V3's auxiliary-loss-free balancing: after each step every selection bias
    # moves by this rate toward its layer's mean load (balance_selection_biases).
    if not (isinstance(bias_update_rate, (int, float)) and 0 <= bias_update_rate < math.inf):
      raise ValueError(f"bias_update_rate must be a finite number >= 0, got "
                       f"{bias_update_rate!r}")
    if bias_update_rate and not jax.tree.leaves(nnx.state(model, flax_tp.SelectionBias)):
      raise ValueError("bias_update_rate balances routers' selection biases; this model has "
                       "none (router_selection_bias is False)")
    if bias_update_rate and self.adapters_only:
      raise ValueError("bias_update_rate moves selection biases, which LoRA freezes with the "
                       "rest of the base (a LoRA checkpoint holds the adapters alone)")
    self.bias_update_rate = float(bias_update_rate)
    # On a one-device data axis the batch is named replicated, so that no
    # (one-device) gradient all-reduce over "data" is emitted at all.
    self.batch_spec = P(split_over(flax_tp.DATA_AXIS, self.mesh.shape[flax_tp.DATA_AXIS]))
    self.batch_sharding = NamedSharding(self.mesh, self.batch_spec)
    # Execution.microbatches on a model without pipeline stages: gradient accumulation,
    # each microbatch (split_microbatches' rows, the same global rows on every mesh) a
    # forward and backward of its own, the gradients summed; a pipeline runs its own.
    self.accumulation = model.execution.microbatches if model.pipeline is None else 1
    self.train_step = jax.jit(self._train_step, donate_argnums=(0, 1))
    self.eval_step = jax.jit(self._eval_loss)
    self._compiled_loss_and_grads = jax.jit(self._loss_and_grads)

  def trained(self, params: nnx.State) -> nnx.State:
    """The params the optimizer updates: the adapters (with LoRA), or all but the
    routers' selection biases."""
    if self.trained_filter is None:
      return params
    return nnx.split_state(params, self.trained_filter, ...)[0]

  def saved(self, params: nnx.State) -> nnx.State:
    """What a run's checkpoint holds of ``params``: the adapters (with LoRA; the base is
    read from where it came from), else every param, selection biases included."""
    return nnx.split_state(params, nnx.LoRAParam, ...)[0] if self.adapters_only else params

  def with_saved(self, params: nnx.State, saved: nnx.State) -> nnx.State:
    """``params`` with what ``saved`` returned (restored from a checkpoint) put back."""
    return self.with_trained(params, saved) if self.adapters_only else saved

  def with_trained(self, params: nnx.State, trained: nnx.State) -> nnx.State:
    """``params`` with its trained part replaced by ``trained``, in ``params``' order
    (a step's update, or the adapters a LoRA checkpoint restores)."""
    if self.trained_filter is None:
      return trained
    flat = dict(nnx.to_flat_state(trained))
    return nnx.from_flat_state([(path, flat.get(path, var))
                                for path, var in nnx.to_flat_state(params)])

  def _value_and_grad(self, fn: Callable, has_aux: bool = False) -> Callable:
    """``jax.value_and_grad`` of ``fn(params, *args)`` with respect to the trained params
    only (the frozen base gets no gradient, so none is computed or reduced)."""
    if self.trained_filter is None:
      return jax.value_and_grad(fn, has_aux=has_aux)

    def run(params, *args):
      return jax.value_and_grad(
          lambda trained: fn(self.with_trained(params, trained), *args),
          has_aux=has_aux)(self.trained(params))
    return run

  def init_opt_state(self, params: nnx.State) -> Any:
    # Eager on purpose: zeros_like keeps each param's sharding, so the moments
    # are sharded (and padded) exactly like the params. Scalars (step counts) are
    # replicated on the mesh, not left on one device.
    replicated = NamedSharding(self.mesh, P())

    def on_mesh(x):
      if isinstance(x, jax.Array) and not (isinstance(x.sharding, NamedSharding)
                                           and x.sharding.mesh == self.mesh):
        return jax.device_put(x, replicated)
      return x

    return jax.tree.map(on_mesh, self.tx.init(self.trained(params)))

  def model(self, params: nnx.State) -> Transformer:
    """The module view of ``params`` (``self.params`` is donated by the first step)."""
    return nnx.merge(self.graphdef, params)

  # -- the step ----------------------------------------------------------------

  def _local_loss(self, params: nnx.State, tokens: jax.Array, key: jax.Array | None,
                  labels: jax.Array | None = None, options: LossOptions = LossOptions(),
                  with_aux: bool = False, aux_losses: bool = True, *,
                  rows: jax.Array | None = None, count: jax.Array | None = None,
                  aux_weight: float = 1.0):
    """Mean loss over the *global* batch from this device's shard: summed over "data".

    ``labels`` ``[b, S]`` (default: ``tokens[:, 1:]``) may hold
    ``options.ignore_index`` to leave tokens out (a prompt in fine-tuning). The model
    runs ``model.step_tokens(tokens)`` and adds its own losses (``model.aux_losses``, from
    its aux summed over the global batch: a mixture of experts' router losses).
    ``with_aux``: returns ``(loss, (the model's metrics, its global aux))``;
    ``aux_losses=False``: the cross-entropy alone (the eval loss).
    One microbatch of an accumulated step (``_accumulated``): ``rows``, its rows' global
    ids (dropout's keys); ``count``, the whole step's token count (``_global_count``);
    ``aux_weight``, its share of the model's own losses (1 / M).
    """
    # Mark the params as per-replica once, here: backward then sums each param's
    # gradient locally (the tied embedding is used twice) and all-reduces it over
    # "data" once, instead of once per use; a param split over "data" (FSDP) is
    # all-gathered here instead (a block's by the block), its gradient reduce-scattered.
    params = gather_for_step(params, differentiated=self.packed_gradients)
    model = nnx.merge(self.graphdef, params)
    model_tokens = model.step_tokens(tokens)
    model_len = model_tokens.shape[1]
    labels = tokens[:, 1:] if labels is None else labels
    batch, seq_len = labels.shape
    if count is None:  # (before the labels are cut into context slots)
      count = self._global_count(labels, options)
    # Context parallel: this device's logits are its slots' (ContextSplit) of the
    # model's model_len tokens; the labels are lined up with them, a padding slot's (and
    # a token the model runs beyond the labels, which predicts nothing) left out of the
    # loss and its gradient.
    context = model.activation_layout(model_len).context
    if context is not None:
      fill = 0 if options.ignore_index is None else options.ignore_index
      labels = context.local(jnp.pad(labels, ((0, 0), (0, model_len - seq_len)),
                                     constant_values=fill), fill=fill)
    reduce_over = batch_axes()  # "data" (and "context"): one all-reduce

    def per_token_loss(logits, labels, scored=None):
      """Each of these logits' tokens' loss ``[b, c]`` (in a context padding slot,
      ``scored`` False: zero)."""
      per_token = flax_tp.vocab_parallel_cross_entropy(
          logits, labels, vocab_size=self.cfg.vocab_size,
          label_smoothing=options.label_smoothing, z_loss=options.z_loss,
          ignore_index=options.ignore_index)
      if scored is not None:
        per_token = jnp.where(scored, per_token, jnp.zeros((), per_token.dtype))
      return per_token

    # The per-token arrays the head's pieces are scored with: the labels, and with a
    # context axis which of this device's slots hold a token that predicts one.
    per_token = (labels,) if context is None else (
        labels, jnp.broadcast_to(context.positions() < seq_len, labels.shape))
    if model.pipeline is not None and model.pipeline.schedule == "1f1b":
      # Each microbatch's loss taken as it leaves the last stage, its backward begun.
      # (1F1B refuses a model with aux: it needs every microbatch's first.)
      local = model.pipelined_loss(model_tokens, per_token_loss, per_token, count=count,
                                   dropout_key=key)
      aux = {}
    else:
      local, aux = model(model_tokens, dropout_key=key, with_aux=True, rows=rows,
                         per_token_loss=per_token_loss, per_token=per_token)
      local = local / count
    # The aux's sums over every data and context shard's tokens.
    aux = jax.tree.map(lambda a: flax_tp.all_reduce(a, "sum", reduce_over), aux)
    loss = flax_tp.all_reduce(local, "sum", reduce_over)
    if aux_losses:
      for weighted in model.aux_losses(aux, options).values():
        loss = loss + aux_weight * weighted
    return (loss, (model.aux_metrics(aux), aux)) if with_aux else loss

  @staticmethod
  def _global_count(labels: jax.Array, options: LossOptions) -> jax.Array | int:
    """How many tokens the step's loss is the mean over, from this device's ``labels [b,
    S]`` (its data shard's, whole: the same on every context and model device): all of the
    global batch's, or those not ``options.ignore_index`` (one all-reduce over "data")."""
    batch, seq_len = labels.shape
    if options.ignore_index is None:  # a static count: no communication
      return batch * seq_len * jax.lax.axis_size(flax_tp.DATA_AXIS)
    kept = flax_tp.kept_token_count(labels, options.ignore_index)
    return jnp.maximum(flax_tp.all_reduce(kept, "sum", flax_tp.DATA_AXIS), 1.0)

  def _accumulated(self, params, tokens, key, labels, *, options: LossOptions,
                   with_aux: bool, differentiate: bool = True, aux_losses: bool = True):
    """Inside the step's map: ``_local_loss`` (and its gradients: ``differentiate``) as a
    sum over ``self.accumulation`` microbatches of this device's rows, one after another
    (a ``lax.scan``: one microbatch's activations live at a time), each normalized by the
    whole step's token count and adding 1 / M of the model's own losses. The rows of
    microbatch ``m`` are ``split_microbatches``': the same global rows on every mesh, as a
    pipeline's. Returns what ``_local_loss`` (``jax.value_and_grad`` of it) returns, the
    aux per microbatch ``[M, ...]`` (its metrics from all of them)."""
    M, batch = self.accumulation, tokens.shape[0]
    if batch % M:
      raise ValueError(f"microbatches={M} does not divide the {batch} rows each data shard "
                       "runs")
    full_labels = tokens[:, 1:] if labels is None else labels
    count = self._global_count(full_labels, options)
    rows = (global_rows(batch) if is_varying(tokens, flax_tp.DATA_AXIS)
            else jnp.arange(batch))
    xs = (split_microbatches(tokens, M), split_microbatches(rows, M),
          split_microbatches(full_labels, M) if labels is not None else None)

    def one(tokens_m, rows_m, labels_m):
      """(loss, aux or None, grads or None) of one microbatch."""
      loss = functools.partial(self._local_loss, options=options, with_aux=with_aux,
                               aux_losses=aux_losses, rows=rows_m, count=count,
                               aux_weight=1.0 / M)
      if differentiate:
        loss = self._value_and_grad(loss, has_aux=with_aux)
      out = loss(params, tokens_m, key, *(() if labels_m is None else (labels_m,)))
      value, grads = out if differentiate else (out, None)
      value, aux = value if with_aux else (value, (None, None))
      return value, aux[1], grads

    loss, first_aux, grads = one(*jax.tree.map(lambda a: a[0], xs))

    def body(total, x):
      value, aux, grads = one(*x)
      return jax.tree.map(jnp.add, total, (value, grads)), aux

    (loss, grads), rest = jax.lax.scan(body, (loss, grads), jax.tree.map(lambda a: a[1:], xs))
    if with_aux:
      aux = jax.tree.map(lambda a, r: jnp.concatenate([a[None], r]), first_aux, rest)
      if "layer_loads" in aux:
        aux["layer_loads"] = aux["layer_loads"].sum(0)
      loss = (loss, (self.model(params).aux_metrics(aux), aux))
    return (loss, grads) if differentiate else loss

  def _map(self, fn: Callable, out_specs: Any, with_labels: bool = False) -> Callable:
    labels = (self.batch_spec,) if with_labels else ()
    return jax.shard_map(fn, mesh=self.mesh,
                         in_specs=(self.specs, self.batch_spec, P(), *labels),
                         out_specs=out_specs)

  def loss_and_grads(self, params, tokens, key=None, labels=None):
    """(loss, grads) of the mean next-token loss; grads sharded like params. Compiled
    (eagerly a ``shard_map`` runs op by op: 93 s for ``moe-tiny`` on 2x4, against 2 s);
    inside a caller's ``jit`` it is inlined."""
    return self._compiled_loss_and_grads(params, tokens, key, labels)

  def _step_loss(self, *, options: LossOptions, with_aux: bool = False,
                 differentiate: bool = True, aux_losses: bool = True) -> Callable:
    """``f(params, tokens, key[, labels])`` inside the map: ``_local_loss`` (with
    ``differentiate``, its value and gradients), over the step's microbatches when it
    accumulates (``_accumulated``)."""
    if self.accumulation > 1:
      return lambda params, tokens, key, labels=None: self._accumulated(
          params, tokens, key, labels, options=options, with_aux=with_aux,
          differentiate=differentiate, aux_losses=aux_losses)
    loss = functools.partial(self._local_loss, options=options, with_aux=with_aux,
                             aux_losses=aux_losses)
    return self._value_and_grad(loss, has_aux=with_aux) if differentiate else loss

  def _loss_and_grads(self, params, tokens, key, labels):
    mapped = self._map(self._step_loss(options=self.loss_options),
                       (P(), self.trained_specs), labels is not None)
    return mapped(params, tokens, key, *(() if labels is None else (labels,)))

  def _train_step(self, params, opt_state, tokens, key):
    value_and_grad = self._step_loss(options=self.loss_options, with_aux=True)

    def local_step(params, tokens, key):
      out, grads = value_and_grad(params, tokens, key)
      # The gradients' logical norm, from the devices' shards where they are computed.
      # Where their data-parallel sums travel packed (XLA:CPU, a batch axis of several
      # devices) each set of axes' gradients are slices of one buffer, and their
      # squares are summed as that buffer: a few reductions, not one per param (without
      # the buffer, joining them would be a copy). The logged metric and clipping both
      # take it.
      packed = (self.packed_gradients is not None
                and any(jax.lax.axis_size(a) > 1 for a in batch_axes()))
      return out, grads, flax_tp.logical_norm(grads, contiguous=packed)

    # (The model's metrics and aux are global sums, the same on every device.)
    (loss, (metrics, aux)), grads, grad_norm = self._map(
        local_step, ((P(), P()), self.trained_specs, P()))(params, tokens, key)
    trained = self.trained(params)
    updates, new_opt_state = optax.with_extra_args_support(self.tx).update(
        grads, opt_state, trained, grad_norm=grad_norm)
    # A step whose loss or gradient norm is not finite is not applied: params and optimizer
    # state come back as they went in (the caller stops the run). Both scalars are global
    # (replicated), so the choice needs no communication, and it joins the update's own
    # elementwise pass.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(finite, new, old)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    params = self.with_trained(params, jax.tree.map(
        keep, optax.apply_updates(trained, updates), trained))
    if self.bias_update_rate:
      params, spread = balance_selection_biases(params, aux["layer_loads"],
                                                self.bias_update_rate)
      metrics["selection_bias_spread"] = spread
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm, **metrics}

  def held(self, params: nnx.State, opt_state: Any) -> HeldState:
    """``params`` and ``opt_state`` held for a run of train steps as lists of their
    arrays (``HeldState``): the same step, without an ``nnx.State``'s Python flatten
    and unflatten around every call."""
    return HeldState(self, params, opt_state)

  def _eval_loss(self, params, tokens):
    # Plain cross-entropy (no smoothing, no z-loss, no router losses): comparable
    # across runs.
    return self._map(self._step_loss(options=LossOptions(), differentiate=False,
                                     aux_losses=False), P())(params, tokens, None)


class HeldState:
  """A run's params and optimizer state between train steps, held as two lists of their
  arrays (each sharded as ``Trainer.train_step`` returns it), and the step over them.

  jax flattens a list of arrays in C++; an ``nnx.State`` (and optax's state around
  ``nnx.State`` moments) is flattened and rebuilt in Python at each call of a jitted
  function: for ~125M's 335 arrays, 1.7 ms in and 3.6 ms out on a 2-core CI machine, about
  2 ms on a TPU host, per step. The loop reads each step's loss (a non-finite step is not
  applied and stops the run), so that time is between two steps on the device, 3-4% of
  a ~125M step on a TPU v5e (BENCHMARKS.md §6). ``state()`` gives them back as
  ``nnx.State`` (for an eval, a save, a sample), rebuilt once per step at most.
  """

  def __init__(self, trainer: Trainer, params: nnx.State, opt_state: Any):
    self._params, params_def = jax.tree.flatten(params)
    self._opt_state, opt_def = jax.tree.flatten(opt_state)
    self._defs = (params_def, opt_def)
    self._state = (params, opt_state)

    def step(params, opt_state, tokens, key):
      params, opt_state, out = trainer._train_step(
          jax.tree.unflatten(params_def, params), jax.tree.unflatten(opt_def, opt_state),
          tokens, key)
      return jax.tree.leaves(params), jax.tree.leaves(opt_state), out

    # (params leaves, opt_state leaves, tokens, key) -> (the new two, metrics)
    self.jitted = jax.jit(step, donate_argnums=(0, 1))

  @property
  def leaves(self) -> tuple[list[jax.Array], list[jax.Array]]:
    """The held params' and optimizer state's arrays, as ``jitted`` takes them."""
    return self._params, self._opt_state

  def step(self, tokens: jax.Array, key: jax.Array | None) -> dict[str, jax.Array]:
    """One ``Trainer.train_step`` on the held state (donated, replaced by the new);
    returns its metrics."""
    self._params, self._opt_state, out = self.jitted(self._params, self._opt_state,
                                                     tokens, key)
    self._state = None
    return out

  def state(self) -> tuple[nnx.State, Any]:
    """``(params, opt_state)`` as ``Trainer.train_step`` takes and returns them."""
    if self._state is None:
      self._state = (jax.tree.unflatten(self._defs[0], self._params),
                     jax.tree.unflatten(self._defs[1], self._opt_state))
    return self._state

