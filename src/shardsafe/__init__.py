"""shardsafe: distributed checkpointing for PyTorch that is fast, safe and reshards into any layout."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    IncompatibleRequestError,
    IncompleteCheckpointError,
    MissingKeyError,
    ValidationError,
)
from .sharding import (  # noqa: E402
    LocalNonPersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from .loading import StrictHandling, load, load_content_metadata  # noqa: E402
from .reader import (  # noqa: E402
    CheckpointReader,
    VerifyReport,
    load_common_state_dict,
    load_metadata,
    load_plain_tensors,
)
from .saving import SaveStats, save  # noqa: E402

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DistributedError",
    "IncompatibleRequestError",
    "IncompleteCheckpointError",
    "LocalNonPersistentObject",
    "MissingKeyError",
    "SaveStats",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "ValidationError",
    "__version__",
    "CheckpointReader",
    "StrictHandling",
    "VerifyReport",
    "load_common_state_dict",
    "load_metadata",
    "load_plain_tensors",
    "load",
    "load_content_metadata",
    "save",
]
