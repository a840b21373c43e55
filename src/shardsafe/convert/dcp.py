"""Reading PyTorch DCP checkpoints, Megatron-Core ``torch_dist`` ones included, without either
``torch.distributed`` process groups or Megatron installed.

On disk (see ``docs/dcp_layout.md``): a pickled ``Metadata`` in ``.metadata`` maps every key
to its global shape and chunks, and every chunk to an ``(file, offset, length)`` slice of a
``__{rank}_{i}.distcp`` file; each slice is one ``torch.save`` record of that chunk (or of a
pickled object). Chunks are reassembled here into the global tensor.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import os
from pathlib import Path
from typing import IO, Any

import torch

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, MissingKeyError
from ..format import check_json_density
from ..geometry import Box, LayoutTooFragmentedError, find_overlap, first_uncovered
from ..storage.local import open_in, read_checked
from .errors import UnsupportedFormatError
from .safe_pickle import load_metadata_pickle, load_torch_payload
from .source import Shape

METADATA_FILE = ".metadata"
MEGATRON_CONFIG_FILE = "metadata.json"
MEGATRON_COMMON_FILE = "common.pt"
MEGATRON_COMMON_OBJECT = "common_state/shard_0_1"
"""Where megatron-core 0.19+ keeps the common state: a ShardedObject ``[common_dict]`` in the
DCP files, instead of ``common.pt`` (which 0.19 still reads first when present)."""
INTEGRITY_FILE = "integrity.json"
_ZIP_MAGIC = b"PK\x03\x04"


MAX_METADATA_BYTES = 1 << 30
"""``.metadata``, ``metadata.json`` and ``integrity.json`` larger than this are refused unread."""
MAX_INFLATION = 64
"""A record decoded through stream transforms may grow to this many times its stored bytes."""
CHUNKS_PER_BYTE = 1 / 16
"""A ``.metadata`` file may list at most this many chunks per byte (counted key by key, so a
chunk list shared by many keys counts for each), plus :data:`MIN_CHUNKS`. DCP writes about
120 bytes per chunk (the chunk and its storage entry)."""
MIN_CHUNKS = 1 << 16


def read_metadata(
    root: str | os.PathLike[str], name: str = METADATA_FILE, *, trust: bool = False
) -> Any:
    """The DCP ``Metadata`` in ``root/name``, read the one way shardsafe reads it.

    Through the checked opener (a regular file inside ``root``, at most 1 GiB), the
    restricted unpickler (DCP's metadata classes only), with its two mappings present and
    the work of indexing it bounded by its size: a pickle's memo lets one metadata object
    with C chunks stand for N keys at the cost of N references, so the chunks listed over
    all keys may number at most :data:`CHUNKS_PER_BYTE` per byte. :class:`DcpSource` reads
    its metadata here, and so should a ``StorageReader.read_metadata``.
    """
    root = Path(root)
    file = root / name
    data = _read_in(root, name)
    metadata = load_metadata_pickle(data, str(file), trust=trust)
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CorruptCheckpointError(
            f"{file}: does not hold DCP metadata (got {type(metadata).__name__})"
        )
    budget = int(len(data) * CHUNKS_PER_BYTE) + MIN_CHUNKS
    listed = 0
    for key, meta in entries.items():
        chunks = getattr(meta, "chunks", None)
        if chunks is None:
            continue
        try:
            listed += len(chunks)
        except TypeError:
            raise CorruptCheckpointError(
                f"{file}: {str(key)[:80]!r}: chunks is not a list"
            ) from None
        if listed > budget:
            raise CorruptCheckpointError(
                f"{file}: lists more than {budget} chunks over its keys for {len(data)} bytes "
                "(chunk lists shared between keys); refused as hostile"
            )
    return metadata


def _read_in(root: Path, name: str, limit: int = MAX_METADATA_BYTES) -> bytes:
    """The bytes of ``root/name`` through the checked opener (regular, inside, no link)."""
    try:
        return read_checked(str(root), name, limit)
    except OSError as e:
        raise CorruptCheckpointError(f"{root / name}: unreadable ({e})") from None


def _json_in(root: Path, name: str) -> Any:
    raw = _read_in(root, name)
    check_json_density(raw, str(root / name))  # the manifest's bound on parsing cost
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{root / name}: not valid JSON ({str(e)[:200]})") from None


def _present(path: Path) -> bool:
    """Whether anything (a link included, which the checked opener then refuses) is there."""
    return os.path.lexists(path)


def _rank_metadata_files(path: Path) -> list[Path]:
    """``__{rank}.metadata`` files, written instead of ``.metadata`` by saves without collectives."""
    return sorted(
        (p for p in path.glob("__*.metadata") if p.name[2 : -len(".metadata")].isdigit()),
        key=lambda p: int(p.name[2 : -len(".metadata")]),
    )


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a directory holding DCP metadata."""
    p = Path(path)
    return p.is_dir() and (_present(p / METADATA_FILE) or bool(_rank_metadata_files(p)))


class _FileSlice(io.RawIOBase):
    """A read-only, seekable window ``[offset, offset + length)`` of an open file, so that
    ``torch.load`` reads a record straight from the ``.distcp`` file without a copy."""

    def __init__(self, file: io.BufferedIOBase, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(view[:n]) or 0
        self._pos += got
        return got


class _Chunk:
    __slots__ = ("info", "offsets", "sizes")

    def __init__(self, offsets: Shape, sizes: Shape, info: Any) -> None:
        self.offsets, self.sizes, self.info = offsets, sizes, info


class _TensorEntry:
    __slots__ = ("checked", "chunks", "dtype", "shape")

    def __init__(self, shape: Shape, dtype: torch.dtype, chunks: list[_Chunk]) -> None:
        self.shape, self.dtype, self.chunks, self.checked = shape, dtype, chunks, False


class DcpSource:
    """A TensorSource over a DCP checkpoint directory.

    ``trust=True`` unpickles metadata and objects with the ordinary (code-running) machinery;
    by default only DCP's own metadata classes and weights-only payloads are admitted.
    ``extension_registry`` (a ``torch.distributed.checkpoint._extension.ExtensionRegistry``)
    decodes records written with stream transforms such as compression; torch's default
    registry is used when it is None.
    """

    def __init__(
        self, path: str | os.PathLike[str], trust: bool = False, *, extension_registry: Any = None
    ) -> None:
        self.path = Path(path)
        self.trust = trust
        self._registry = extension_registry
        if not self.path.exists():
            raise CheckpointNotFoundError(f"{self.path}: no such checkpoint directory")
        self.megatron_config = self._read_megatron_config()  # first: it names foreign backends
        if not is_dcp_checkpoint(self.path):
            raise UnsupportedFormatError(
                f"{self.path}: not a DCP checkpoint (no {METADATA_FILE} file)"
            )
        self._tensors: dict[str, _TensorEntry] = {}
        self._objects: dict[str, Any] = {}
        self._common: dict[str, Any] | None = None
        self._paths: dict[str, tuple[str | int, ...]] = {}
        for file in self._metadata_files():
            try:
                self._index(file)
            except RecursionError:  # values nested too deep even to describe
                raise CorruptCheckpointError(f"{file}: metadata nested too deeply") from None
        self._check_extents()
        # megatron-core 0.19's common state is no object of the run's: it is the common state
        self._common_object = (
            self._objects.pop(MEGATRON_COMMON_OBJECT, None)
            if self.megatron_config is not None
            else None
        )

    # -- TensorSource -------------------------------------------------------------------------

    def tensor_keys(self) -> list[str]:
        return list(self._tensors)

    def tensor_meta(self, key: str) -> tuple[Shape, torch.dtype]:
        entry = self._entry(key)
        return entry.shape, entry.dtype

    def read_tensor(self, key: str) -> torch.Tensor:
        entry = self._entry(key)
        self._check_chunks(key, entry)
        if len(entry.chunks) == 1:  # the common case of an unsharded tensor: no copy at all
            return self._load_chunk(key, entry, entry.chunks[0])
        stored = 0
        for chunk in entry.chunks:
            try:
                stored += _natural(chunk.info.length)
            except (AttributeError, TypeError, ValueError) as e:
                raise CorruptCheckpointError(
                    f"{self.path}: {key!r}: malformed storage entry ({e})"
                ) from None
        nbytes = math.prod(entry.shape) * entry.dtype.itemsize
        if nbytes > stored:  # each record holds its chunk's bytes, so this bounds the allocation
            raise CorruptCheckpointError(
                f"{self.path}: {key!r} claims {nbytes} bytes but its records hold {stored}"
            )
        out = torch.empty(entry.shape, dtype=entry.dtype)
        for chunk in entry.chunks:
            data = self._load_chunk(key, entry, chunk)
            region = zip(chunk.offsets, chunk.sizes, strict=True)
            out[tuple(slice(o, o + s) for o, s in region)].copy_(data)
            del data
        return out

    def chunk_count(self, key: str) -> int:
        """How many stored chunks make up ``key`` (for ``inspect``)."""
        return len(self._entry(key).chunks)

    def megatron_common(self) -> dict[str, Any]:
        """Megatron-Core's common state: ``common.pt`` (megatron-core <= 0.18, and read first by
        0.19 as well), else the ``common_state`` object of 0.19+; ``{}`` when there is neither."""
        common_file = self.path / MEGATRON_COMMON_FILE
        if _present(common_file):
            try:
                f = open_in(self.path, MEGATRON_COMMON_FILE)
            except OSError as e:
                raise CorruptCheckpointError(f"{common_file}: unreadable ({e})") from None
            with f:
                loaded = load_torch_payload(f, str(common_file), trust=self.trust)
            return loaded if isinstance(loaded, dict) else {"common": loaded}
        if self._common_object is None:
            return {}
        what = f"Megatron common state {MEGATRON_COMMON_OBJECT!r}"
        stored = self._load_record(self._common_object, what, tensor=False)
        if not (isinstance(stored, list) and len(stored) == 1 and isinstance(stored[0], dict)):
            raise CorruptCheckpointError(
                f"{self.path}: {what} is not megatron-core's one-element list holding a dict "
                f"(got {type(stored).__name__})"
            )
        return stored[0]

    def common(self) -> dict[str, Any]:
        """Megatron's common state (:meth:`megatron_common`) plus every object item, nested
        again as the saved state dict was (DCP's ``planner_data`` records each flat key's path)."""
        if self._common is None:
            state: dict[str, Any] = dict(self.megatron_common())
            for key, info in self._objects.items():
                value = self._load_record(info, f"object {key!r}", tensor=False)
                path: tuple[Any, ...] = self._paths.get(key, (key,))
                nested: dict[Any, Any] = state
                if len(path) > 1 and not isinstance(nested.get(path[0], {}), dict):
                    path = (key,)  # the nesting would clash with another entry: keep it flat
                node = nested
                for p in path[:-1]:
                    node = node.setdefault(p, {})
                    if not isinstance(node, dict):
                        break
                else:
                    node[path[-1]] = value
                    continue
                state[key] = value
            self._common = state
        return dict(self._common)

    def verify_integrity(self) -> list[str]:
        """Check files against Megatron-Core's ``integrity.json`` (SHA-256 per file), if present.

        Returns the problems found (empty when all match); raises if the manifest is unreadable.
        """
        manifest_file = self.path / INTEGRITY_FILE
        if not _present(manifest_file):
            return []
        manifest = _json_in(self.path, INTEGRITY_FILE)
        try:
            algorithm, files = manifest.get("algorithm", "sha256"), dict(manifest["files"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{manifest_file}: unreadable ({e!r})") from None
        if algorithm != "sha256":
            raise CorruptCheckpointError(f"{manifest_file}: unknown hash algorithm {algorithm!r}")
        problems = []
        for name, expected in files.items():
            file = self.path / str(name)
            if not _present(file):
                problems.append(f"{name}: missing")
                continue
            digest = hashlib.sha256()
            try:
                f = open_in(self.path, str(name))
            except (OSError, ValueError) as e:
                problems.append(f"{name}: unreadable ({e})")
                continue
            with f:
                while block := f.read(1 << 20):
                    digest.update(block)
            if digest.hexdigest() != expected:
                problems.append(f"{name}: SHA-256 mismatch")
        return problems

    def object_keys(self) -> list[str]:
        """Keys of the non-tensor items stored in the ``.distcp`` files."""
        return list(self._objects)

    # -- metadata -----------------------------------------------------------------------------

    def _read_megatron_config(self) -> dict[str, Any] | None:
        file = self.path / MEGATRON_CONFIG_FILE
        if not _present(file):
            return None
        config = _json_in(self.path, MEGATRON_CONFIG_FILE)
        backend = config.get("sharded_backend") if isinstance(config, dict) else None
        if backend is not None and backend != "torch_dist":
            raise UnsupportedFormatError(
                f"{file}: Megatron-Core checkpoint with sharded_backend {backend!r}; only 'torch_dist' is read"
            )
        return config if isinstance(config, dict) else None

    def _metadata_files(self) -> list[Path]:
        single = self.path / METADATA_FILE
        return [single] if _present(single) else _rank_metadata_files(self.path)

    def _index(self, file: Path) -> None:
        metadata = read_metadata(self.path, file.name, trust=self.trust)
        entries, storage = metadata.state_dict_metadata, metadata.storage_data
        where: dict[tuple[str, Shape | None], Any] = {}
        try:
            for index, info in storage.items():
                offset = getattr(index, "offset", None)
                where[(getattr(index, "fqn", ""), None if offset is None else _coords(offset))] = (
                    info
                )
        except (TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpointError(
                f"{file}: malformed storage index ({str(e)[:200]})"
            ) from None
        paths = getattr(metadata, "planner_data", None)
        if isinstance(paths, dict):  # DCP's flattening: flat key -> path in the nested dict
            for key, path in paths.items():
                if (
                    isinstance(key, str)
                    and isinstance(path, (tuple, list))
                    and path
                    and all(type(p) in (str, int) for p in path)
                ):
                    self._paths[key] = tuple(path)
        for key, meta in entries.items():
            if not isinstance(key, str) or "\0" in key:
                raise CorruptCheckpointError(f"{file}: key {str(key)[:80]!r} is not a valid name")
            if hasattr(meta, "chunks"):
                self._index_tensor(file, key, meta, where)
            elif key not in self._objects:
                info = where.get((key, None))
                if info is None:
                    raise CorruptCheckpointError(f"{file}: object {key!r} has no storage entry")
                self._objects[key] = info

    def _index_tensor(
        self, file: Path, key: str, meta: Any, where: dict[tuple[str, Shape | None], Any]
    ) -> None:
        try:
            shape = _coords(meta.size)
            dtype = meta.properties.dtype
            pieces = [(_coords(c.offsets), _coords(c.sizes)) for c in meta.chunks]
            if not isinstance(key, str) or "\0" in key:
                raise ValueError(f"key {str(key)[:80]!r} is not a string")
        except (AttributeError, TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpointError(f"{file}: malformed entry for {key!r} ({e})") from e
        if any(len(o) != len(shape) or len(z) != len(shape) for o, z in pieces):
            raise CorruptCheckpointError(
                f"{file}: {key!r}: a chunk's rank differs from the tensor's"
            )
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(
                f"{file}: {key!r} has no valid dtype (a {type(dtype).__name__})"
            )
        entry = self._tensors.get(key)
        if entry is None:
            entry = self._tensors[key] = _TensorEntry(shape, dtype, [])
        elif (entry.shape, entry.dtype) != (shape, dtype):
            raise CorruptCheckpointError(
                f"{file}: {key!r} is {shape} {dtype} here but {entry.shape} {entry.dtype} in another rank's metadata"
            )
        known = {c.offsets for c in entry.chunks}
        for offsets, sizes in pieces:
            if offsets in known:
                continue
            info = where.get((key, offsets))
            if info is None:
                raise CorruptCheckpointError(
                    f"{file}: chunk of {key!r} at offset {offsets} has no storage entry"
                )
            entry.chunks.append(_Chunk(offsets, sizes, info))

    def _check_extents(self) -> None:
        """No two items may read the same bytes: DCP gives every chunk and object its own
        record, so keys sharing one would only multiply what a small checkpoint describes
        (N keys over one 1 GiB record read N GiB). Malformed entries are left to the read."""
        extents: list[tuple[str, int, int, str]] = []
        items = [(k, c.info) for k, e in self._tensors.items() for c in e.chunks]
        items += list(self._objects.items())
        for key, info in items:
            try:
                relative = info.relative_path
                offset, length = _natural(info.offset), _natural(info.length)
            except (AttributeError, TypeError, ValueError):
                continue
            if isinstance(relative, str):
                extents.append((relative, offset, length, key))
        extents.sort()
        for a, b in itertools.pairwise(extents):
            if a[0] == b[0] and a[1] + a[2] > b[1]:
                raise CorruptCheckpointError(
                    f"{self.path / a[0]}: the records of {a[3]!r} and {b[3]!r} share bytes "
                    f"[{b[1]}, {min(a[1] + a[2], b[1] + b[2])}); DCP never writes that, so the "
                    "metadata is corrupt or hostile"
                )

    def _entry(self, key: str) -> _TensorEntry:
        try:
            return self._tensors[key]
        except KeyError:
            kind = "an object, not a tensor" if key in self._objects else "not in the checkpoint"
            raise MissingKeyError(f"{self.path}: {key!r} is {kind}") from None

    def _check_chunks(self, key: str, entry: _TensorEntry) -> None:
        """The chunks must tile the global tensor exactly; checked once per key, on first read,
        so that one damaged entry does not stop the conversion of a selection without it."""
        if entry.checked:
            return
        boxes = []
        for chunk in entry.chunks:
            try:
                box = Box(chunk.offsets, chunk.sizes)
            except ValueError as e:
                raise CorruptCheckpointError(f"{self.path}: {key!r}: bad chunk ({e})") from None
            if not box.within(entry.shape):
                raise CorruptCheckpointError(
                    f"{self.path}: {key!r}: chunk at {chunk.offsets} of size {chunk.sizes} lies outside {entry.shape}"
                )
            boxes.append(box)
        try:
            overlap = find_overlap(boxes)
        except LayoutTooFragmentedError as e:
            raise CorruptCheckpointError(f"{self.path}: {key!r}: {e}") from None
        if overlap is not None:
            a, b = (entry.chunks[i] for i in overlap)
            raise CorruptCheckpointError(
                f"{self.path}: {key!r}: chunks at {a.offsets} and {b.offsets} overlap"
            )
        covered, numel = (
            sum(b.numel for b in boxes),
            Box((0,) * len(entry.shape), entry.shape).numel,
        )
        if covered != numel:
            hole = first_uncovered(entry.shape, boxes)
            at = f"; index {hole} is in none" if hole is not None else ""
            raise CorruptCheckpointError(
                f"{self.path}: {key!r}: chunks cover {covered} of {numel} elements{at}"
            )
        entry.checked = True

    # -- data ---------------------------------------------------------------------------------

    def _load_chunk(self, key: str, entry: _TensorEntry, chunk: _Chunk) -> torch.Tensor:
        what = f"chunk of {key!r} at offset {chunk.offsets}"
        data = self._load_record(chunk.info, what, tensor=True)
        if not isinstance(data, torch.Tensor):
            raise CorruptCheckpointError(
                f"{self.path}: {what} holds a {type(data).__name__}, not a tensor"
            )
        if tuple(data.shape) != chunk.sizes or data.dtype != entry.dtype:
            raise CorruptCheckpointError(
                f"{self.path}: {what} is {tuple(data.shape)} {data.dtype}, expected {chunk.sizes} {entry.dtype}"
            )
        return data

    def _load_record(self, info: Any, what: str, *, tensor: bool) -> Any:
        try:
            relative = info.relative_path
            offset, length = _natural(info.offset), _natural(info.length)
            if not isinstance(relative, str) or "\0" in relative:
                raise ValueError(f"file name {str(relative)[:80]!r} is not a string")
            descriptors = list(getattr(info, "transform_descriptors", None) or ())
            if not all(isinstance(d, str) for d in descriptors):
                raise ValueError("transform_descriptors holds something other than names")
        except (AttributeError, TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpointError(
                f"{self.path}: {what}: malformed storage entry ({e})"
            ) from None
        file = self._data_file(relative, what)
        where = f"{file} ({what})"
        try:
            raw = open_in(self.path, relative)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{file}: data file missing; it holds the {what}"
            ) from None
        except OSError as e:
            raise CorruptCheckpointError(f"{file}: unreadable ({e})") from None
        size = os.fstat(raw.fileno()).st_size
        if offset + length > size:
            raw.close()
            raise CorruptCheckpointError(
                f"{file}: truncated: the {what} needs bytes [{offset}, {offset + length}) of a {size}-byte file"
            )
        with raw:
            stream: IO[bytes] = _FileSlice(raw, offset, length)  # type: ignore[assignment]
            if descriptors:
                stream = self._untransform(stream, descriptors, where, length)
            if tensor:
                head = stream.read(4)
                stream.seek(0)
                if head != _ZIP_MAGIC:
                    raise CorruptCheckpointError(f"{where}: not a torch.save record")
                # Tensor records hold nothing but a tensor: torch's weights-only loader suffices.
                return load_torch_payload(stream, where, trust=False)
            return load_torch_payload(stream, where, trust=self.trust)

    def _data_file(self, relative: str, what: str) -> Path:
        file = (self.path / relative).resolve()
        root = self.path.resolve()
        if os.path.isabs(relative) or root not in file.parents:
            raise CorruptCheckpointError(
                f"{self.path}: {what} points outside the checkpoint ({relative!r})"
            )
        return file

    def _untransform(
        self, stream: IO[bytes], descriptors: list[str], where: str, length: int
    ) -> IO[bytes]:
        try:
            from torch.distributed.checkpoint._extension import (
                ExtensionRegistry,
                StreamTransformExtension,
            )

            registry = self._registry if self._registry is not None else ExtensionRegistry()
            for ext in registry.from_descriptor_list(descriptors):
                if isinstance(ext, StreamTransformExtension):
                    stream = ext.transform_from(stream)
            limit = MAX_INFLATION * length + (1 << 16)
            data = stream.read(limit + 1)
            if len(data) > limit and not self.trust:
                raise CorruptCheckpointError(
                    f"{where}: decodes to more than {MAX_INFLATION} times its {length} stored bytes; "
                    "refusing a possible decompression bomb (pass trust=True if you trust the file)"
                )
            return io.BytesIO(data + stream.read() if len(data) > limit else data)
        except (ImportError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{where}: written with stream transforms {descriptors} that cannot be decoded here ({e})"
            ) from e


def _natural(value: Any) -> int:
    """A non-negative integer from metadata (``int``, not ``float``: ``inf`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise ValueError(f"{str(value)[:40]} is not a non-negative integer below 2**62")
    return int(value)


def _coords(values: Any) -> Shape:
    """A shape or offset from metadata: at most 64 integers in ``[0, 2**62)``."""
    out = tuple(_natural(v) for v in values)
    if len(out) > 64:
        raise ValueError(f"{len(out)} dimensions")
    return out
