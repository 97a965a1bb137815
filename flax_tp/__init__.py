"""flax_tp: Megatron-style tensor parallelism for Flax NNX."""

from flax_tp.collectives import (
    all_gather,
    all_reduce,
    axis_is_bound,
    copy_all_to_parallel,
    copy_to_parallel,
    gather_to_parallel,
    reduce_scatter,
    shard_index,
)
from flax_tp.embedding import ParallelEmbedding, VocabParallelEmbedding
from flax_tp.host_memory import keep_freed_host_memory
from flax_tp.linear import ColumnParallelDense, RowParallelDense, fused_column_parallel
from flax_tp.logical import load_unsharded, unshard
from flax_tp.lora import LoRAConfig, add_adapters, add_lora
from flax_tp.loss import chunked_token_loss, kept_token_count, vocab_parallel_cross_entropy
from flax_tp.mesh import (
    CONTEXT_AXIS,
    DATA_AXIS,
    MODEL_AXIS,
    STAGE_AXIS,
    MeshAxes,
    make_mesh,
    parse_mesh_spec,
)
from flax_tp.moe import (
    TRAINED,
    MoE,
    Router,
    RouterStats,
    SelectionBias,
    SwiGLU,
    load_balancing_loss,
    router_z_loss,
)
from flax_tp.norm import logical_norm
from flax_tp.params import place_on_mesh, replicate_on_mesh
from flax_tp.partition import (
    KVHeadLayout,
    SegmentedLayout,
    ShardLayout,
    split_tensor_for_parallelism,
)
from flax_tp.pipeline import (
  StagePlan,
  merge_stages,
  pipeline_1f1b_loss,
  run_pipeline,
  split_into_stages,
)
from flax_tp.plan import explain_plan, parallelize
from flax_tp.sampling import vocab_parallel_sample
from flax_tp.split_norm import SplitRMSNorm
from flax_tp.stack import layer_runs, stack_layer_runs, stack_layers

__all__ = [
    "SwiGLU",
    "all_gather",
    "all_reduce",
    "axis_is_bound",
    "ColumnParallelDense",
    "CONTEXT_AXIS",
    "STAGE_AXIS",
    "copy_all_to_parallel",
    "copy_to_parallel",
    "DATA_AXIS",
    "explain_plan",
    "fused_column_parallel",
    "gather_to_parallel",
    "keep_freed_host_memory",
    "kept_token_count",
    "load_balancing_loss",
    "KVHeadLayout",
    "load_unsharded",
    "logical_norm",
    "make_mesh",
    "MeshAxes",
    "MODEL_AXIS",
    "MoE",
    "LoRAConfig",
    "add_adapters",
    "add_lora",
    "ParallelEmbedding",
    "parallelize",
    "parse_mesh_spec",
    "place_on_mesh",
    "reduce_scatter",
    "replicate_on_mesh",
    "Router",
    "RouterStats",
    "router_z_loss",
    "RowParallelDense",
    "SegmentedLayout",
    "SelectionBias",
    "SplitRMSNorm",
    "shard_index",
    "ShardLayout",
    "TRAINED",
    "split_tensor_for_parallelism",
    "stack_layers",
    "stack_layer_runs",
    "layer_runs",
    "StagePlan",
    "merge_stages",
    "pipeline_1f1b_loss",
    "run_pipeline",
    "split_into_stages",
    "unshard",
    "vocab_parallel_cross_entropy",
    "chunked_token_loss",
    "vocab_parallel_sample",
    "VocabParallelEmbedding",
]
