"""Format v1: the manifest's dataclasses, their JSON form, and the names of files.

The spec for humans is FORMAT.md at the project root; ``schema/manifest.schema.json`` is
its JSON Schema. Parsing here is strict: anything malformed becomes a
:class:`CorruptCheckpointError` naming the field, and no file name can point outside the
checkpoint directory.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .checksum import ALGORITHM, block_count, digest
from .dtypes import dtype_from_name, itemsize
from .errors import CorruptCheckpointError
from .geometry import Box, LayoutTooFragmentedError, find_overlap, flat_range_to_boxes

FORMAT_NAME = "shardsafe"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
SMALL_ALIGN = 64
"""Every item in a data file starts at a multiple of this many bytes, ..."""
LARGE_ALIGN = 4096
"""... items of ``LARGE_ITEM`` bytes or more at a multiple of this (pages, for direct I/O)."""
LARGE_ITEM = 64 << 10
MAX_BLOCK_BYTES = 64 << 20
"""Checksum blocks are at most this big: a reader's scratch buffer holds two of them at most."""
MAX_MANIFEST_BYTES = 1 << 30
"""A larger ``manifest.json`` is refused before it is read (parsing costs several times its size)."""
MAX_INT = 1 << 62
"""Sizes, offsets and coordinates in a manifest lie in ``[0, MAX_INT)``: sums of a few stay
within 64 bits, and no number of 400 digits reaches arithmetic or formatting."""
BLOB_TAGS = ("$tensor", "$ndarray", "$torch_save")
"""Encoded-value tags whose body names a blob under ``"blob"`` (``"$bytes"`` names one directly)."""
_FILE_NAME = re.compile(r"^data/[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def data_file_name(rank: int, index: int) -> str:
    """``data/rank-00003-01.bin``: the ``index``-th data file written by ``rank``."""
    return f"{DATA_DIR}/rank-{rank:05d}-{index:02d}.bin"


def check_file_name(name: Any, where: str = MANIFEST_NAME) -> str:
    """Refuse any data-file name that could escape the checkpoint directory."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name:
        raise CorruptCheckpointError(
            f"{where}: data file name {str(name)[:100]!r} is not allowed (must look like "
            "'data/rank-00000-00.bin'); the manifest is corrupt or was tampered with"
        )
    return name


@dataclass(frozen=True, slots=True)
class Extent:
    """Where a run of bytes lives: a data file, a byte offset, a length and block checksums."""

    file: str
    byte_offset: int
    nbytes: int
    checksums: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "byte_offset": self.byte_offset,
            "nbytes": self.nbytes,
            "checksums": list(self.checksums),
        }


@dataclass(frozen=True, slots=True)
class StoredPiece:
    """A stored piece of a tensor: the box ``offset``/``shape``, or the flat range ``flat`` of it."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int] | None
    extent: Extent

    @property
    def box(self) -> Box:
        return Box(self.offset, self.shape)

    @property
    def numel(self) -> int:
        return self.flat[1] - self.flat[0] if self.flat else math.prod(self.shape)

    def boxes(self) -> list[tuple[int, Box]]:
        """``(element position in the piece's bytes, global box)``, each box contiguous there."""
        if self.flat is None:
            return [(0, self.box)]
        return [
            (pos, b.shifted(self.offset)) for pos, b in flat_range_to_boxes(self.shape, *self.flat)
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "offset": list(self.offset),
            "shape": list(self.shape),
            "flat": list(self.flat) if self.flat else None,
            **self.extent.to_json(),
        }


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[StoredPiece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(dtype_from_name(self.dtype))

    def check_tiling(self, key: str, where: str) -> None:
        """Refuse pieces that overlap or leave holes: a reader must never return unset memory."""
        boxes = [b for p in self.pieces for _, b in p.boxes()]
        try:
            overlap = find_overlap(boxes)
        except LayoutTooFragmentedError as e:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}: {e}; the manifest is corrupt or was tampered with"
            ) from None
        if overlap is not None:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}: stored pieces overlap ({boxes[overlap[0]]} and {boxes[overlap[1]]}); "
                "the manifest is corrupt or was tampered with"
            )
        covered = sum(b.numel for b in boxes)
        if covered != math.prod(self.shape):
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}: stored pieces cover {covered} of {math.prod(self.shape)} elements; "
                "the manifest is corrupt or was tampered with"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "pieces": [p.to_json() for p in self.pieces],
        }


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """One ShardedObject cell; ``value`` is its encoded form (see codec.py)."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    value: Any

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "global_shape": list(self.global_shape),
            "global_offset": list(self.global_offset),
            "value": self.value,
        }


@dataclass(frozen=True, slots=True)
class FileEntry:
    nbytes: int
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "rank": self.rank}


@dataclass(frozen=True)
class Manifest:
    """Everything about a checkpoint except the bytes. Written last: its presence is the commit."""

    world_size: int
    block_bytes: int
    files: Mapping[str, FileEntry]
    tensors: Mapping[str, TensorEntry]
    objects: Mapping[str, ObjectEntry]
    blobs: Mapping[str, Extent]
    common: Any
    created: str = ""
    library_version: str = ""
    user_metadata: Mapping[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    digest: str | None = None
    """The ``manifest_digest`` the file held, checked (None: written without one)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "library_version": self.library_version,
            "created": self.created,
            "world_size": self.world_size,
            "checksum": {"algorithm": ALGORITHM, "block_bytes": self.block_bytes},
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "objects": {k: v.to_json() for k, v in self.objects.items()},
            "blobs": {k: v.to_json() for k, v in self.blobs.items()},
            "common": self.common,
            "user_metadata": dict(self.user_metadata),
        }

    def dumps(self) -> bytes:
        return seal(json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode())

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    @staticmethod
    def loads(raw: bytes, where: str = MANIFEST_NAME) -> Manifest:
        check_json_density(raw, where)
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as e:  # ValueError: also too many digits in a number
            raise CorruptCheckpointError(
                f"{where} is not valid JSON ({e}); the checkpoint is corrupt"
            ) from None
        sealed = check_seal(raw, obj, where)
        return replace(Manifest.from_json(obj, where), digest=sealed)

    @staticmethod
    def from_json(obj: Any, where: str = MANIFEST_NAME) -> Manifest:
        return _Parser(where).manifest(obj)


MAX_CONTAINERS_PER_BYTE = 1 / 16
"""JSON containers (``[``, ``{``) a manifest may open per byte, plus :data:`MIN_CONTAINERS`.
Each costs Python about 64 bytes for its 2 or 3 bytes of text (``[],`` parsed 25 times its
size); real manifests open one per 40 bytes (a piece's object and its three lists)."""
MIN_CONTAINERS = 1 << 12


def check_json_density(raw: bytes | bytearray | memoryview, where: str) -> None:
    """Refuse JSON text that opens more containers than :data:`MAX_CONTAINERS_PER_BYTE`
    allows, before parsing it: this bounds what parsing may allocate to about 16 times the
    text's size (a list of two-character strings, the densest scalars, costs 15.5 times)."""
    data = bytes(raw)
    opened = data.count(b"[") + data.count(b"{")  # brackets inside strings count too: harmless
    limit = int(len(data) * MAX_CONTAINERS_PER_BYTE) + MIN_CONTAINERS
    if opened > limit:
        raise CorruptCheckpointError(
            f"{where}: opens {opened} JSON lists or objects in {len(data)} bytes, more than the "
            f"{limit} allowed; parsing it would cost about 25 times its size, so it "
            "is refused as corrupt or hostile"
        )


DIGEST_FIELD = "manifest_digest"
"""The manifest's own digest: its last member (FORMAT.md "The manifest's digest")."""
_SEAL = re.compile(rb',"manifest_digest":"([0-9a-f]{16})"\}\Z')


def seal(body: bytes) -> bytes:
    """The bytes of ``manifest.json`` for the JSON object text ``body``: ``body`` with a last
    member ``"manifest_digest"`` holding the xxh3-64 of ``body`` itself, so that every other
    byte of the file is covered."""
    if not body.startswith(b"{") or not body.endswith(b"}") or body == b"{}":
        raise ValueError("seal() takes the text of a non-empty JSON object")
    return body[:-1] + b',"' + DIGEST_FIELD.encode() + b'":"' + digest(body).encode() + b'"}'


def check_seal(raw: bytes, obj: Any, where: str) -> str | None:
    """Check the digest of the manifest file ``raw`` (parsed: ``obj``); return it, or None for
    a manifest written without one. A digest that differs, or that is not the file's last
    member in the form :func:`seal` writes, is a :class:`CorruptCheckpointError` naming
    ``where``."""
    if not isinstance(obj, dict) or DIGEST_FIELD not in obj:
        return None
    found = _SEAL.search(raw)
    if found is None or obj[DIGEST_FIELD] != found.group(1).decode():
        raise CorruptCheckpointError(
            f"{where}: its {DIGEST_FIELD} is not the file's last member in the form a writer "
            "gives it, so the file was rewritten or cut after it was written; the checkpoint "
            "is corrupt (load an earlier one; `shardsafe verify` checks the rest)"
        )
    body = raw[: found.start()] + b"}"
    if digest(body) != found.group(1).decode():
        raise CorruptCheckpointError(
            f"{where}: the manifest does not match its {DIGEST_FIELD} "
            f"({found.group(1).decode()}, computed {digest(body)}): it was changed after it "
            "was written; the checkpoint is corrupt or tampered with (load an earlier one)"
        )
    return str(obj[DIGEST_FIELD])


class _Parser:
    """Strict, message-rich validation of a manifest's JSON."""

    def __init__(self, where: str) -> None:
        self.where = where

    def bad(self, ctx: str, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: {ctx}: {msg}; the checkpoint is corrupt or not a shardsafe v{FORMAT_VERSION} checkpoint"
        )

    def get(self, obj: Any, name: str, kind: type | tuple[type, ...], ctx: str) -> Any:
        if not isinstance(obj, dict) or name not in obj:
            raise self.bad(ctx, f"missing field {name!r}")
        value = obj[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.bad(ctx, f"field {name!r} has the wrong type ({type(value).__name__})")
        return value

    def nat(self, obj: Any, name: str, ctx: str) -> int:
        value = self.get(obj, name, int, ctx)
        if isinstance(value, bool) or not 0 <= value < MAX_INT:
            raise self.bad(ctx, f"field {name!r} must be a non-negative integer below 2**62")
        return int(value)

    def ints(self, obj: Any, name: str, ctx: str) -> tuple[int, ...]:
        value = self.get(obj, name, list, ctx)
        if not all(type(v) is int and 0 <= v < MAX_INT for v in value) or len(value) > 64:
            raise self.bad(
                ctx, f"field {name!r} must be a list of at most 64 integers in [0, 2**62)"
            )
        return tuple(value)

    def manifest(self, obj: Any) -> Manifest:
        if not isinstance(obj, dict):
            raise self.bad("top level", "not a JSON object")
        if obj.get("format") != FORMAT_NAME:
            raise self.bad(
                "top level", f"format is {obj.get('format')!r}, expected {FORMAT_NAME!r}"
            )
        version = obj.get("version")
        if type(version) is not int or version != FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{self.where}: format version {version!r} is not supported by this shardsafe "
                f"(reads version {FORMAT_VERSION}); upgrade shardsafe to read it"
            )
        checksum = self.get(obj, "checksum", dict, "top level")
        if checksum.get("algorithm") != ALGORITHM:
            raise self.bad("checksum", f"unknown algorithm {checksum.get('algorithm')!r}")
        block_bytes = self.nat(checksum, "block_bytes", "checksum")
        if not 1 <= block_bytes <= MAX_BLOCK_BYTES:
            raise self.bad("checksum", f"block_bytes must lie in [1, {MAX_BLOCK_BYTES}]")
        files: dict[str, FileEntry] = {}
        for name, f in self.get(obj, "files", dict, "top level").items():
            check_file_name(name, self.where)
            files[name] = FileEntry(
                self.nat(f, "nbytes", f"file {name}"), self.nat(f, "rank", f"file {name}")
            )
        tensors = {}
        for key, t in self.get(obj, "tensors", dict, "top level").items():
            tensors[key] = self.tensor(key, t, files, block_bytes)
        objects = {}
        for ukey, o in self.get(obj, "objects", dict, "top level").items():
            ctx = f"object {ukey!r}"
            objects[ukey] = ObjectEntry(
                self.get(o, "key", str, ctx),
                self.ints(o, "global_shape", ctx),
                self.ints(o, "global_offset", ctx),
                o.get("value") if isinstance(o, dict) else None,
            )
        blobs = {
            bid: self.extent(b, f"blob {bid!r}", files, block_bytes)
            for bid, b in self.get(obj, "blobs", dict, "top level").items()
        }
        self.check_extents_disjoint(tensors, blobs)
        self.check_blob_references(obj.get("common"), objects, blobs)
        user = obj.get("user_metadata", {})
        return Manifest(
            world_size=self.nat(obj, "world_size", "top level"),
            block_bytes=block_bytes,
            files=files,
            tensors=tensors,
            objects=objects,
            blobs=blobs,
            common=obj.get("common"),
            created=str(obj.get("created", "")),
            library_version=str(obj.get("library_version", "")),
            user_metadata=user if isinstance(user, dict) else {},
        )

    def check_extents_disjoint(
        self, tensors: Mapping[str, TensorEntry], blobs: Mapping[str, Extent]
    ) -> None:
        """No byte of a data file backs two pieces or blobs (sorting: ``O(n log n)``)."""
        runs: list[tuple[str, int, int, str]] = [
            (p.extent.file, p.extent.byte_offset, p.extent.nbytes, f"tensor {key!r} piece {i}")
            for key, t in tensors.items()
            for i, p in enumerate(t.pieces)
        ]
        runs += [(e.file, e.byte_offset, e.nbytes, f"blob {bid!r}") for bid, e in blobs.items()]
        runs = sorted((r for r in runs if r[2] > 0), key=lambda r: (r[0], r[1]))
        for (fa, oa, na, wa), (fb, ob, _, wb) in itertools.pairwise(runs):
            if fa == fb and oa + na > ob:
                raise self.bad(
                    wb,
                    f"its bytes in {fb} from offset {ob} are also those of {wa} "
                    f"[{oa}, {oa + na}); stored extents must not overlap",
                )

    def check_blob_references(
        self, common: Any, objects: Mapping[str, ObjectEntry], blobs: Mapping[str, Extent]
    ) -> None:
        """Every blob an encoded value names exists and is named once, so what decoding
        allocates is bounded by the bytes of the data files."""
        seen: dict[str, str] = {}
        roots = [("common state", common)] + [
            (f"object {k!r}", o.value) for k, o in objects.items()
        ]
        for ctx, root in roots:
            stack = [root]
            while stack:
                node = stack.pop()
                if isinstance(node, list):
                    stack.extend(node)
                    continue
                if not isinstance(node, dict):
                    continue
                for tag, body in node.items():
                    ref = body if tag == "$bytes" else None
                    if tag in BLOB_TAGS and isinstance(body, dict):
                        ref = body.get("blob")
                    if isinstance(ref, str):
                        if ref not in blobs:
                            raise self.bad(ctx, f"refers to blob {ref[:80]!r}, which is not listed")
                        if ref in seen:
                            raise self.bad(
                                ctx, f"refers to blob {ref[:80]!r}, already used by {seen[ref]}"
                            )
                        seen[ref] = ctx
                    else:
                        stack.append(body)

    def extent(
        self, obj: Any, ctx: str, files: Mapping[str, FileEntry], block_bytes: int
    ) -> Extent:
        name = check_file_name(self.get(obj, "file", str, ctx), self.where)
        if name not in files:
            raise self.bad(ctx, f"refers to {name}, which the files table does not list")
        offset, nbytes = self.nat(obj, "byte_offset", ctx), self.nat(obj, "nbytes", ctx)
        if offset + nbytes > files[name].nbytes:
            raise self.bad(
                ctx,
                f"bytes [{offset}, {offset + nbytes}) lie beyond the end of {name} ({files[name].nbytes} bytes)",
            )
        sums = self.get(obj, "checksums", list, ctx)
        if len(sums) != block_count(nbytes, block_bytes) or not all(
            isinstance(s, str) and len(s) <= 32 for s in sums
        ):
            raise self.bad(
                ctx,
                f"expected {block_count(nbytes, block_bytes)} block checksums, found {len(sums)}",
            )
        return Extent(name, offset, nbytes, tuple(sums))

    def tensor(
        self, key: str, obj: Any, files: Mapping[str, FileEntry], block_bytes: int
    ) -> TensorEntry:
        ctx = f"tensor {key!r}"
        dtype = self.get(obj, "dtype", str, ctx)
        size = itemsize(dtype_from_name(dtype, f"{self.where}: {ctx}"))
        shape = self.ints(obj, "shape", ctx)
        pieces = []
        for i, p in enumerate(self.get(obj, "pieces", list, ctx)):
            pctx = f"{ctx} piece {i}"
            offset, pshape = self.ints(p, "offset", pctx), self.ints(p, "shape", pctx)
            if (
                len(offset) != len(shape)
                or len(pshape) != len(shape)
                or not Box(offset, pshape).within(shape)
            ):
                raise self.bad(
                    pctx, f"box {offset}+{pshape} does not fit the tensor's shape {shape}"
                )
            flat_raw = p.get("flat") if isinstance(p, dict) else None
            flat: tuple[int, int] | None = None
            if flat_raw is not None:
                if not (
                    isinstance(flat_raw, list)
                    and len(flat_raw) == 2
                    and all(type(v) is int for v in flat_raw)
                ) or not (0 <= flat_raw[0] <= flat_raw[1] <= math.prod(pshape)):
                    raise self.bad(
                        pctx,
                        f"flat range {flat_raw!r} is not inside the box's {math.prod(pshape)} elements",
                    )
                flat = (flat_raw[0], flat_raw[1])
            extent = self.extent(p, pctx, files, block_bytes)
            numel = flat[1] - flat[0] if flat else math.prod(pshape)
            if extent.nbytes != numel * size:
                raise self.bad(
                    pctx,
                    f"holds {extent.nbytes} bytes, but {numel} {dtype} elements need {numel * size}",
                )
            pieces.append(StoredPiece(offset, pshape, flat, extent))
        return TensorEntry(dtype, shape, tuple(pieces))
