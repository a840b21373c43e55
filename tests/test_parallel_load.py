"""Fully parallel load: a piece requested by several ranks is read once and sent to the others."""

import pytest
import torch
from distributed import run_ranks

import shardsafe
from shardsafe.parallel_load import assign_readers


def test_readers_are_balanced_and_deterministic():
    req = lambda key, n: ((key, "torch.float32", (0,), (n,), None), n * 4)  # noqa: E731
    ranks = [
        [req("a", 100), req("b", 60), req("c", 50)],
        [req("a", 100), req("b", 60)],
        [req("a", 100), req("c", 50)],
    ]
    shared = assign_readers(ranks)
    assert [p.nbytes for p in shared] == [400, 240, 200]
    readers = [p.reader for p in shared]
    assert readers == [0, 1, 2]  # biggest first, each to the least-loaded requester
    assert assign_readers(ranks) == shared


def _load(rank, world, path, fully_parallel):
    from shardsafe import engine

    counted = [0]
    original = engine.DataReader._read

    def counting(self, extent, start, out, what):
        counted[0] += len(out)
        return original(self, extent, start, out, what)

    engine.DataReader._read = counting
    w = torch.zeros(256, 64)
    u = torch.zeros(128, 64)
    template = {
        "w": shardsafe.ShardedTensor.from_rank_offsets(
            "w", w, replica_id=rank
        ),  # same piece on both ranks
        "u": shardsafe.ShardedTensor.from_rank_offsets(
            "u", u, (0, rank, 2)
        ),  # a different piece per rank
    }
    out = shardsafe.load(template, path, fully_parallel=fully_parallel)
    want_w = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)
    want_u = -torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)[
        rank * 128 : (rank + 1) * 128
    ]
    assert torch.equal(out["w"], want_w) and out["w"] is w
    assert torch.equal(out["u"], want_u)
    return counted[0]


@pytest.mark.timeout(180)
def test_replicated_pieces_are_read_once(tmp_path):
    path = tmp_path / "c"
    shardsafe.save(
        {
            "w": shardsafe.ShardedTensor.from_rank_offsets(
                "w", torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)
            ),
            "u": shardsafe.ShardedTensor.from_rank_offsets(
                "u", -torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)
            ),
        },
        path,
    )
    w_bytes = 256 * 64 * 4
    shared = run_ranks(_load, 2, str(path), True, timeout=150)
    alone = run_ranks(_load, 2, str(path), False, timeout=150)
    # each rank also reads its half of u (rounded up to whole checksum blocks): the same either way
    u_read = alone[0] - w_bytes
    assert alone == [w_bytes + u_read] * 2
    assert sorted(shared) == [u_read, w_bytes + u_read]  # w came from storage once, then was sent


def _load_to_meta(rank, world, path):
    import time

    device = "meta" if rank == 1 else "cpu"
    w = torch.zeros(256, 64, device=device)
    template = {"w": shardsafe.ShardedTensor.from_rank_offsets("w", w, replica_id=rank)}
    t0 = time.monotonic()
    try:
        shardsafe.load(template, path, fully_parallel=True)
    except shardsafe.CheckpointError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.timeout(180)
def test_a_destination_the_backend_cannot_send_to_fails_every_rank(tmp_path):
    path = tmp_path / "c"
    w = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)
    shardsafe.save({"w": shardsafe.ShardedTensor.from_rank_offsets("w", w)}, path)
    results = run_ranks(_load_to_meta, 2, str(path), timeout=150)
    for message, seconds in results:
        assert message is not None and "rank 1" in message, message
        assert "destination is on meta" in message, message
        assert seconds < 30  # agreed on, not a peer left waiting for a send
