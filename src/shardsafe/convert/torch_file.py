"""A single ``torch.save`` file of a flat dict, written and read one tensor at a time.

``torch.save`` wants every tensor in memory at once. To stay within one tensor's worth of
memory, the file is laid out first from shapes alone (FakeTensors saved under
``torch.serialization.skip_data``), and each record is then filled in place; see
:mod:`.torch_zip`. The result is an ordinary archive that ``torch.load(weights_only=True)``
reads.
"""

from __future__ import annotations

import os
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingKeyError,
)
from .errors import UnsupportedFormatError
from .flatten import describe, drop_emptied, flatten_state
from .publish import refuse_source_overlap
from .safe_pickle import load_torch_payload
from .source import (
    Progress,
    Shape,
    TensorSource,
    read_checked,
    tensor_bytes,
    tensor_nbytes,
    warn_unexported,
)
from .torch_zip import ZipRecord, patch_crcs, zip_records


def _skeleton(
    metas: dict[str, tuple[Shape, torch.dtype]], values: dict[str, Any]
) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # shapes only: no memory is allocated for the data
        skeleton: dict[str, Any] = {
            k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in metas.items()
        }
    skeleton.update(values)
    return skeleton


def _record_offsets(path: Path, keys: list[str]) -> dict[str, int]:
    """Where each tensor's bytes go, as torch itself reports it when loading onto ``meta``."""
    layout = torch.load(path, map_location="meta", weights_only=True)
    offsets = {}
    for key in keys:
        offset = getattr(layout[key].untyped_storage(), "_checkpoint_offset", None)
        if offset is None:
            raise RuntimeError(
                f"torch {torch.__version__} does not report storage offsets; cannot stream {key!r}"
            )
        offsets[key] = int(offset)
    return offsets


def export_torch(
    source: TensorSource,
    dst_file: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``source`` as one ``torch.save`` file of a flat dict: every tensor under its key,
    then the common state flattened to ``a.b.c`` keys (entries that ``torch.load(weights_only=True)``
    could not read back are skipped with a warning). Memory stays within one tensor. The file
    appears only once complete; an existing one is replaced only with ``overwrite``."""
    dst = Path(dst_file)
    refuse_source_overlap(source, dst)
    if dst.exists() and not overwrite:
        raise CheckpointExistsError(f"{dst} exists; pass overwrite=True to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    warn_unexported(source, "export_torch")
    keys = source.tensor_keys()
    metas = {k: source.tensor_meta(k) for k in keys}
    flat, unreadable = flatten_state(source.common())
    drop_emptied(flat, keys)
    skipped = describe(unreadable)
    for name in [k for k in flat if k in metas]:
        skipped.append(f"{name} (name taken by a tensor)")
        del flat[name]
    if skipped:
        warnings.warn(
            f"export_torch: {len(skipped)} common entr{'y' if len(skipped) == 1 else 'ies'} skipped, not "
            f"readable with torch.load(weights_only=True): {', '.join(skipped)}",
            stacklevel=2,
        )
    common_tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in flat.items() if k not in common_tensors}
    all_metas = {**metas, **{k: (tuple(v.shape), v.dtype) for k, v in common_tensors.items()}}

    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        if hasattr(torch.serialization, "skip_data"):
            _write_streaming(source, tmp, all_metas, common_tensors, values, progress)
        else:
            warnings.warn(
                f"torch {torch.__version__} lacks torch.serialization.skip_data (added in 2.5): "
                "export_torch holds every tensor in memory at once",
                stacklevel=2,
            )
            state = {
                k: common_tensors[k] if k in common_tensors else read_checked(source, k)
                for k in all_metas
            }
            torch.save({**state, **values}, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def _write_streaming(
    source: TensorSource,
    tmp: Path,
    metas: dict[str, tuple[Shape, torch.dtype]],
    common_tensors: dict[str, torch.Tensor],
    values: dict[str, Any],
    progress: Progress | None,
) -> None:
    """Lay the archive out from shapes, then write each tensor into its record and fix the CRCs."""
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(_skeleton(metas, values), tmp)
    offsets = _record_offsets(tmp, list(metas))
    records = zip_records(tmp)
    crcs: dict[ZipRecord, int] = {}
    total = sum(tensor_nbytes(*m) for m in metas.values())
    done = 0
    with open(tmp, "r+b") as f:
        for key in metas:
            tensor = common_tensors[key] if key in common_tensors else read_checked(source, key)
            data = tensor_bytes(tensor)
            record = records.get(offsets[key])
            if record is None or record.size != data.nbytes:
                raise RuntimeError(
                    f"{tmp}: no storage record of {data.nbytes} bytes at the offset of {key!r}"
                )
            f.seek(record.data_offset)
            f.write(data)
            if data.nbytes:
                crcs[record] = zlib.crc32(data)
            done += data.nbytes
            del tensor, data
            if progress is not None:
                progress(done, total, key)
    patch_crcs(tmp, crcs)


class TorchFileSource:
    """A TensorSource over a ``torch.save`` file of a (possibly nested) dict.

    Nested dicts are flattened to ``a.b.c`` keys; tensors become the source's tensors and
    everything else its common state. Zip-format files are memory-mapped, so reading costs
    page cache, not process memory. Only weights-only content is admitted unless ``trust``.
    """

    def __init__(self, path: str | os.PathLike[str], trust: bool = False) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointNotFoundError(f"{self.path}: no such file")
        mmap = zipfile.is_zipfile(self.path)
        loaded = load_torch_payload(str(self.path), str(self.path), trust=trust, mmap=mmap)
        if not isinstance(loaded, dict):
            raise UnsupportedFormatError(
                f"{self.path}: holds a {type(loaded).__name__}, not a dict of tensors"
            )
        _refuse_odd_tensors(loaded, self.path)
        try:
            flat, other = flatten_state(loaded)
        except RecursionError:
            raise CorruptCheckpointError(
                f"{self.path}: values nested too deeply"
            ) from None  # ``other``: objects only a trusted load can produce
        self._tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        self._common = {
            **{k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)},
            **other,
        }

    def tensor_keys(self) -> list[str]:
        return list(self._tensors)

    def tensor_meta(self, key: str) -> tuple[Shape, torch.dtype]:
        tensor = self._get(key)
        return tuple(tensor.shape), tensor.dtype

    def read_tensor(self, key: str) -> torch.Tensor:
        return self._get(key)

    def common(self) -> dict[str, Any]:
        return dict(self._common)

    def _get(self, key: str) -> torch.Tensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise MissingKeyError(f"{self.path}: no tensor {key!r}") from None


def _refuse_odd_tensors(value: Any, path: Path) -> None:
    """Only dense CPU tensors convert: meta, sparse, quantized and nested ones are refused."""
    stack = [("", value)]
    while stack:
        key, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{key}.{k}" if key else str(k), x) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{key}.{i}", x) for i, x in enumerate(v))
        elif isinstance(v, torch.Tensor) and (
            v.layout != torch.strided or v.device.type != "cpu" or v.is_quantized or v.is_nested
        ):
            kind = "quantized " if v.is_quantized else "nested " if v.is_nested else ""
            raise CorruptCheckpointError(
                f"{path}: {key!r} is a {kind}{v.layout} tensor on {v.device}; only dense CPU "
                "tensors convert (densify, dequantize or move it to the CPU before saving)"
            )
