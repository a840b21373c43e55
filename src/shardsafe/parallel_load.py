"""Fully parallel load: replicated requests are read once and sent to the other replicas.

When several ranks request exactly the same piece (data-parallel replicas of a weight),
one of them reads it from storage and sends it to the others over the process group.
Readers are chosen like writers at save time: biggest pieces first, to the requesting rank
with the fewest bytes so far. Whether that beats every rank reading for itself depends on
the storage and the interconnect; :func:`should_share` holds the measured heuristic.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from .dist import Comm
from .errors import CheckpointError

#: below this many replicated bytes the extra collectives cost more than they save
MIN_SHARED_BYTES = 64 << 20

Request = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, int] | None]
"""(key, dtype, chunk offset, chunk shape, flat range): identical tuples are the same piece."""


@dataclass(frozen=True)
class SharedPiece:
    """A request held by several ranks: ``reader`` reads it, the others receive it."""

    reader: int
    holders: tuple[tuple[int, int], ...]  # (rank, index in that rank's request list)
    nbytes: int


def assign_readers(requests: Sequence[Sequence[tuple[Request, int]]]) -> list[SharedPiece]:
    """Pure: the shared pieces among every rank's ``(request, nbytes)`` list, with balanced readers."""
    holders: dict[Request, list[tuple[int, int]]] = defaultdict(list)
    sizes: dict[Request, int] = {}
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
    if option is True or option is False:
        return bool(option) and comm.distributed
    if option != "auto":
        raise ValueError(f"fully_parallel must be True, False or 'auto', got {option!r}")
    if not comm.distributed or shared_bytes < MIN_SHARED_BYTES:
        return False
    return tdist.get_backend(comm.group) == "nccl"


def check_devices(
    comm: Comm, shared: Sequence[SharedPiece], tensors: Sequence[torch.Tensor]
) -> None:
    """Every tensor this rank sends or receives must live where the backend moves data from
    (CUDA for NCCL, CPU for gloo); checked before any transfer, so that all ranks can agree
    to fail instead of one raising while its peers wait for its sends."""
    if not comm.distributed:
        return
    backend = str(tdist.get_backend(comm.group))
    wanted = "cuda" if backend == "nccl" else "cpu" if backend == "gloo" else None
    if wanted is None:
        return
    for piece in shared:
        for r, i in piece.holders:
            if r == comm.rank and tensors[i].device.type != wanted:
                raise CheckpointError(
                    f"rank {comm.rank}: a replicated piece's destination is on "
                    f"{tensors[i].device}, but the {backend} process group sends {wanted} "
                    "tensors; load with fully_parallel=False or put the destination there"
                )


def exchange(comm: Comm, shared: Sequence[SharedPiece], tensors: Sequence[torch.Tensor]) -> None:
    """Send each shared piece from its reader to the other holders (``tensors`` by request index)."""
    ops = []
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    for tag, piece in enumerate(shared):
        if comm.rank == piece.reader:
            index = next(i for r, i in piece.holders if r == comm.rank)
            src = tensors[index].contiguous()
            for rank in sorted({r for r, _ in piece.holders if r != comm.rank}):
                ops.append(tdist.isend(src, dst=comm.global_rank(rank), group=comm.group, tag=tag))
            for r, i in piece.holders:  # the same piece requested twice on the reader
                if r == comm.rank and i != index:
                    tensors[i].copy_(tensors[index])
            continue
        mine = [i for r, i in piece.holders if r == comm.rank]
        if not mine:
            continue
        dst = tensors[mine[0]]
        buf = (
            dst
            if dst.is_contiguous()
            else torch.empty_like(dst, memory_format=torch.contiguous_format)
        )
        ops.append(tdist.irecv(buf, src=comm.global_rank(piece.reader), group=comm.group, tag=tag))
        pending.append((buf, dst))
        pending.extend((buf, tensors[i]) for i in mine[1:])
    for op in ops:
        if op is not None:
            op.wait()
    for buf, dst in pending:
        if buf is not dst:
            dst.copy_(buf)


def shared_bytes_for(rank: int, shared: Sequence[SharedPiece]) -> int:
    return sum(p.nbytes for p in shared if any(r == rank for r, _ in p.holders))
