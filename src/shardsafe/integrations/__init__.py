"""Bridges from PyTorch-native training state to sharded state dicts.

* :mod:`.dtensor` — ``model.state_dict()`` holding DTensors (FSDP2 ``fully_shard``, tensor
  parallel ``parallelize_module``) to ShardedTensors, and back in place on load;
* :mod:`.optimizer` — ``torch.optim`` state in parameter space, sharded like the parameters,
  so it reshards exactly like the weights (ZeRO-1 flat buffers included);
* :mod:`.rng` — per-rank RNG states with an explicit policy for a changed layout;
* :mod:`.megatron` — Megatron-Core's sharded state dicts as they are, and its torch_dist
  directories; :mod:`.dcp_dir` — directories PyTorch DCP's ``FileSystemWriter`` wrote.

``import shardsafe`` imports this package: it registers the DTensor and Megatron adapters and
the two foreign-directory loaders.
"""

from __future__ import annotations

from .dtensor import (
    LocalBox,
    dtensor_aware,
    dtensor_local_boxes,
    dtensor_pieces,
    has_dtensor,
    is_dtensor,
    to_sharded_state_dict,
)
from .optimizer import (
    OptimizerState,
    flat_optimizer_sharded_state_dict,
    init_optimizer_state,
    load_optimizer_state,
    optimizer_sharded_state_dict,
)
from .rng import (
    RngPolicy,
    apply_rng_state,
    capture_rng_state,
    restore_rng,
    rng_load_template,
    rng_sharded_state_dict,
    set_rng_state,
)

__all__ = [
    "LocalBox",
    "OptimizerState",
    "RngPolicy",
    "apply_rng_state",
    "capture_rng_state",
    "dtensor_aware",
    "dtensor_local_boxes",
    "dtensor_pieces",
    "flat_optimizer_sharded_state_dict",
    "has_dtensor",
    "init_optimizer_state",
    "is_dtensor",
    "load_optimizer_state",
    "optimizer_sharded_state_dict",
    "restore_rng",
    "rng_load_template",
    "rng_sharded_state_dict",
    "set_rng_state",
    "to_sharded_state_dict",
]
