"""Whole files sent between ranks over a process group, in bounded chunks.

Every pair (sender, receiver) has one byte stream: its files back to back, in the order of
the copy list, which both ends know (names and sizes) before anything moves. Streams advance
in rounds: in round j every rank posts the j-th chunk of each stream it sends and receives,
non-blocking, reads round j+1's chunks from disk while they move, then waits for all of them,
posts round j+1 and writes round j's chunks to disk while round j+1 moves: reading, sending
and writing overlap. No rank waits for a message that its peer posts only after a wait of
its own, so there is no deadlock, and the memory in flight is two chunks per stream each way.
A rank that cannot read or write keeps taking part in every round (sending
zeros, dropping what it receives) and reports its error afterwards, so a local failure
never leaves a peer blocked. A file name that is not a checkpoint file's
(:func:`shardsafe.peers.check_offered`) is never opened on either end: its bytes still move
(zeros from the sender, dropped by the receiver) and both report the refusal.

A receiver given a :class:`shardsafe.checksum.StreamCheck` for a copy feeds it the copy's bytes
as they arrive, so that the copy is checked against its sender's block checksums without
being read back from disk. A receiver given :class:`shardsafe.delivery.Deliveries` puts the
bytes of the files they deliver whole straight into memory and writes no file for them: a
restore's load takes them from there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO, cast

import torch
import torch.distributed as tdist

from .checksum import StreamCheck
from .codec import array_view
from .delivery import Deliveries
from .errors import CheckpointError
from .peers import Copy, check_offered
from .storage import Storage

log = logging.getLogger("shardsafe")

CHUNK_BYTES = 4 << 20


def _streams(
    copies: Sequence[Copy], rank: int
) -> tuple[dict[int, list[Copy]], dict[int, list[Copy]]]:
    outgoing: dict[int, list[Copy]] = {}
    incoming: dict[int, list[Copy]] = {}
    for c in copies:
        if c.src == rank and c.dst != rank:
            outgoing.setdefault(c.dst, []).append(c)
        elif c.dst == rank and c.src != rank:
            incoming.setdefault(c.src, []).append(c)
    return outgoing, incoming


def _segments(files: Sequence[Copy], start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """``(file index, offset in file, offset in chunk, length)`` covering stream bytes [start, stop)."""
    out = []
    base = 0
    for i, c in enumerate(files):
        lo, hi = max(start, base), min(stop, base + c.nbytes)
        if lo < hi:
            out.append((i, lo - base, lo - start, hi - lo))
        base += c.nbytes
        if base >= stop:
            break
    return out


def exchange_files(
    group: Any,
    rank: int,
    global_rank: Callable[[int], int],
    copies: Sequence[Copy],
    source: Storage,
    source_rel: Callable[[str], str],
    target: Storage,
    target_rel: Callable[[str], str],
    chunk_bytes: int = CHUNK_BYTES,
    checks: Mapping[Copy, StreamCheck] | None = None,
    deliveries: Deliveries | None = None,
) -> list[str]:
    """Send the copies this rank is the source of and receive those it is the destination of.

    Files are read from ``source`` at ``source_rel(name)`` and written (created, fsynced) to
    ``target`` at ``target_rel(name)``. Each received copy that has an entry in ``checks`` is
    fed to it, in file order, as it arrives (whether or not its write succeeds); the caller
    reads the verdict from it afterwards. The bytes of received files that ``deliveries`` take
    go into their memory, and no file is written for them. Returns this rank's errors (empty on success); it
    never raises for an I/O failure or a refused name, so that every rank finishes every round.
    """
    outgoing, incoming = _streams(copies, rank)
    errors: list[str] = []
    refused: set[str] = set()  # names that would be paths outside the checkpoint: never opened
    for c in copies:
        if rank in (c.src, c.dst) and c.src != c.dst and c.name not in refused:
            try:
                check_offered(c.name, f"the copy of a file from rank {c.src} to rank {c.dst}")
            except CheckpointError as e:
                refused.add(c.name)
                errors.append(str(e))
    # a peer may be both a destination and a source: each of its two streams has its own length
    out_len = {peer: sum(c.nbytes for c in fs) for peer, fs in outgoing.items()}
    in_len = {peer: sum(c.nbytes for c in fs) for peer, fs in incoming.items()}
    rounds = max((-(-n // chunk_bytes) for n in (*out_len.values(), *in_len.values())), default=0)
    readers: dict[tuple[int, int], Any] = {}
    with contextlib.ExitStack() as stack:
        writers: dict[tuple[int, int], BinaryIO | None] = {}

        def writer(src: int, index: int) -> BinaryIO | None:
            key = (src, index)
            if key not in writers:
                c = incoming[src][index]
                if c.name in refused:
                    writers[key] = None
                    return None
                try:
                    writers[key] = stack.enter_context(target.open_write(target_rel(c.name)))
                except Exception as e:
                    errors.append(f"cannot create {target.describe(target_rel(c.name))}: {e}")
                    writers[key] = None
            return writers[key]

        def reader(dst: int, index: int) -> Any:
            key = (dst, index)
            if key not in readers:
                c = outgoing[dst][index]
                readers[key] = source.open_read(source_rel(c.name))
            return readers[key]

        Posted = tuple[list[Any], list[tuple[int, torch.Tensor, int]]]
        # two buffers per stream and way, by round parity, used again and again: a fresh one
        # per round costs a page fault per page (32 MiB into fresh 4 MiB tensors: 11 ms here,
        # into reused ones 1.6 ms)
        buffers: dict[tuple[bool, int, int], torch.Tensor] = {}

        def buffer(sending: bool, peer: int, j: int, nbytes: int) -> torch.Tensor:
            key = (sending, peer, j % 2)
            if key not in buffers:
                length = (out_len if sending else in_len)[peer]
                buffers[key] = torch.empty(min(chunk_bytes, length), dtype=torch.uint8)
            return buffers[key][:nbytes]

        def read(j: int) -> list[tuple[int, torch.Tensor]]:
            """Round ``j``'s outgoing chunks, read from the files."""
            start = j * chunk_bytes
            chunks = []
            for dst, files in sorted(outgoing.items()):
                stop = min(start + chunk_bytes, out_len[dst])
                if stop <= start:
                    continue
                # not zeroed: every byte is read from a file, or zeroed where none is (a refused
                # name, a failed read), so no stale memory ever leaves this process
                buf = buffer(True, dst, j, stop - start)
                view = array_view(buf.numpy())
                for i, off, at, n in _segments(files, start, stop):
                    if files[i].name in refused:
                        view[at : at + n] = bytes(n)  # zeros: the receiver drops them
                        continue
                    try:
                        reader(dst, i).read_into(off, view[at : at + n])
                    except Exception as e:
                        view[at : at + n] = bytes(n)
                        name = files[i].name
                        msg = f"cannot read {source.describe(source_rel(name))}: {e}"
                        if msg not in errors:
                            errors.append(msg)
                chunks.append((dst, buf))
            return chunks

        def post(j: int, chunks: list[tuple[int, torch.Tensor]]) -> Posted:
            """Send round ``j``'s chunks (read ahead), and post its receives (tagged by round
            parity: at most two rounds of a pair are in flight)."""
            start = j * chunk_bytes
            ops = [
                tdist.isend(buf, dst=global_rank(dst), group=group, tag=j % 2)
                for dst, buf in chunks
            ]
            received: list[tuple[int, torch.Tensor, int]] = []
            for src in sorted(incoming):
                stop = min(start + chunk_bytes, in_len[src])
                if stop <= start:
                    continue
                buf = buffer(False, src, j, stop - start)
                ops.append(tdist.irecv(buf, src=global_rank(src), group=group, tag=j % 2))
                received.append((src, buf, stop))
            return ops, received

        def store(j: int, received: list[tuple[int, torch.Tensor, int]]) -> None:
            start = j * chunk_bytes
            for src, buf, stop in received:
                view = array_view(buf.numpy())
                for i, off, at, n in _segments(incoming[src], start, stop):
                    check = checks.get(incoming[src][i]) if checks else None
                    if check is not None and incoming[src][i].name not in refused:
                        check.feed(off, view[at : at + n])
                    name = incoming[src][i].name
                    if deliveries is not None and name in deliveries.files:
                        if name not in refused and deliveries.land(name, off, view[at : at + n]):
                            errors.append(f"bytes of {name} had nowhere to go")  # never: whole
                        continue
                    f = writer(src, i)
                    if f is None:
                        continue
                    try:
                        f.write(view[at : at + n])
                    except Exception as e:
                        errors.append(f"cannot write {target_rel(incoming[src][i].name)}: {e}")
                        writers[(src, i)] = None

        try:
            # round j+1 is read from disk while round j moves over the network, and moves
            # while round j is written to disk
            pending = post(0, read(0)) if rounds else None
            for j in range(rounds):
                assert pending is not None
                ops, received = pending
                ahead = read(j + 1) if j + 1 < rounds else []
                for op in ops:
                    cast(Any, op).wait()
                pending = post(j + 1, ahead) if j + 1 < rounds else None
                store(j, received)
            # files of length 0 get no round: create them too
            for src, files in incoming.items():
                for i, c in enumerate(files):
                    if c.nbytes == 0:
                        writer(src, i)
        finally:
            for r in readers.values():
                with contextlib.suppress(Exception):
                    r.close()
    return errors
