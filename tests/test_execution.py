"""models/execution.py: how a step runs, apart from what the model is."""

import dataclasses
from pathlib import Path

import jax
import pytest
from flax import nnx

import flax_tp
from flax_tp.param_info import ParamInfo
from models.config import TransformerConfig
from models.execution import Execution, view
from models.transformer import Transformer


def test_the_architecture_holds_no_execution_field():
  names = {f.name for f in dataclasses.fields(Execution)}
  assert names == {"sequence_parallel", "remat", "scan_layers", "fsdp", "context_parallel",
                   "expert_axes", "expert_dispatcher", "microbatches", "pipeline_schedule",
                   "pipeline_repeats", "pipelined", "attention", "loss_chunks"}
  # one name on both, meaning two things: the config's Attention record (what attention
  # is) and Execution's kernel choice (how it runs; the accelerator issue's spelling)
  assert names & {f.name for f in dataclasses.fields(TransformerConfig)} == {"attention"}
  with pytest.raises(ValueError, match="fsdp is how a step runs"):
    TransformerConfig.preset("tiny", fsdp=True)
  with pytest.raises(ValueError, match="remat must be one of .* got 'sometimes'"):
    Execution(remat="sometimes")
  assert Execution(sequence_parallel=True, remat="block", fsdp=True).describe() == [
      "sequence parallel", "remat block", "FSDP over data"]
  # The experts' axes: checked, in device order, a string taken as the CLI gives it.
  assert Execution().expert_axes == ("data",)
  assert Execution(expert_axes=("context", "data")).expert_axes == ("data", "context")
  assert Execution(expert_axes="data,model").describe() == ["experts over data x model"]
  with pytest.raises(ValueError, match="bad expert axes 'model': no 'data'"):
    Execution(expert_axes="model")
  assert Execution(expert_dispatcher="all_to_all").describe() == [
      "experts dispatched all-to-all"]
  assert Execution(loss_chunks=4, remat="save_attention").describe() == [
      "remat save_attention", "head and loss in 4 pieces"]
  with pytest.raises(ValueError, match="loss_chunks must be a positive integer, got 0"):
    Execution(loss_chunks=0)
  with pytest.raises(ValueError, match="expert_dispatcher must be one of"):
    Execution(expert_dispatcher="all-to-all")  # (the CLI's spelling; the record's is _)


def test_apply_in_its_order_and_a_view_shares_the_params():
  """Sequence parallelism set on the region-closing layers, blocks stacked, then split over
  "data" with the blocks' params recorded as gathered per block; a view changes only what
  changes no param, sharing the arrays."""
  mesh = flax_tp.make_mesh("2x4")
  cfg = TransformerConfig.preset("llama-tiny")
  model = Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0),
                      execution=Execution(sequence_parallel=True, scan_layers=True, fsdp=True))
  assert model.embed.sequence_parallel and model.blocks.attn.o.sequence_parallel
  assert model.blocks.mlp.down.sequence_parallel and not model.blocks.attn.q.sequence_parallel
  infos = {".".join(map(str, p)): ParamInfo.of(v)
           for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert all(i.is_stacked for p, i in infos.items() if p.startswith("blocks."))
  assert all(i.fsdp_per_block == p.startswith("blocks.") for p, i in infos.items()
             if i.over_data)
  plain = view(model, dataclasses.replace(model.execution, sequence_parallel=False))
  assert not plain.embed.sequence_parallel and not plain.blocks.attn.o.sequence_parallel
  assert model.embed.sequence_parallel  # the model itself is unchanged
  for a, b in zip(jax.tree.leaves(nnx.state(plain)), jax.tree.leaves(nnx.state(model)),
                  strict=True):
    assert a is b  # the same arrays, not copies
  with pytest.raises(ValueError, match="a view may change sequence_parallel, remat, "
                     "context_parallel and attention only"):
    view(model, Execution())


def test_an_execution_option_given_as_an_architecture_field_is_named():
  from models.hf import load_hf
  with pytest.raises(ValueError, match=r"fsdp is how a step runs, not what the model is: pass "
                     r"execution=Execution\(fsdp=...\)"):
    TransformerConfig.preset("tiny", fsdp=True)
  with pytest.raises(ValueError, match=r"scan_layers is how a step runs"):
    load_hf(Path(__file__).parent / "fixtures" / "hf" / "llama", flax_tp.make_mesh("1x1"),
            scan_layers=True)
