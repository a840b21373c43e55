"""Converting checkpoints between PyTorch DCP (and Megatron-Core ``torch_dist``), Hugging Face
safetensors folders, single ``torch.save`` files and shardsafe.

Every reader is a :class:`TensorSource` presenting consolidated global tensors one at a time;
every writer streams from one, so conversions run in about one tensor's worth of memory.
"""

from __future__ import annotations

from .dcp import DcpSource, is_dcp_checkpoint
from .dcp_writer import export_dcp
from .detect import FORMATS, detect_format, open_source, register_source
from .errors import UnsafePickleError, UnsupportedFormatError
from .hf import HfSource, export_hf, parse_size
from .select import RenameRules, SelectedSource, parse_rename_rules
from .source import DictSource, Progress, TensorSource
from .torch_file import TorchFileSource, export_torch

__all__ = [
    "FORMATS",
    "DcpSource",
    "DictSource",
    "HfSource",
    "Progress",
    "RenameRules",
    "SelectedSource",
    "TensorSource",
    "TorchFileSource",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "detect_format",
    "export_dcp",
    "export_hf",
    "export_torch",
    "is_dcp_checkpoint",
    "open_source",
    "parse_rename_rules",
    "parse_size",
    "register_source",
]
