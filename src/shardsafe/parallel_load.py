"""Fully parallel load: replicated requests are read once and sent to the other replicas.

When several ranks request exactly the same piece (data-parallel replicas of a weight),
one of them reads it from storage and sends it to the others over the process group.
Readers are chosen like writers at save time: biggest pieces first, to the requesting rank
with the fewest bytes so far. Whether that beats every rank reading for itself depends on
the storage and the interconnect; :func:`should_share` holds the measured heuristic.

Who talks to whom. The ranks that hold one piece (its replica group) are only known once
every rank's requests are known, so the requests are gathered once over the load's group;
each is gathered as a 128-bit digest and a size (about 50 bytes a request), not as its key
and box. The tensor bytes move only within a piece's holders: its reader sends to each other
holder. Sub-process-groups per replica group are not made: creating one is itself a
collective over the whole group (and NCCL communicators besides), costlier than the one
gather it would save.

Failing together. Everything a rank can get wrong on its own (destination devices, receive
buffers, contiguous copies of what it sends) happens in :func:`prepare_exchange`, whose
outcome the ranks agree on before any byte moves. :func:`transfer` then only posts and waits
for sends and receives, in the same piece order on every rank; if posting one fails on a
rank, that rank still posts the same operation on a scratch buffer, so that its peers are
never left waiting for it, and reports the error, which the load agrees on after the exchange.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from .dist import Comm
from .errors import CheckpointError

#: below this many replicated bytes the extra collectives cost more than they save
MIN_SHARED_BYTES = 64 << 20

Request = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, int] | None]
"""(key, dtype, chunk offset, chunk shape, flat range): identical tuples are the same piece."""


def request_digest(request: Request) -> str:
    """A 128-bit digest of ``request``, what ranks gather to find identical requests."""
    raw = json.dumps(request, separators=(",", ":")).encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass(frozen=True)
class SharedPiece:
    """A request held by several ranks: ``reader`` reads it, the others receive it."""

    reader: int
    holders: tuple[tuple[int, int], ...]  # (rank, index in that rank's request list)
    nbytes: int


def assign_readers(requests: Sequence[Sequence[tuple[Hashable, int]]]) -> list[SharedPiece]:
    """Pure: the shared pieces among every rank's ``(request, nbytes)`` list, with balanced readers.

    A request is anything hashable that is equal on ranks asking for the same piece (a
    :data:`Request` or its :func:`request_digest`).
    """
    holders: dict[Hashable, list[tuple[int, int]]] = defaultdict(list)
    sizes: dict[Hashable, int] = {}
    for rank, reqs in enumerate(requests):
        for index, (req, nbytes) in enumerate(reqs):
            holders[req].append((rank, index))
            sizes[req] = nbytes
    loads = [0] * len(requests)
    shared = []
    for req in sorted(
        (r for r, h in holders.items() if len({rank for rank, _ in h}) > 1),
        key=lambda r: (-sizes[r], repr(r)),
    ):
        ranks = sorted({rank for rank, _ in holders[req]})
        reader = min(ranks, key=lambda r: (loads[r], r))
        loads[reader] += sizes[req]
        shared.append(SharedPiece(reader, tuple(holders[req]), sizes[req]))
    return shared


def should_share(comm: Comm, shared_bytes: int, option: bool | str) -> bool:
    """``True``/``False`` force it; ``"auto"`` shares only over NCCL and for enough bytes.

    Measured on CPU with gloo over loopback (benchmarks/bench_parallel_load.py): sending a
    tensor to another process is slower than reading it again from the page cache, so on
    gloo every rank reads for itself. Over NCCL, GPU-to-GPU links outpace shared storage.
    """
    check_option(option)
    if option is True or option is False:
        return bool(option) and comm.distributed
    if not comm.distributed or shared_bytes < MIN_SHARED_BYTES:
        return False
    return tdist.get_backend(comm.group) == "nccl"


def check_option(option: object) -> None:
    if not (option is True or option is False or option == "auto"):
        raise ValueError(f"fully_parallel must be True, False or 'auto', got {option!r}")


Op = tuple[str, int, int, int]
"""(``"send"`` or ``"recv"``, peer group rank, piece number, request index on this rank)."""


def transfers(rank: int, shared: Sequence[SharedPiece]) -> list[Op]:
    """Pure: this rank's sends and receives, in piece order (the same order on every rank).

    The reader of a piece sends it to every other rank holding it, and nobody else; a holder
    receives it once from the reader, whatever many times it requested it.
    """
    ops: list[Op] = []
    for tag, piece in enumerate(shared):
        mine = [i for r, i in piece.holders if r == rank]
        if not mine:
            continue
        if rank == piece.reader:
            ops.extend(
                ("send", peer, tag, mine[0])
                for peer in sorted({r for r, _ in piece.holders if r != rank})
            )
        else:
            ops.append(("recv", piece.reader, tag, mine[0]))
    return ops


def device_problem(
    backend: str, rank: int, shared: Sequence[SharedPiece], devices: Sequence[torch.device]
) -> str | None:
    """Pure: why this rank cannot send or receive its shared pieces (``devices`` by request
    index) over ``backend``, or None: NCCL moves CUDA tensors, gloo CPU tensors."""
    wanted = "cuda" if backend == "nccl" else "cpu" if backend == "gloo" else None
    if wanted is None:
        return None
    for piece in shared:
        for r, i in piece.holders:
            if r == rank and devices[i].type != wanted:
                return (
                    f"rank {rank}: a replicated piece's destination is on {devices[i]}, but the "
                    f"{backend} process group sends {wanted} tensors; load with "
                    "fully_parallel=False or put the destination there"
                )
    return None


def check_devices(
    comm: Comm, shared: Sequence[SharedPiece], tensors: Sequence[torch.Tensor]
) -> None:
    """Raise if a tensor this rank sends or receives lives where the backend cannot move it."""
    if not comm.distributed:
        return
    problem = device_problem(
        str(tdist.get_backend(comm.group)), comm.rank, shared, [t.device for t in tensors]
    )
    if problem is not None:
        raise CheckpointError(problem)


@dataclass
class PreparedExchange:
    """What :func:`transfer` moves: one buffer per operation, and the copies to make after."""

    ops: list[Op]
    buffers: list[torch.Tensor]
    # (buffer, destination) copies once received; the same piece requested twice included
    after: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def prepare_exchange(
    comm: Comm, shared: Sequence[SharedPiece], tensors: Sequence[torch.Tensor]
) -> PreparedExchange:
    """Check devices and make every buffer this rank sends from or receives into (``tensors``
    by request index, the readers' already filled): all that can fail on one rank alone."""
    check_devices(comm, shared, tensors)
    ops = transfers(comm.rank, shared)
    buffers: list[torch.Tensor] = []
    after: list[tuple[torch.Tensor, torch.Tensor]] = []
    sources: dict[int, torch.Tensor] = {}
    for kind, _, tag, index in ops:
        dst = tensors[index]
        if kind == "send":
            if tag not in sources:
                sources[tag] = dst.contiguous()
            buffers.append(sources[tag])
        else:
            buf = dst if dst.is_contiguous() else _receive_buffer(dst)
            buffers.append(buf)
            if buf is not dst:
                after.append((buf, dst))
    for piece in shared:  # the same piece requested more than once here
        mine = [i for r, i in piece.holders if r == comm.rank]
        after.extend((tensors[mine[0]], tensors[i]) for i in mine[1:])
    return PreparedExchange(ops, buffers, after)


def received(rank: int, shared: Sequence[SharedPiece]) -> set[int]:
    """Pure: the request indices this rank gets from the exchange instead of from storage
    (every shared one but the first copy of each piece this rank reads)."""
    out: set[int] = set()
    for piece in shared:
        mine = [i for r, i in piece.holders if r == rank]
        out.update(mine[1:] if piece.reader == rank else mine)
    return out


def _receive_buffer(dst: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(dst, memory_format=torch.contiguous_format)


def transfer(comm: Comm, prepared: PreparedExchange) -> None:
    """Post every send and receive, wait for them, then fill the destinations.

    Raises the first error after every operation was posted and waited for: an operation
    that failed to post is posted again on a scratch buffer of the same shape, so the peer
    expecting it is not left waiting.
    """
    works = []
    failure: BaseException | None = None
    for (kind, peer, tag, _), buf in zip(prepared.ops, prepared.buffers, strict=True):
        try:
            works.append(_post(comm, kind, peer, tag, buf))
        except Exception as e:
            failure = failure or e
            try:
                works.append(_post(comm, kind, peer, tag, torch.zeros_like(buf)))
            except Exception:  # the process group itself is broken: its timeout applies
                works.append(None)
    for work in works:
        try:
            if work is not None:
                work.wait()
        except Exception as e:
            failure = failure or e
    if failure is not None:
        raise CheckpointError(
            f"rank {comm.rank}: sending replicated pieces failed ({type(failure).__name__}: "
            f"{failure}); load with fully_parallel=False to have every rank read for itself"
        ) from failure
    for buf, dst in prepared.after:
        dst.copy_(buf)


def _post(comm: Comm, kind: str, peer: int, tag: int, buf: torch.Tensor) -> Any:
    fn = tdist.isend if kind == "send" else tdist.irecv
    return fn(buf, comm.global_rank(peer), group=comm.group, tag=tag)


def shared_bytes_for(rank: int, shared: Sequence[SharedPiece]) -> int:
    return sum(p.nbytes for p in shared if any(r == rank for r, _ in p.holders))
