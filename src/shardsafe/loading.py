"""``load``: read the manifest, fill every requested piece in place, merge the common state
(the merge and the Stateful hand-back are :mod:`shardsafe.load_result`'s).

Each rank reads only what it asked for: every requested box (or flat range) is intersected
with the stored boxes, so any saved layout loads into any requested layout. At the end all
ranks exchange one tiny status, so a failure on one rank raises on every rank.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .codec import decode, decode_inline
from .delivery import Deliveries
from .directio import direct_io_mode
from .dist import get_comm, outcome, raise_for
from .dtypes import dtype_from_name
from .engine import (
    DEFAULT_MAX_BUFFER,
    DataReader,
    ReadTask,
    default_threads,
    in_place,
    plan_reads,
    run_tasks,
    span_of,
)
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleRequestError,
    IncompleteCheckpointError,
    MissingKeyError,
    read_failure,
)
from .format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, TensorEntry
from .geometry import Box, intersect
from .liveness import DEAD_AFTER
from .load_result import (
    ABSENT,
    apply_factories_recording,
    get_at,
    hand_back,
    lookup_or,
    merge_common,
    replace_at,
    resolve_refs,
)
from .location import TMP_MARK, Location, locate
from .parallel_load import (
    MIN_SHARED_BYTES,
    PreparedExchange,
    SharedPiece,
    assign_readers,
    check_option,
    prepare_exchange,
    received,
    request_digest,
    should_share,
    transfer,
)
from .sharding import (
    Path,
    ShardedTensor,
    ShardedTensorFactory,
    adapt,
    resolve_stateful,
    split_state_dict,
)
from .storage.base import Storage

log = logging.getLogger("shardsafe")


class StrictHandling(enum.Enum):
    """What to do with key mismatches, with Megatron-Core's names.

    *Unexpected* keys are requested but absent from the checkpoint; *missing* keys are in the
    checkpoint but requested by no rank. The default raises on unexpected keys and accepts
    missing ones (loading only the model from a full checkpoint is normal).
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @property
    def needs_missing(self) -> bool:
        return self in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @property
    def returns(self) -> bool:
        return self in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)

    @property
    def raises_unexpected(self) -> bool:
        return self in (
            StrictHandling.ASSUME_OK_UNEXPECTED,
            StrictHandling.RAISE_UNEXPECTED,
            StrictHandling.RAISE_ALL,
        )


# --------------------------------------------------------------------------- manifest


def checkpoint_storage(loc: Location) -> Storage:
    from .storage import storage_for

    return storage_for(loc.url)


def read_manifest(path: str | os.PathLike[str]) -> tuple[Manifest, Storage]:
    """The parsed manifest and the storage rooted at the checkpoint, or a clear error."""
    loc = locate(path)
    storage = checkpoint_storage(loc)
    try:
        size = storage.size(MANIFEST_NAME)
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{storage.describe(MANIFEST_NAME)} holds {size} bytes, more than the "
                f"{MAX_MANIFEST_BYTES} a manifest may have; it is corrupt or hostile"
            )
        raw = storage.read_bytes(MANIFEST_NAME)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise _not_found(loc, storage) from None
    except OSError as e:
        raise read_failure(f"cannot read {storage.describe(MANIFEST_NAME)}: {e}", e) from None
    return Manifest.loads(raw, storage.describe(MANIFEST_NAME)), storage


def _not_found(loc: Location, storage: Storage) -> CheckpointNotFoundError:
    siblings = [n for n in loc.parent.list_dir("") if n.startswith(f".{loc.name}{TMP_MARK}")]
    if storage.exists("") and storage.is_dir(""):
        if storage.exists("data"):
            return IncompleteCheckpointError(
                f"{loc.url} has data files but no {MANIFEST_NAME}: a save into it never committed. "
                "Load an earlier checkpoint; delete this directory to reclaim space"
            )
        if storage.exists(".metadata"):
            return CheckpointNotFoundError(
                f"{loc.url} is a PyTorch DCP checkpoint, not a shardsafe one (no {MANIFEST_NAME}): "
                "shardsafe.load reads it as it is; for the other tools, `shardsafe convert "
                f"{loc.url} OUT --to shardsafe` makes a shardsafe checkpoint of it"
            )
        return CheckpointNotFoundError(
            f"{loc.url} is not a shardsafe checkpoint (no {MANIFEST_NAME})"
        )
    if siblings:
        return IncompleteCheckpointError(
            f"{loc.url} does not exist; {loc.parent.describe(siblings[0])} is an uncommitted save into it "
            "(crashed or still running). Load an earlier checkpoint"
        )
    return CheckpointNotFoundError(f"no checkpoint at {loc.url}")


# --------------------------------------------------------------------------- load


@dataclass
class _Request:
    path: Path
    tensor: ShardedTensor


def _targets(st: ShardedTensor, data: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """(global box, view of ``data`` holding that box) pairs for a requested piece."""
    if st.flattened_range is None:
        view = data
        for _ in range(st.prepend_axis_num):
            view = view.unsqueeze(0)
        return [(st.chunk_box, view)]
    return [(box, data[pos : pos + box.numel].view(box.shape)) for pos, box in st.boxes()]


def _check_compatible(st: ShardedTensor, entry: TensorEntry, where: str) -> None:
    stored_dtype = dtype_from_name(entry.dtype, where)
    if tuple(entry.shape) != st.global_shape and not st.allow_shape_mismatch:
        raise IncompatibleRequestError(
            f"{st.key!r}: the checkpoint holds global shape {list(entry.shape)}, the request asks for "
            f"{list(st.global_shape)}; set allow_shape_mismatch=True on the ShardedTensor to load the overlap"
        )
    if stored_dtype != st.dtype and not st.allow_shape_mismatch:
        raise IncompatibleRequestError(
            f"{st.key!r}: the checkpoint holds {entry.dtype}, the request asks for {st.dtype}; "
            "request the stored dtype and cast, or set allow_shape_mismatch=True to convert on load"
        )
    if len(entry.shape) != len(st.global_shape):
        raise IncompatibleRequestError(
            f"{st.key!r}: the checkpoint's tensor has {len(entry.shape)} axes, the request {len(st.global_shape)}"
        )


def _fill_tensor(
    st: ShardedTensor, entry: TensorEntry, max_elems: int, where: str
) -> tuple[torch.Tensor, list[ReadTask], Callable[[], None]]:
    """Destination tensor, the reads that fill it, and a finaliser to run after the reads."""
    _check_compatible(st, entry, where)
    entry.check_tiling(st.key, where)
    shape = (st.numel,) if st.flattened_range is not None else st.local_shape
    data = st.data
    if data is None:
        data = (torch.zeros if st.allow_shape_mismatch else torch.empty)(shape, dtype=st.dtype)
    # Every copy goes into this alias: it shares the destination's memory (an nn.Parameter
    # included) but not its autograd history, so reader threads may write views of it
    # whatever their grad mode, and the parameter keeps requires_grad.
    data = data.detach()
    if tuple(entry.shape) != st.global_shape:
        data.zero_()
    work = data
    if st.flattened_range is not None and not data.is_contiguous():
        work = torch.empty_like(data, memory_format=torch.contiguous_format)
    tasks, covered = plan_reads(
        st.key, entry.pieces, _targets(st, work), dtype_from_name(entry.dtype), max_elems
    )
    if tuple(entry.shape) == st.global_shape and covered != st.numel:
        raise CorruptCheckpointError(
            f"{st.key!r}: the checkpoint's pieces cover {covered} of the {st.numel} requested elements; "
            "the manifest is inconsistent"
        )

    def finish() -> None:
        if work is not data:
            data.copy_(work)

    return data, tasks, finish


def load(
    sharded_state_dict: Any,
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    strict: StrictHandling | str = StrictHandling.ASSUME_OK_UNEXPECTED,
    threads: int | None = None,
    max_buffer_bytes: int = DEFAULT_MAX_BUFFER,
    timeout: float = 1800.0,
    fully_parallel: bool | str = "auto",
    direct_io: str | None = None,
    dead_after: float = DEAD_AFTER,
    delivered: Deliveries | None = None,
) -> Any:
    """Load ``path`` into the layout described by ``sharded_state_dict`` (the template).

    Tensors handed in are filled in place; the result has the template's structure with every
    sharded entry replaced by its tensor/object, non-persistent values unwrapped, and the
    checkpoint's common state merged in. A Stateful object of the template (``state_dict()``
    and ``load_state_dict()``: a module, an LR scheduler, an ``OptimizerState``) is loaded as
    PyTorch DCP does: its ``state_dict()`` is the template of its part, and once every rank
    has loaded, ``load_state_dict(loaded part)`` is called; the object stands in the result. With ``strict=RETURN_*`` returns
    ``(state_dict, missing_keys, unexpected_keys)``. Every rank of ``process_group`` must call it;
    ``timeout`` bounds how long a rank waits for the others before naming the absent ones; a rank
    that stopped heartbeating (dead, frozen, its host lost) is named after ``dead_after`` s.
    ``fully_parallel``: a piece requested by several ranks is read by one and sent to the others
    (``True``), every rank reads for itself (``False``), or the measured heuristic decides
    (``"auto"``: only over NCCL, see :func:`shardsafe.parallel_load.should_share`).
    ``direct_io``: whether large reads of uncached data may bypass the page cache (``"auto"``,
    ``"always"``, ``"never"``; None: ``SHARDSAFE_DIRECT_IO``, default auto).
    ``delivered``: bytes of ``path``'s data files already in memory (a restore's copy round put
    them where :func:`in_place_deliveries` said this load reads them): taken from there, and
    verified like every other byte read.
    """
    strict = StrictHandling(strict)
    direct_io = direct_io_mode(direct_io)
    comm = get_comm(process_group)
    comm.dead_after = dead_after
    t0 = time.perf_counter()
    # another framework's directory, e.g. Megatron-Core torch_dist (see register_foreign_loader)
    foreign = FOREIGN_LOADERS.find(path)
    if foreign is not None:
        statefuls: list[tuple[Path, Any]] = []

        def load_foreign() -> Any:
            template, found = resolve_stateful(sharded_state_dict)
            statefuls.extend(found)
            return foreign(template, path, strict)

        loaded, err = outcome(load_foreign)
        comm.arrive("load", timeout, dead_after)
        records = comm.all_gather({"error": err, "stateful": bool(statefuls)})
        raise_for([r["error"] for r in records], "load")
        if any(r["stateful"] for r in records):
            loaded = _hand_back_all(comm, loaded, statefuls, strict, path)
        return loaded
    job, err = outcome(
        lambda: _LoadJob(
            sharded_state_dict,
            path,
            strict,
            threads or default_threads(),
            max_buffer_bytes,
            direct_io,
            delivered,
        )
    )
    check_option(fully_parallel)
    shared: list[SharedPiece] = []
    if comm.distributed and (
        fully_parallel is True
        or (fully_parallel == "auto" and should_share(comm, MIN_SHARED_BYTES, "auto"))
    ):
        # digests, not requests: finding who holds the same piece needs every rank's list
        comm.arrive("load planning", timeout, dead_after)
        records = comm.all_gather({"error": err, "requests": job.request_digests() if job else []})
        raise_for([r["error"] for r in records], "load planning")
        candidates = assign_readers([[(d, n) for d, n in r["requests"]] for r in records])
        volume = sum(p.nbytes * (len({r for r, _ in p.holders}) - 1) for p in candidates)
        if should_share(comm, volume, fully_parallel):
            shared = candidates
    assert job is not None or err is not None
    prepared: PreparedExchange | None = None
    if job is not None:

        def read() -> PreparedExchange | None:
            assert job is not None
            job.read(received(comm.rank, shared))
            # devices checked and buffers made before any byte is sent
            return prepare_exchange(comm, shared, job.request_tensors) if shared else None

        prepared, err = outcome(read)
    if shared:
        comm.arrive("load exchange", timeout, dead_after)
        records = comm.all_gather({"error": err})
        raise_for([r["error"] for r in records], "load")
        assert prepared is not None
        # a failure here is agreed on with the others below, not raised on this rank alone
        _, err = outcome(lambda: transfer(comm, prepared))
    result = None
    if job is not None and err is None:
        result, err = outcome(job.finish)
    state = {
        "error": err,
        "requested": sorted(job.requested) if job and strict.needs_missing else None,
        "stateful": bool(job and job.statefuls),
    }
    comm.arrive("load", timeout, dead_after)
    records = comm.all_gather(state)
    raise_for([r["error"] for r in records], "load")
    assert job is not None and result is not None
    missing: set[str] = set()
    if strict.needs_missing:
        everyone = set().union(*(set(r["requested"]) for r in records))
        missing = job.stored_keys - everyone
        if missing:
            msg = (
                f"{len(missing)} checkpoint keys were requested by no rank: {sorted(missing)[:10]}"
            )
            if strict == StrictHandling.RAISE_ALL:
                raise MissingKeyError(
                    f"{os.fspath(path)}: {msg}; request them too, or pass strict='raise_unexpected' "
                    "to accept checkpoint keys that no rank asks for"
                )
            if strict == StrictHandling.LOG_ALL:
                log.warning("%s: %s", os.fspath(path), msg)
    if comm.is_coordinator:
        log.info(
            "loaded %s in %.3f s%s",
            os.fspath(path),
            time.perf_counter() - t0,
            f" ({len(shared)} replicated pieces read once and sent)" if shared else "",
        )
    if any(r["stateful"] for r in records):
        result = _hand_back_all(comm, result, job.statefuls, strict, path)
    if strict.returns:
        return result, missing, set(job.unexpected)
    return result


def _hand_back_all(
    comm: Any, result: Any, statefuls: list[tuple[Path, Any]], strict: StrictHandling, path: Any
) -> Any:
    """Call ``load_state_dict`` of every Stateful object once all ranks have loaded (it may run
    collectives of its own, as DCP's ``set_state_dict`` does), then agree on the outcome."""
    body = result[0] if strict.returns and isinstance(result, tuple) else result
    body, err = outcome(lambda: hand_back(body, statefuls, os.fspath(path)))
    records = comm.all_gather({"error": err})
    raise_for([r["error"] for r in records], "load (load_state_dict of Stateful objects)")
    return (body, *result[1:]) if strict.returns and isinstance(result, tuple) else body


ForeignLoader = Callable[[Any, "str | os.PathLike[str]", StrictHandling], Any]


class ForeignLoaders:
    """The plugin point for other frameworks' checkpoint directories, which ``load`` reads
    in place of ours: (``detect``, ``loader``) pairs, asked in order.

    ``detect(path)`` says whether ``path`` is one; ``loader(template, path, strict)`` does this
    rank's part of the load and returns what ``load`` returns. ``import shardsafe`` registers
    Megatron-Core's torch_dist directories; :attr:`registered` lists the pairs. Higher layers
    (``convert/``) plug in here without the core importing them.
    """

    def __init__(self) -> None:
        self._loaders: list[tuple[Callable[[Any], bool], ForeignLoader]] = []

    def register(self, detect: Callable[[Any], bool], loader: ForeignLoader) -> None:
        if (detect, loader) not in self._loaders:
            self._loaders.append((detect, loader))

    def unregister(self, detect: Callable[[Any], bool], loader: ForeignLoader) -> None:
        if (detect, loader) in self._loaders:
            self._loaders.remove((detect, loader))

    @property
    def registered(self) -> tuple[tuple[Callable[[Any], bool], ForeignLoader], ...]:
        return tuple(self._loaders)

    def find(self, path: Any) -> ForeignLoader | None:
        """The loader of the first pair whose ``detect(path)`` is true, or None (ours)."""
        return next((fn for detect, fn in self._loaders if detect(path)), None)


FOREIGN_LOADERS = ForeignLoaders()
"""The foreign loaders of this process (see :class:`ForeignLoaders`)."""


def register_foreign_loader(detect: Callable[[Any], bool], loader: ForeignLoader) -> None:
    """Let ``load`` read another framework's checkpoint directory in place of ours
    (``FOREIGN_LOADERS.register``)."""
    FOREIGN_LOADERS.register(detect, loader)


class _LoadJob:
    """One rank's load: what it asks for, reading it, and assembling the result."""

    def __init__(
        self,
        template: Any,
        path: str | os.PathLike[str],
        strict: StrictHandling,
        threads: int,
        max_buffer: int,
        direct_io: str | None = None,
        delivered: Deliveries | None = None,
    ) -> None:
        self.path = path
        self.threads = threads
        self.max_buffer = max_buffer
        self.direct_io = direct_io
        self.delivered = delivered
        self.manifest, self.storage = read_manifest(path)
        manifest = self.manifest
        self.where = self.storage.describe(MANIFEST_NAME)
        self.factories: list[tuple[Path, ShardedTensorFactory]] = []
        template, self.statefuls = resolve_stateful(template)
        self.tree = apply_factories_recording(adapt(template), (), self.factories)
        self.split = split_state_dict(self.tree)
        self._common: Any = ABSENT
        # Checkpoints written before plain tensors were stored as tensors hold them in the
        # common state: those are filled from there, in place.
        self.plain_paths = {self.split.tensors[i][0] for i in self.split.replicated}
        absent = [
            (path, st.key)
            for path, st in self.split.tensors
            if path in self.plain_paths and st.key not in manifest.tensors
        ]
        legacy = {
            key for path, key in absent if isinstance(lookup_or(self.common, path), torch.Tensor)
        }
        self.requested = {st.key for _, st in self.split.tensors} | {
            o.unique_key for _, o in self.split.objects
        }
        unexpected = [
            st.key
            for _, st in self.split.tensors
            if st.key not in manifest.tensors and st.key not in legacy
        ]
        unexpected += [
            o.unique_key for _, o in self.split.objects if o.unique_key not in manifest.objects
        ]
        self.unexpected = unexpected
        if unexpected:
            msg = (
                f"{os.fspath(path)}: {len(unexpected)} requested keys are not in the checkpoint: {sorted(set(unexpected))[:10]}"
                + _suggest(unexpected[0], manifest)
            )
            if strict.raises_unexpected:
                raise MissingKeyError(msg)
            if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
                log.warning("%s", msg)
        self.skip = set(unexpected) | legacy
        self.wanted = [st for _, st in self.split.tensors if st.key not in self.skip]
        self.values: dict[int, Any] = {}
        self.request_tensors: list[torch.Tensor] = []
        self.stored_keys = set(manifest.tensors) | set(manifest.objects)

    def request_digests(self) -> list[tuple[str, int]]:
        """``(digest of the request, nbytes)`` per wanted tensor, in order."""
        out = []
        for st in self.wanted:
            box = st.chunk_box
            request = (st.key, str(st.dtype), box.offset, box.shape, st.flat_bounds)
            out.append((request_digest(request), st.numel * st.dtype.itemsize))
        return out

    def read(self, receive: set[int]) -> None:
        """Fill every wanted tensor from storage except those (by index) another rank will send."""
        tasks: list[ReadTask] = []
        finishers: list[Callable[[], None]] = []
        for index, st in enumerate(self.wanted):
            entry = self.manifest.tensors[st.key]
            data, t, fin = _fill_tensor(
                st, entry, max(1, self.max_buffer // st.dtype.itemsize), self.where
            )
            self.values[id(st)] = st.data if st.data is not None else data
            self.request_tensors.append(data)
            if index not in receive:
                tasks.extend(t)
                finishers.append(fin)
        with DataReader(
            self.storage,
            self.manifest.block_bytes,
            self.max_buffer,
            self.direct_io,
            self.delivered,
        ) as reader:
            run_tasks(reader, tasks, self.threads)
        for fin in finishers:
            fin()

    def _fetcher(self, reader: DataReader) -> Callable[[str], bytes]:
        manifest, where = self.manifest, self.where

        def fetch(blob_id: str) -> bytes:
            extent = manifest.blobs.get(blob_id)
            if extent is None:
                raise CorruptCheckpointError(
                    f"{where}: blob {blob_id!r} is referenced but not listed"
                )
            return reader.read_extent(extent, f"blob {blob_id!r}")

        return fetch

    @property
    def common(self) -> Any:
        """The checkpoint's common state, decoded once when first needed."""
        if self._common is ABSENT:
            with DataReader(
                self.storage,
                self.manifest.block_bytes,
                self.max_buffer,
                self.direct_io,
                self.delivered,
            ) as reader:
                fetch = self._fetcher(reader)
                self._common = decode(self.manifest.common, fetch, f"{self.where}: common state")
        return self._common

    def finish(self) -> Any:
        """Decode objects; merge everything into the template's structure; read the stored
        tensors the template has no place for (a fresh optimizer's state) whole."""
        manifest, where = self.manifest, self.where
        with DataReader(
            self.storage, manifest.block_bytes, self.max_buffer, self.direct_io, self.delivered
        ) as reader:
            fetch = self._fetcher(reader)
            for _, o in self.split.objects:
                if o.unique_key in self.skip:
                    continue
                self.values[id(o)] = decode(
                    manifest.objects[o.unique_key].value, fetch, f"{where}: object {o.unique_key!r}"
                )
            plain = {
                path: st
                for path, st in self.split.tensors
                if path in self.plain_paths and st.key not in self.skip
            }
            result = merge_common(self.tree, self.common, self.values, plain, ())
            result = resolve_refs(result, lambda key: self._read_whole(reader, key))
        for fpath, factory in reversed(self.factories):
            result = replace_at(result, fpath, factory.merge_fn(get_at(result, fpath)))
        content = content_metadata_of(manifest, self.where)
        if isinstance(result, dict) and content is not None:
            result.setdefault("content_metadata", content)  # where Megatron-LM reads it
        return result

    def _read_whole(self, reader: DataReader, key: str) -> torch.Tensor:
        entry = self.manifest.tensors.get(key)
        if entry is None:
            raise CorruptCheckpointError(
                f"{self.where}: the common state refers to tensor {key!r}, which is not stored"
            )
        for piece in entry.pieces:  # the shape is backed by bytes on disk before allocating it
            reader.check_extent(piece.extent, f"tensor {key!r}")
        dtype = dtype_from_name(entry.dtype, self.where)
        shape = tuple(entry.shape)
        st = ShardedTensor(key, None, dtype, shape, shape, (0,) * len(shape))
        data, tasks, fin = _fill_tensor(
            st, entry, max(1, self.max_buffer // dtype.itemsize), self.where
        )
        run_tasks(reader, tasks, self.threads)
        fin()
        return data


def _suggest(key: str, manifest: Manifest) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(manifest.tensors) + list(manifest.objects), n=3)
    hint = f" (closest stored keys to {key!r}: {close})" if close else ""
    return hint + "; check the keys, or pass strict='log_unexpected' to load the rest"


def load_content_metadata(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``content_metadata`` given to ``save``, without reading any tensor."""
    manifest, storage = read_manifest(path)
    return content_metadata_of(manifest, storage.describe(MANIFEST_NAME))


def content_metadata_of(manifest: Manifest, where: str) -> dict[str, Any] | None:
    """The ``content_metadata`` saved with ``manifest`` exactly as given (None if none): plain
    JSON, or the encoded value of one JSON would not give back (tuples, int keys...)."""
    user = manifest.user_metadata
    if "content_metadata_encoded" in user:
        value = decode_inline(user["content_metadata_encoded"], f"{where}: content_metadata")
        if not isinstance(value, dict):
            raise CorruptCheckpointError(
                f"{where}: content_metadata decodes to a {type(value).__name__}, not a dict"
            )
        return value
    value = user.get("content_metadata")
    return dict(value) if isinstance(value, dict) else None


def files_to_read(template: Any, manifest: Manifest) -> set[str]:
    """The data files a load of ``template`` reads from a checkpoint with ``manifest``.

    At file granularity and never fewer than the load reads: the files of every stored piece
    that meets a requested box, of every object requested, of the common state's blobs and of
    the tensors it refers to. A restore from copies spread over hosts fetches these first.
    """
    tree = apply_factories_recording(adapt(resolve_stateful(template)[0]), (), [])
    split = split_state_dict(tree)
    files: set[str] = set()
    for _, st in split.tensors:
        entry = manifest.tensors.get(st.key)
        if entry is None:
            continue
        wanted = st.chunk_box
        for piece in entry.pieces:
            try:
                meets = intersect(piece.box, wanted) is not None
            except ValueError:  # a layout this template cannot meet: the load reports it
                meets = True
            if meets:
                files.add(piece.extent.file)
    nodes = [manifest.common] + [
        manifest.objects[o.unique_key].value
        for _, o in split.objects
        if o.unique_key in manifest.objects
    ]
    refs: set[str] = set()
    strings: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$tensor_ref")
            if isinstance(ref, str) and len(node) == 1:
                refs.add(ref)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            strings.add(node)

    for node in nodes:
        walk(node)
    for key in refs:
        entry = manifest.tensors.get(key)
        if entry is not None:
            files.update(p.extent.file for p in entry.pieces)
    files.update(e.file for bid, e in manifest.blobs.items() if bid in strings)
    return files


def in_place_deliveries(
    template: Any, manifest: Manifest, files: set[str], max_buffer: int = DEFAULT_MAX_BUFFER
) -> Deliveries:
    """Where a load of ``template`` reads bytes of ``files`` straight into a tensor: those
    spans, for a restore's copy round to put them there as they arrive
    (:mod:`shardsafe.delivery`).

    The same planning the load does, without touching anything: a tensor the load reads
    through a buffer (another dtype, a strided region, a shape the checkpoint does not hold,
    a fresh tensor the template does not hand in) has no span, and its bytes go through the
    file. The load verifies every byte it takes from a span, as from a file.
    """
    tree = apply_factories_recording(adapt(resolve_stateful(template)[0]), (), [])
    out = Deliveries()
    for _, st in split_state_dict(tree).tensors:
        entry = manifest.tensors.get(st.key)
        if entry is None or st.data is None or tuple(entry.shape) != st.global_shape:
            continue
        if dtype_from_name(entry.dtype, MANIFEST_NAME) != st.dtype:
            continue
        data = st.data.detach()
        if st.flattened_range is not None and not data.is_contiguous():
            continue  # the load reads into a contiguous copy of its own
        max_elems = max(1, max_buffer // st.dtype.itemsize)
        tasks, _ = plan_reads(st.key, entry.pieces, _targets(st, data), st.dtype, max_elems)
        for task in tasks:
            extent = task.piece.extent
            if extent.file not in files:
                continue
            view = in_place(task, manifest.block_bytes)
            if view is not None:
                out.add(extent.file, extent.byte_offset + span_of(task)[0], view)
    return out
