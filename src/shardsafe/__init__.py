"""shardsafe: distributed checkpointing for PyTorch that is fast, safe and reshards into any layout."""

from __future__ import annotations

import sys

from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CorruptCheckpointError,
    DistributedError,
    IncompatibleRequestError,
    IncompleteCheckpointError,
    MissingKeyError,
    StagingError,
    ValidationError,
    call_each,
)
from .integrations.dcp_dir import is_dcp_dir as _is_dcp_dir
from .integrations.dcp_dir import load_dcp_dir as _load_dcp_dir
from .integrations.dtensor import dtensor_aware as _dtensor_aware
from .integrations.megatron import is_torch_dist_dir as _is_torch_dist_dir
from .integrations.megatron import load_torch_dist_dir as _load_torch_dist_dir
from .integrations.megatron import megatron_aware as _megatron_aware
from .loading import StrictHandling, load, register_foreign_loader
from .manager import CheckpointManager
from .megatron_api import (
    apply_factories,
    apply_factory_merges,
    load_content_metadata,
    load_sharded_metadata,
    load_tensors_metadata,
)
from .reader import (
    CheckpointReader,
    VerifyReport,
    load_common_state_dict,
    load_metadata,
    load_plain_tensors,
)
from .saver import AsyncSaveHandle, Saver, SaveStats, async_save, save, wait_for_saves
from .saver import release as _release_savers
from .sharding import (
    CoordinatorObject,
    LocalNonPersistentObject,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    register_state_dict_adapter,
)

register_state_dict_adapter(_dtensor_aware)  # a model.state_dict() holding DTensors just works
register_state_dict_adapter(_megatron_aware)  # Megatron-Core's own sharded state dicts too
register_foreign_loader(_is_torch_dist_dir, _load_torch_dist_dir)  # and its torch_dist directories
register_foreign_loader(_is_dcp_dir, _load_dcp_dir)  # and PyTorch DCP's FileSystemWriter's


def release() -> None:
    """Wait for the saves in flight of the state this package keeps for its module-level
    functions (the Savers of ``save``/``async_save``, ``shardsafe.neuron.DEFAULT`` once that
    module is imported), then free their staging memory, threads and store connections;
    later calls make fresh ones. Raises the first :class:`CheckpointError` seen."""
    neuron = sys.modules.get(f"{__name__}.neuron")
    calls = [neuron.finalize_checkpoint] if neuron is not None else []
    call_each([*calls, _release_savers])


__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CorruptCheckpointError",
    "DistributedError",
    "IncompatibleRequestError",
    "IncompleteCheckpointError",
    "CoordinatorObject",
    "LocalNonPersistentObject",
    "LocalNonpersistentObject",
    "MissingKeyError",
    "AsyncSaveHandle",
    "SaveStats",
    "Saver",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StagingError",
    "ValidationError",
    "__version__",
    "async_save",
    "CheckpointManager",
    "CheckpointReader",
    "StrictHandling",
    "VerifyReport",
    "load_common_state_dict",
    "load_metadata",
    "load_plain_tensors",
    "register_state_dict_adapter",
    "load",
    "load_content_metadata",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "apply_factories",
    "apply_factory_merges",
    "save",
    "release",
    "wait_for_saves",
]
