"""Safe encoding of non-tensor state (common state, ShardedObjects) as JSON plus byte blobs.

Loading never runs code from the checkpoint: plain data is JSON; tensors, numpy arrays and
bytes are raw blobs; dtypes, devices, sizes and ``argparse.Namespace`` have explicit tags;
anything else is stored with ``torch.save`` and read back only by
``torch.load(weights_only=True)``, which refuses classes that are not allow-listed.

Encoded nodes: JSON ``null``/bool/int/str and lists stand for themselves; everything else is
a one-key object whose key starts with ``$`` (``{"$dict": [[k, v], ...]}``, ``{"$tensor": ...}``).
``{"$tensor_ref": key}`` marks where a plain tensor leaf stood; its data is the stored tensor ``key``.
"""

from __future__ import annotations

import argparse
import io
import math
import pickle
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, cast

import numpy as np
import torch
from typing_extensions import Buffer

from .dtypes import dtype_from_name, dtype_name
from .errors import CorruptCheckpointError, UnsafeObjectError, ValidationError
from .sharding import PLACEHOLDER, CoordinatorObject, TensorRef


@dataclass
class EncodedTree:
    """The JSON form of a tree and the blobs it refers to by id."""

    node: Any
    blobs: dict[str, bytes | memoryview] = field(default_factory=dict)


def array_view(a: np.ndarray) -> memoryview:
    """A flat byte view of a numpy array's memory (no copy)."""
    return memoryview(cast(Buffer, a)).cast("B") if a.size else memoryview(b"")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian C-order bytes of a (CPU) tensor, without copying when contiguous."""
    t = t.detach().resolve_conj().resolve_neg()  # a lazily conjugated/negated view: its values
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.as_strided((t.numel(),), (1,))  # dense, whatever strides size-1 axes claim
    return array_view(flat.view(torch.uint8).numpy())


def encode(tree: Any, blob_prefix: str) -> EncodedTree:
    """Encode ``tree``; blobs get ids ``f"{blob_prefix}{n}"``."""
    out = EncodedTree(None)

    def blob(data: bytes | memoryview) -> str:
        blob_id = f"{blob_prefix}{len(out.blobs)}"
        out.blobs[blob_id] = data
        return blob_id

    def enc(x: Any) -> Any:
        if x is PLACEHOLDER:
            return {"$sharded": None}
        if isinstance(x, TensorRef):
            return {"$tensor_ref": x.key}
        if isinstance(x, CoordinatorObject):
            return enc(x.obj)
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int) and type(x) is int:
            return x
        if isinstance(x, float) and type(x) is float:
            return x if math.isfinite(x) else {"$float": repr(x)}
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided or x.is_quantized or x.is_nested:
                return pickled(x)
            return {
                "$tensor": {
                    "dtype": dtype_name(x.dtype),
                    "shape": list(x.shape),
                    "blob": blob(tensor_bytes(x)),
                }
            }
        if isinstance(x, np.ndarray) and x.dtype.kind in "biufc" and x.dtype.byteorder in "=<|":
            a = np.ascontiguousarray(x)
            return {
                "$ndarray": {
                    "dtype": a.dtype.str,
                    "shape": list(a.shape),
                    "blob": blob(array_view(a)),
                }
            }
        if isinstance(x, np.generic) and x.dtype.kind in "biufc":
            return {"$npscalar": {"dtype": x.dtype.str, "value": enc(x.item())}}
        if isinstance(x, (bytes, bytearray)):
            return {"$bytes": blob(bytes(x))}
        if isinstance(x, torch.dtype):
            return {"$dtype": dtype_name(x)}
        if isinstance(x, torch.device):
            return {"$device": str(x)}
        if isinstance(x, torch.Size):
            return {"$size": list(x)}
        if isinstance(x, argparse.Namespace):
            return {"$namespace": enc(vars(x))}
        if type(x) is dict:
            return {"$dict": [[enc(k), enc(v)] for k, v in x.items()]}
        if type(x) is list:
            return [enc(v) for v in x]
        if type(x) is tuple:
            return {"$tuple": [enc(v) for v in x]}
        return pickled(x)

    def pickled(x: Any) -> Any:
        buf = io.BytesIO()
        name = f"{type(x).__module__}.{type(x).__qualname__}"
        try:
            torch.save(x, buf)
        except Exception as e:
            raise ValidationError(
                f"cannot store a {name} in a checkpoint: {e}; store plain data (numbers, strings, "
                "lists, dicts, tensors) or a ShardedObject of it"
            ) from e
        check_loads_back(buf.getvalue(), name)
        return {
            "$torch_save": {
                "type": f"{type(x).__module__}.{type(x).__qualname__}",
                "blob": blob(buf.getvalue()),
            }
        }

    out.node = enc(tree)
    return out


def is_plain_json(x: Any) -> bool:
    """Whether ``json`` gives ``x`` back exactly: str-keyed dicts, lists, str, int, finite float,
    bool, None, with exactly those types (a tuple would come back a list, ``{6: ...}`` as
    ``{"6": ...}``, a dict subclass as a dict)."""
    if x is None or type(x) in (bool, str, int):
        return True
    if type(x) is float:
        return math.isfinite(x)
    if type(x) is list:
        return all(is_plain_json(v) for v in x)
    if type(x) is dict:
        return all(type(k) is str and is_plain_json(v) for k, v in x.items())
    return False


def encode_inline(tree: Any, what: str) -> Any:
    """The encoded value of ``tree`` for a place with no blobs (the manifest's ``user_metadata``):
    tuples, non-str keys, non-finite floats, dtypes... are tagged; what needs a blob (tensors,
    arrays, bytes, pickled objects) is refused with :class:`ValidationError`."""
    enc = encode(tree, "")
    if enc.blobs:
        raise ValidationError(
            f"{what} holds a tensor, array, bytes or an object that only torch.save can store; "
            "it is kept in the manifest, which holds no data: put such values in the state dict"
        )
    return enc.node


def decode_inline(node: Any, where: str) -> Any:
    """Inverse of :func:`encode_inline`; a reference to a blob is corrupt here."""

    def no_blob(blob_id: str) -> bytes:
        raise CorruptCheckpointError(f"{where}: refers to blob {blob_id[:80]!r}, which it may not")

    return decode(node, no_blob, where)


def check_loads_back(pickled: bytes, name: str) -> None:
    """Refuse to store what ``decode`` would refuse to load, with the message load would give."""
    try:
        torch.load(io.BytesIO(pickled), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise UnsafeObjectError(
            f"cannot store a {name}: loading it back would be refused: {_refusal(e)}; "
            "or store plain data (numbers, strings, lists, dicts, tensors) instead"
        ) from None
    except Exception as e:
        raise ValidationError(f"cannot store a {name}: it does not load back: {e}") from None


def decode(node: Any, fetch: Callable[[str], bytes | memoryview], where: str = "manifest") -> Any:
    """Rebuild a tree; ``fetch(blob_id)`` returns the verified bytes of a blob."""

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {msg}")

    def dec(x: Any) -> Any:
        if x is None or isinstance(x, (bool, str, int, float)):
            return x
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict) or len(x) != 1:
            raise bad(f"malformed encoded value {str(x)[:80]!r}")
        ((tag, body),) = x.items()
        if tag == "$sharded":
            return None
        if tag == "$tensor_ref":
            if not isinstance(body, str) or not body:
                raise bad("malformed $tensor_ref")
            return TensorRef(body)
        if tag == "$float":
            if body not in ("nan", "inf", "-inf"):
                raise bad(f"bad float {body!r}")
            return float(body)
        if tag == "$dict":
            if not isinstance(body, list) or not all(
                isinstance(p, list) and len(p) == 2 for p in body
            ):
                raise bad("malformed $dict")
            out = {}
            for k, v in body:
                key = dec(k)
                try:
                    out[key] = dec(v)
                except TypeError:
                    raise bad(f"unhashable dict key {str(k)[:80]}") from None
            return out
        if tag == "$tuple":
            if not isinstance(body, list):
                raise bad("malformed $tuple")
            return tuple(dec(v) for v in body)
        if tag == "$tensor":
            dtype = dtype_from_name(_field(body, "dtype", str, where), where)
            shape = _shape(body, where)
            data = fetch(_field(body, "blob", str, where))
            return _tensor_from_bytes(data, dtype, shape, where)
        if tag == "$ndarray":
            dt = _numpy_dtype(_field(body, "dtype", str, where), where)
            if dt.kind not in "biufc":
                raise bad(f"numpy dtype {dt} is not allowed")
            shape = _shape(body, where)
            raw = bytes(fetch(_field(body, "blob", str, where)))
            if len(raw) != math.prod(shape) * dt.itemsize:
                raise bad(
                    f"ndarray blob holds {len(raw)} bytes, expected {math.prod(shape) * dt.itemsize}"
                )
            try:
                return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
            except (ValueError, OverflowError, MemoryError) as e:
                raise bad(f"bad ndarray shape {list(shape)[:8]}: {e}") from None
        if tag == "$npscalar":
            dt = _numpy_dtype(_field(body, "dtype", str, where), where)
            if dt.kind not in "biufc":  # what encode writes; np.void(n) would allocate n bytes
                raise bad(f"numpy scalar dtype {dt} is not allowed")
            try:
                return dt.type(dec(body.get("value")))
            except (TypeError, ValueError, OverflowError):
                raise bad(f"bad numpy scalar {str(body)[:80]}") from None
        if tag == "$bytes":
            if not isinstance(body, str):
                raise bad("malformed $bytes")
            return bytes(fetch(body))
        if tag == "$dtype":
            return dtype_from_name(body, where)
        if tag == "$device":
            if not isinstance(body, str) or len(body) > 64:
                raise bad(f"bad device {str(body)[:80]!r}")
            try:
                return torch.device(body)
            except (RuntimeError, TypeError, ValueError, OverflowError):
                raise bad(f"bad device {body!r}") from None
        if tag == "$size":
            if not isinstance(body, list) or not all(type(v) is int for v in body):
                raise bad("malformed $size")
            try:
                return torch.Size(body)
            except (RuntimeError, TypeError, ValueError, OverflowError):
                raise bad(f"bad $size {str(body)[:80]}") from None
        if tag == "$namespace":
            d = dec(body)
            if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
                raise bad("malformed $namespace")
            return argparse.Namespace(**d)
        if tag == "$torch_save":
            pickled_bytes = bytes(fetch(_field(body, "blob", str, where)))
            sizes = check_torch_archive(io.BytesIO(pickled_bytes), len(pickled_bytes), where)
            try:
                value = torch.load(io.BytesIO(pickled_bytes), weights_only=True, map_location="cpu")
            except pickle.UnpicklingError as e:
                raise UnsafeObjectError(
                    f"{where}: refused to load a stored {body.get('type')!r}: {_refusal(e)}"
                ) from None
            except Exception as e:
                raise bad(f"cannot read a stored {body.get('type')!r}: {e}") from None
            check_loaded_tree(value, sizes, f"{where}: a stored {str(body.get('type'))[:80]!r}")
            return value
        raise bad(f"unknown tag {tag!r}")

    try:
        return dec(node)
    except RecursionError:
        raise bad("the encoded value is nested too deeply to decode") from None


def _refusal(e: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused, and how to allow it, in one line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        name = found.group(1)
        return (
            f"it needs {name}, which is not allow-listed. If you trust this checkpoint, allow it with "
            f"torch.serialization.add_safe_globals([{name}]) (or the torch.serialization.safe_globals "
            "context manager) and load again"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = next(
        (line for line in lines if "WeightsUnpickler error" in line),
        lines[0] if lines else type(e).__name__,
    )
    return (
        f"{detail} If you trust this checkpoint, allow what it needs with "
        "torch.serialization.add_safe_globals([...]) and load again"
    )


@dataclass(frozen=True)
class ArchiveSizes:
    """What a ``torch.save`` archive holds, to bound what loading it may describe."""

    pickle_bytes: int
    """Bytes of its pickles (``data.pkl``): the walk budget of the value they build."""
    storage_bytes: int
    """Bytes of its storage records (the whole file for a legacy one): its tensors' storages
    together hold at most this much."""


def check_torch_archive(
    file: IO[bytes], size: int, where: str, *, allow_legacy: bool = False
) -> ArchiveSizes:
    """Refuse a ``torch.save`` archive that could inflate beyond its ``size`` bytes when loaded.

    ``torch.save`` stores every record uncompressed; a deflated record (a decompression
    bomb, or bytes torch would memory-map as if they were data) is refused, and so is any
    archive whose records claim more bytes than the archive holds. Legacy (non-zip)
    ``torch.save`` files are refused unless ``allow_legacy``: their storages are sized by
    the pickle (torch then reads them from the file, so a short file fails the load).
    Returns the sizes :func:`check_loaded_tree` bounds the loaded value by.
    """
    head = file.read(4)
    file.seek(0)
    if allow_legacy and head[:1] == b"\x80":  # a legacy pickle stream: no archive to inflate
        return ArchiveSizes(size, size)
    try:
        with zipfile.ZipFile(file) as zf:
            infos = zf.infolist()
    except Exception as e:  # zipfile raises BadZipFile, ValueError, OSError, struct.error...
        raise CorruptCheckpointError(
            f"{where}: refused: not a torch.save zip archive ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    total = storages = 0
    pickles = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptCheckpointError(
                f"{where}: record {info.filename[:100]!r} is compressed "
                f"({info.compress_size} bytes inflating to {info.file_size}); torch.save never "
                "compresses, so this archive is corrupt or hostile"
            )
        total += info.file_size
        if info.filename.endswith("/data.pkl") or info.filename == "data.pkl":
            pickles.append(info)
        elif _STORAGE_RECORD.search(info.filename):
            storages += info.file_size
    if total > size:
        raise CorruptCheckpointError(
            f"{where}: records claim {total} bytes, more than the archive's {size}; it is corrupt"
        )
    for info in pickles:
        with zipfile.ZipFile(file) as zf:
            scan_pickle(zf.read(info), f"{where}: {info.filename[:100]}", _DISTRIBUTED)
    file.seek(0)
    return ArchiveSizes(sum(info.file_size for info in pickles), storages)


_STORAGE_RECORD = re.compile(r"(^|/)data/\d+$")
"""The records ``torch.save`` writes each storage's bytes to."""
MAX_WALK_PER_PICKLE_BYTE = 64
"""A loaded value, walked path by path, costs at most this many steps per byte of its pickle
(plus :data:`MIN_WALK`)."""
MIN_WALK = 1 << 22
MAX_TENSOR_SHARING = 8
"""The tensors of a loaded value, counted at every place they appear, describe at most this
many times the bytes of its storage records (tied weights appear two to four times)."""


def check_loaded_tree(value: Any, sizes: ArchiveSizes, where: str) -> None:
    """Refuse a value from an untrusted pickle whose path-by-path walk would cost more than
    its bytes on disk allow.

    A pickle's memo lets a few bytes refer to one container many times: 40 nested lists,
    each holding the next one twice, take 1.5 KB and have 2**40 paths, which every consumer
    of nested state (flattening, restoring into a template, printing, comparing) walks one
    by one. This walk visits each distinct container once (a visited set) and computes what
    the path-by-path walks will cost: the total length of all paths must stay within
    :data:`MAX_WALK_PER_PICKLE_BYTE` steps per pickle byte (plus :data:`MIN_WALK`), and a
    container holding itself is refused. Shared small values (repeated strings, tuples in an
    ``argparse.Namespace``) cost little and pass.

    Tensors: each must lie in its storage without repeating bytes (``numel * itemsize`` at
    most the storage's bytes; a stride-0 ``zeros(1).expand(n)`` describes ``n`` elements
    from one), distinct storages together hold at most the archive's storage records, and
    all tensors counted at every place they appear at most :data:`MAX_TENSOR_SHARING` times
    that.
    """
    budget = MAX_WALK_PER_PICKLE_BYTE * sizes.pickle_bytes + MIN_WALK
    tensor_budget = MAX_TENSOR_SHARING * sizes.storage_bytes
    storages: dict[int, int] = {}
    tensors: dict[int, int] = {}

    def tensor_cost(t: torch.Tensor) -> int:
        cost = tensors.get(id(t))
        if cost is not None:
            return cost
        try:
            if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
                cost = 0  # not dense data: the readers that take tensors refuse these
            else:
                cost = t.numel() * t.element_size()
                storage = t.untyped_storage()
                held = storage.nbytes()
                if cost > held:
                    raise CorruptCheckpointError(
                        f"{where}: a tensor of shape {list(t.shape)[:8]} and strides "
                        f"{list(t.stride())[:8]} describes {cost} bytes but its storage holds "
                        f"{held}; a stored tensor must not repeat its storage's bytes "
                        "(a stride-0 or overlapping view); refused"
                    )
                storages[storage.data_ptr()] = max(held, storages.get(storage.data_ptr(), 0))
        except RuntimeError:  # a layout without plain storage: no dense bytes to count
            cost = 0
        tensors[id(t)] = cost
        return cost

    def children(x: Any) -> Any:
        if isinstance(x, dict):
            return [*x.keys(), *x.values()]
        if isinstance(x, (list, tuple, set, frozenset)):
            return x
        if isinstance(x, argparse.Namespace):
            return list(vars(x).values())
        return None

    # Per container: (paths in it, total length of those paths, tensor bytes along them).
    done: dict[int, tuple[int, int, int]] = {}
    walking: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        node, leaving = stack.pop()
        kids = children(node)
        if kids is None:
            continue
        key = id(node)
        if not leaving:
            if key in done:
                continue
            if key in walking:
                raise CorruptCheckpointError(
                    f"{where}: a {type(node).__name__} contains itself; refused"
                )
            walking.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in done and children(k) is not None)
            continue
        walking.discard(key)
        paths, length, nbytes = 1, 0, 0
        for k in kids:
            sub = done.get(id(k))
            if sub is None:
                sub = (1, 0, tensor_cost(k) if isinstance(k, torch.Tensor) else 0)
            paths += sub[0]
            length += sub[1] + sub[0]
            nbytes += sub[2]
        if length > budget:
            raise CorruptCheckpointError(
                f"{where}: the value refers to its parts so often that walking it would take "
                f"more than {budget} steps for {sizes.pickle_bytes} bytes of pickle (shared "
                "references); refused as hostile"
            )
        if nbytes > tensor_budget:
            raise CorruptCheckpointError(
                f"{where}: its tensors, counted where they appear, describe {nbytes} bytes, more "
                f"than {MAX_TENSOR_SHARING} times the {sizes.storage_bytes} bytes stored; refused"
            )
        done[key] = (paths, length, nbytes)
    if isinstance(value, torch.Tensor) and tensor_cost(value) > tensor_budget:
        raise CorruptCheckpointError(f"{where}: the tensor describes more bytes than are stored")
    if sum(storages.values()) > sizes.storage_bytes:
        raise CorruptCheckpointError(
            f"{where}: its tensors' storages hold {sum(storages.values())} bytes, more than the "
            f"{sizes.storage_bytes} bytes of storage records; refused"
        )


_DISTRIBUTED = ("torch.distributed",)
"""Importing ``torch.distributed.tensor`` allow-lists ``DTensor``, ``DeviceMesh`` and the
placement classes for every ``torch.load(weights_only=True)`` in the process; stored
values never need them, so archives naming them are refused whatever was imported."""


def scan_pickle(data: bytes, where: str, refused_prefixes: tuple[str, ...] = ()) -> None:
    """Refuse a pickle with ``EXT`` opcodes or naming anything under ``refused_prefixes``.

    ``EXT1/2/4`` fetch objects from the process-wide ``copyreg`` extension cache without
    consulting an unpickler's ``find_class``: an allow-list cannot see them. The scan reads
    opcodes only (``pickletools.genops``), so nothing is built or run.
    """
    import pickletools

    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name.startswith("EXT"):
                raise UnsafeObjectError(
                    f"{where}: the pickle uses {op.name}, which loads from the copyreg extension "
                    "registry and bypasses the allow-list; refused"
                )
            if refused_prefixes and isinstance(arg, str) and arg.startswith(refused_prefixes):
                raise UnsafeObjectError(
                    f"{where}: the pickle names {arg[:100]!r}, which stored values never need; refused"
                )
    except (ValueError, EOFError) as e:  # a damaged pickle (genops stops at STOP)
        raise CorruptCheckpointError(f"{where}: not a readable pickle ({str(e)[:200]})") from None


def _numpy_dtype(name: str, where: str) -> np.dtype:
    try:
        return np.dtype(name)
    except Exception:  # numpy's parser raises TypeError, ValueError, even SyntaxError
        raise CorruptCheckpointError(f"{where}: bad numpy dtype {name[:40]!r}") from None


def _field(body: Any, name: str, kind: type, where: str) -> Any:
    if not isinstance(body, dict) or not isinstance(body.get(name), kind):
        raise CorruptCheckpointError(f"{where}: encoded value lacks a valid {name!r}")
    return body[name]


def _shape(body: Any, where: str) -> tuple[int, ...]:
    shape = _field(body, "shape", list, where)
    if len(shape) > 32 or not all(type(s) is int and 0 <= s < 1 << 62 for s in shape):
        raise CorruptCheckpointError(f"{where}: bad shape {shape!r}")
    return tuple(shape)


def _tensor_from_bytes(
    data: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...], where: str
) -> torch.Tensor:
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(data) != nbytes:
        raise CorruptCheckpointError(
            f"{where}: tensor blob holds {len(data)} bytes, expected {nbytes}"
        )
    try:
        out = torch.empty(shape, dtype=dtype)
    except (RuntimeError, ValueError, OverflowError, MemoryError) as e:
        raise CorruptCheckpointError(
            f"{where}: bad tensor shape {list(shape)[:8]}: {str(e).splitlines()[0][:200]}"
        ) from None
    if nbytes:
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out
