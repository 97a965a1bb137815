"""Sharded parameters, by idea (this module re-exports them, so ``flax_tp.state`` keeps
working as an import):

- ``flax_tp.params``: creating a param exactly as Flax does and placing it;
- ``flax_tp.logical``: logical values <-> stored params (``unshard``, ``load_unsharded``);
- ``flax_tp.stack``: layers stacked on a leading axis (``stack_layers``);
- ``flax_tp.norm``: the norm of the logical values (``logical_norm``);
- ``flax_tp.padding``: a layer's in-map view of its params (``masked``, tied copies);
- ``flax_tp.param_info``: the one reader and writer of a param's flax_tp metadata.
"""

from flax_tp.logical import gather_to_host, load_unsharded, logical_value, stored_like, unshard
from flax_tp.norm import logical_norm
from flax_tp.padding import masked, sum_over_replicas
from flax_tp.param_info import FLAX_TP_KEYS
from flax_tp.params import (
    partition_names,
    place,
    place_on_mesh,
    replicate_on_mesh,
    sharded_param,
    user_metadata,
)
from flax_tp.stack import layer_path, per_layer_paths, set_layer, stack_layers, stacked_layers

__all__ = ["FLAX_TP_KEYS", "gather_to_host", "layer_path", "load_unsharded", "logical_norm",
           "logical_value", "masked", "partition_names", "per_layer_paths", "place",
           "place_on_mesh", "replicate_on_mesh", "set_layer", "sharded_param", "stack_layers",
           "stacked_layers", "stored_like", "sum_over_replicas", "unshard", "user_metadata"]
