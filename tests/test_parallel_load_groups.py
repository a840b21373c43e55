"""Fully parallel load across replica groups: exact data, traffic only among a piece's
holders, and a failure inside the exchange on one rank raised on every rank within seconds."""

import time

import pytest
import torch
from rank_pool import RankPool

import shardsafe
from shardsafe.parallel_load import (
    SharedPiece,
    assign_readers,
    device_problem,
    received,
    request_digest,
    transfers,
)

ST = shardsafe.ShardedTensor
W = torch.arange(66 * 48, dtype=torch.float32).reshape(66, 48)
U = -torch.arange(66 * 10, dtype=torch.float32).reshape(66, 10)
B = torch.arange(48, dtype=torch.float32) / 4


# --------------------------------------------------------------------------- pure logic


def _tp_dp_requests(tp: int, dp: int) -> list[list[tuple[str, int]]]:
    """Each rank's digests for a TP-split weight, DP-replicated, plus a fully replicated bias."""
    out = []
    for rank in range(tp * dp):
        t = rank % tp
        w = ("w", "torch.float32", (t * 8, 0), (8, 4), None)
        b = ("b", "torch.float32", (0,), (4,), None)
        out.append([(request_digest(w), 128), (request_digest(b), 16)])
    return out


def test_operations_stay_among_the_holders_and_match_across_ranks():
    requests = _tp_dp_requests(tp=2, dp=4)
    shared = assign_readers(requests)
    assert len(shared) == 3  # two halves of w, each held by its 4 replicas; b held by all 8
    sends, recvs = set(), set()
    for rank in range(8):
        for kind, peer, tag, index in transfers(rank, shared):
            holders = {r for r, _ in shared[tag].holders}
            assert (rank, index) in shared[tag].holders and peer in holders and peer != rank
            if shared[tag].nbytes == 128:  # a half of w: its replica group shares one TP rank
                assert peer % 2 == rank % 2
            (sends if kind == "send" else recvs).add(
                (rank, peer, tag) if kind == "send" else (peer, rank, tag)
            )
    assert sends == recvs  # every send has its receive, nothing more
    assert len(sends) == 3 + 3 + 7  # one read per piece, sent to every other holder


def test_received_pieces_are_not_read_but_a_readers_duplicates_are_copied():
    shared = [SharedPiece(0, ((0, 2), (1, 0), (0, 5)), 64)]
    assert received(0, shared) == {5}  # reads index 2 once, copies it into 5
    assert received(1, shared) == {0}
    assert received(2, shared) == set()


def test_requests_digest_equal_only_when_equal():
    a = ("w", "torch.float32", (0, 0), (8, 4), None)
    assert request_digest(a) == request_digest(("w", "torch.float32", (0, 0), (8, 4), None))
    for other in [
        ("w", "torch.bfloat16", (0, 0), (8, 4), None),
        ("w", "torch.float32", (8, 0), (8, 4), None),
        ("w", "torch.float32", (0, 0), (8, 4), (0, 16)),
        ("v", "torch.float32", (0, 0), (8, 4), None),
    ]:
        assert request_digest(other) != request_digest(a)


def test_devices_are_checked_for_the_backend_on_every_holder():
    shared = [SharedPiece(0, ((0, 0), (1, 0)), 64)]
    cpu, cuda, meta = torch.device("cpu"), torch.device("cuda", 0), torch.device("meta")
    message = device_problem("nccl", 1, shared, [cpu])
    assert message is not None and "rank 1" in message and "nccl" in message
    assert device_problem("nccl", 0, shared, [cpu]) is not None  # the reader too
    assert device_problem("nccl", 1, shared, [cuda]) is None
    assert device_problem("gloo", 1, shared, [cuda]) is not None
    assert device_problem("gloo", 1, shared, [meta]) is not None
    assert device_problem("gloo", 1, shared, [cpu]) is None
    assert device_problem("nccl", 2, shared, [cpu]) is None  # holds nothing shared


# --------------------------------------------------------------------------- four ranks


@pytest.fixture(scope="module")
def pool():
    p = RankPool(4)
    yield p
    p.close()


def _save_tp2_dp2(rank, world, path):
    tp, dp = rank % 2, rank // 2
    rows = slice(tp * 33, (tp + 1) * 33)
    shardsafe.save(
        {
            "w": ST.from_rank_offsets("w", W[rows].clone(), (0, tp, 2), replica_id=dp),
            "u": ST.from_rank_offsets("u", U[rows].clone(), (0, tp, 2), replica_id=dp),
            "b": ST.from_rank_offsets("b", B.clone(), replica_id=rank),
        },
        path,
    )


class _Recorder:
    """Counts the elements each key reads from storage and the operations each rank posts."""

    def __enter__(self):
        from shardsafe import loading, parallel_load

        self.reads: dict[str, int] = {}
        self.ops: list[tuple[str, int, int]] = []
        self._run_tasks, self._post = loading.run_tasks, parallel_load._post

        def run_tasks(reader, tasks, threads):
            for task in tasks:
                self.reads[task.key] = self.reads.get(task.key, 0) + task.region.numel
            return self._run_tasks(reader, tasks, threads)

        def post(comm, kind, peer, tag, buf):
            self.ops.append((kind, comm.global_rank(peer), buf.numel()))
            return self._post(comm, kind, peer, tag, buf)

        loading.run_tasks, parallel_load._post = run_tasks, post
        return self

    def __exit__(self, *exc):
        from shardsafe import loading, parallel_load

        loading.run_tasks, parallel_load._post = self._run_tasks, self._post


def _strided(n: int) -> torch.Tensor:
    return torch.zeros(n, 3)[:, 1]  # a non-contiguous destination: received through a buffer


def _load_tp2_dp2(rank, world, path):
    tp, dp = rank % 2, rank // 2
    rows = slice(tp * 33, (tp + 1) * 33)
    w = torch.nn.Parameter(torch.zeros(33, 48))
    u, b = torch.zeros(33, 10), _strided(48)
    template = {
        "w": ST.from_rank_offsets("w", w, (0, tp, 2), replica_id=dp),
        "u": ST.from_rank_offsets("u", u, (0, tp, 2), replica_id=dp),
        "b": ST.from_rank_offsets("b", b, replica_id=rank),
    }
    with _Recorder() as rec:
        out = shardsafe.load(template, path, fully_parallel=True)
    assert out["w"] is w and w.requires_grad
    assert torch.equal(w.detach(), W[rows]) and torch.equal(u, U[rows]) and torch.equal(b, B)
    return rec.reads, rec.ops


@pytest.mark.timeout(300)
def test_dp_replicas_in_two_groups_load_exactly_reading_each_piece_once(pool, tmp_path):
    path = str(tmp_path / "c")
    pool.run(_save_tp2_dp2, path)
    results = pool.run(_load_tp2_dp2, path)
    reads = [r for r, _ in results]
    for key, half in (("w", 33 * 48), ("u", 33 * 10)):
        for group in ((0, 2), (1, 3)):  # the replicas of one TP rank
            assert sorted(reads[r].get(key, 0) for r in group) == [0, half]
    assert sum(r.get("b", 0) for r in reads) == 48  # held by all four, read by one
    for rank, (_, ops) in enumerate(results):
        for kind, peer, numel in ops:
            if numel != 48:  # w and u move only within the replica group of this TP rank
                assert peer % 2 == rank % 2, (rank, kind, peer, numel)
    assert sum(len(ops) for _, ops in results) == 2 * (2 + 2 + 3)  # each send has one receive


def _model_state(rank, world, path, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    if seed == 0:  # a fresh model: loads what seed 1 saved
        for p in model.parameters():
            torch.nn.init.zeros_(p)
        with _Recorder() as rec:
            shardsafe.load(model.state_dict(), path, fully_parallel=True)
        torch.manual_seed(1)
        want = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
        ).state_dict()
        for key, value in model.state_dict().items():
            assert torch.equal(value, want[key]), key
        assert all(p.requires_grad for p in model.parameters())
        return rec.reads
    shardsafe.save(model.state_dict(), path)
    return None


@pytest.mark.timeout(300)
def test_a_replicated_model_state_dict_is_read_once_and_sent(pool, tmp_path):
    path = str(tmp_path / "c")
    pool.run(_model_state, path, 1)
    reads = pool.run(_model_state, path, 0)
    sizes = {"0.weight": 16 * 32, "0.bias": 32, "2.weight": 32 * 8, "2.bias": 8}
    for key, numel in sizes.items():
        assert sum(r.get(key, 0) for r in reads) == numel, key  # one rank read it


def _load_2_to_3(rank, world, path):
    import torch.distributed as tdist

    group = tdist.new_group([1, 2, 3])  # every rank makes it; rank 0 takes no part in the load
    if rank == 0:
        return None
    g = rank - 1
    half = 0 if g < 2 else 1  # two ranks share the first half of w, one loads the second
    u3 = torch.zeros(22, 10)
    w = torch.zeros(33, 48)
    flat = torch.zeros(100)  # ranks 1 and 2 ask for the same flat range of u's first half
    start = 40 if g < 2 else 150
    b, b_again = _strided(48), torch.zeros(48)
    template = {
        "u": ST.from_rank_offsets("u", u3, (0, g, 3)),
        "w": ST.from_rank_offsets("w", w, (0, half, 2), replica_id=g if g < 2 else 0),
        "u_flat": ST.from_rank_offsets_flat(
            "u", flat, (33, 10), (0, 0, 2), flattened_range=slice(start, start + 100)
        ),
        "b": ST.from_rank_offsets("b", b, replica_id=g),
        "b_again": ST.from_rank_offsets("b", b_again, replica_id=g),  # the same piece twice
    }
    with _Recorder() as rec:
        shardsafe.load(template, path, process_group=group, fully_parallel=True)
    assert torch.equal(u3, U[g * 22 : (g + 1) * 22])
    assert torch.equal(w, W[half * 33 : (half + 1) * 33])
    assert torch.equal(flat, U[:33].reshape(-1)[start : start + 100])
    assert torch.equal(b, B) and torch.equal(b_again, B)
    return rec.reads


@pytest.mark.timeout(300)
def test_two_way_layout_loads_into_three_ranks_of_a_subgroup_exactly(pool, tmp_path):
    path = str(tmp_path / "c")
    pool.run(_save_tp2_dp2, path)
    reads = pool.run(_load_2_to_3, path)[1:]
    assert sorted(r.get("w", 0) for r in reads) == [0, 33 * 48, 33 * 48]  # one half read once
    assert sum(r.get("b", 0) for r in reads) == 48


def _load_failing(rank, world, path, where):
    """Inject one failure on one rank inside the exchange, then load again without it."""
    from shardsafe import parallel_load

    original_post, original_buffer = parallel_load._post, parallel_load._receive_buffer
    calls = [0]

    def post_fails_once(*args):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected: the link went down")
        return original_post(*args)

    def buffer_fails(dst):
        raise RuntimeError("injected: out of memory for a receive buffer")

    if rank == 1 and where == "transfer":
        parallel_load._post = post_fails_once
    if rank == 3 and where == "prepare":
        parallel_load._receive_buffer = buffer_fails
    t0 = time.monotonic()
    try:
        _load_tp2_dp2(rank, world, path)
        message = None
    except shardsafe.CheckpointError as e:
        message = f"{type(e).__name__}: {e}"
    finally:
        parallel_load._post, parallel_load._receive_buffer = original_post, original_buffer
    seconds = time.monotonic() - t0
    _load_tp2_dp2(rank, world, path)  # nothing left pending: the group still works
    return message, seconds


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("where", "rank"), [("prepare", 3), ("transfer", 1)])
def test_a_failure_inside_the_exchange_raises_on_every_rank(pool, tmp_path, where, rank):
    path = str(tmp_path / "c")
    pool.run(_save_tp2_dp2, path)
    results = pool.run(_load_failing, path, where, timeout=120)
    for message, seconds in results:
        assert message is not None and f"rank {rank}" in message and "injected" in message
        assert seconds < 30, seconds  # agreed on, not a peer left waiting for a send
    assert len({m for m, _ in results}) == 1  # the same error on every rank


def test_an_unknown_fully_parallel_value_raises_instead_of_being_ignored(tmp_path):
    path = tmp_path / "c"
    shardsafe.save({"b": ST.from_rank_offsets("b", B.clone())}, path)
    template = {"b": ST.from_rank_offsets("b", torch.zeros(48))}
    with pytest.raises(ValueError, match="fully_parallel must be True, False or 'auto'"):
        shardsafe.load(template, path, fully_parallel="yes")
    assert torch.equal(shardsafe.load(template, path, fully_parallel=True)["b"], B)
