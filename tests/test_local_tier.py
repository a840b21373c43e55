"""The node-local tier with copies on peers, on one machine: each "host" is a node id with
its own local root. Training runs on 2 + 2 ranks with local saves every step and persistent
saves every 10; one host is killed mid-save and its local root deleted; a restart with 3 ranks
(one on a fresh host) resumes from the newest *local* step, exactly as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shardsafe import CheckpointManager
from shardsafe.checksum import StreamCheck, block_checksums
from shardsafe.format import Extent
from shardsafe.peers import Copy, complete_steps, plan_copies, replica_peers
from tests.distributed import RankFailure, preload_forkserver, run_ranks
from tests.manifests import sealed
from tests.tierstate import (
    COLS,
    ROWS,
    reference,
    rows_of,
    state_of,
    train_and_save,
    train_step,
)

pytestmark = pytest.mark.timeout(300)


def manager(tmp: str, host: str, **kw: Any) -> CheckpointManager:
    return CheckpointManager(
        f"{tmp}/persistent",
        local_root=f"{tmp}/local/{host}",
        node_id=host,
        local_every=1,
        persistent_every=10,
        replicas=1,
        dead_after=2.0,
        run_id="tiers",  # the tests restore copies of the run made elsewhere
        **kw,
    )


def _train(
    rank: int,
    world: int,
    tmp: str,
    hosts: list[str],
    first: int,
    last: int,
    kill: dict[str, Any] | None,
) -> Any:
    host = hosts[rank]
    mgr = manager(tmp, host)
    per = ROWS // world
    w = torch.zeros(per, COLS, dtype=torch.float64, requires_grad=False)
    m = torch.zeros_like(w)
    state = state_of(rank, world, w, m, 0)
    start = 0
    if first > 1:
        state = mgr.restore(state)
        start = state["step"]
        assert mgr.restored_step == start
    for step in range(start + 1, last + 1):
        train_step(w, m, rows_of(rank, world), step)
        state["step"] = step
        mgr.save(step, state)
        if kill and step == kill["step"]:
            if host == kill["host"]:
                os.kill(os.getpid(), signal.SIGKILL)  # the whole host, mid-save
            try:
                mgr.wait()
            except Exception as e:
                return {"error": str(e)}
            raise AssertionError("the save survived a dead host")
        mgr.wait()
    mgr.close()
    # numpy arrays travel by value (a tensor would be shared by a file descriptor that
    # vanishes with this process)
    return {"step": state["step"], "tier": mgr.restored_tier, "w": w.numpy(), "m": m.numpy()}


def _restore(rank: int, world: int, tmp: str, hosts: list[str]) -> Any:
    mgr = manager(tmp, hosts[rank])
    per = ROWS // world
    w = torch.full((per, COLS), float("nan"), dtype=torch.float64)
    m = torch.full_like(w, float("nan"))
    state = mgr.restore(state_of(rank, world, w, m, 0))
    mgr.close()
    return {
        "step": state["step"],
        "restored": mgr.restored_step,
        "tier": mgr.restored_tier,
        "w": w.numpy(),
        "m": m.numpy(),
    }


def place(run: Path, host: str) -> Path:
    """The directory of the run's local steps on ``host``: ``local/<host>/run-<key>``."""
    (found,) = (run / "local" / host).glob("run-*")
    return found


def check_exact(results: list[dict[str, Any]], step: int) -> None:
    w_ref, m_ref = reference(step)
    world = len(results)
    for rank, r in enumerate(results):
        assert r["step"] == step
        w, m = torch.as_tensor(r["w"]), torch.as_tensor(r["m"])
        assert torch.equal(w, w_ref[rows_of(rank, world)]), f"rank {rank} w differs"
        assert torch.equal(m, m_ref[rows_of(rank, world)]), f"rank {rank} m differs"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """13 committed steps on hosts a (ranks 0, 1) and b (ranks 2, 3); b is killed while
    saving step 14. Persistent steps: 10 only."""
    preload_forkserver("shardsafe")
    tmp = tmp_path_factory.mktemp("tiers")
    hosts = ["a", "a", "b", "b"]
    with pytest.raises(RankFailure) as info:
        run_ranks(
            _train,
            4,
            str(tmp),
            hosts,
            1,
            20,
            {"step": 14, "host": "b"},
            timeout=240,
            start_method="forkserver",
        )
    errors = info.value.errors
    assert sorted(errors) == [2, 3], errors
    return tmp


def fresh_copy(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def test_persistent_and_local_steps_after_training(trained: Path) -> None:
    import subprocess
    import sys

    assert sorted(os.listdir(trained / "persistent")) == ["latest", "step_000000010"]
    for host in ("a", "b"):
        steps = sorted(n for n in os.listdir(place(trained, host)) if n.startswith("step_"))
        assert steps == ["step_000000012", "step_000000013"], (host, steps)
    # every host holds its own ranks' files and a copy of the other host's
    files = sorted(os.listdir(place(trained, "a") / "step_000000013" / "data"))
    assert {f.split("-")[1] for f in files} == {"00000", "00001", "00002", "00003"}
    # a local step is an ordinary checkpoint for the command line
    step = place(trained, "a") / "step_000000013"
    cli = [sys.executable, "-m", "shardsafe"]
    out = subprocess.run([*cli, "inspect", str(step)], capture_output=True, text=True)
    assert out.returncode == 0 and "model.w" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([*cli, "verify", str(step)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    exported = trained / "exported.pt"
    out = subprocess.run(
        [*cli, "convert", str(step), str(exported), "--to", "torch"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    w_ref, m_ref = reference(13)
    plain = torch.load(exported, weights_only=True)
    assert sorted(plain) == ["model.w", "optim.m", "step"], sorted(plain)
    assert torch.equal(plain["model.w"], w_ref) and torch.equal(plain["optim.m"], m_ref)
    exported.unlink()
    # and for PyTorch DCP's load, through shardsafe.dcp.Reader
    import torch.distributed.checkpoint as dcp

    from shardsafe.dcp import Reader

    into = {"model": {"w": torch.zeros_like(w_ref)}, "optim": {"m": torch.zeros_like(m_ref)}}
    dcp.load({**into, "step": 0}, storage_reader=Reader(step), no_dist=True)
    assert torch.equal(into["model"]["w"], w_ref) and torch.equal(into["optim"]["m"], m_ref)


def test_lost_host_resumes_from_newest_local_step_in_new_layout(
    trained: Path, tmp_path: Path
) -> None:
    run = fresh_copy(trained, tmp_path)
    shutil.rmtree(run / "local" / "b")  # host b is gone with its disk
    # restart on 3 ranks: two on host a, one on a fresh host c; train on to step 20
    results = run_ranks(
        _train, 3, str(run), ["a", "a", "c"], 2, 20, None, timeout=240, start_method="forkserver"
    )
    assert all(r["tier"] == "local" for r in results)
    check_exact(results, 20)
    assert (run / "persistent" / "step_000000020" / "manifest.json").exists()


def test_damaged_only_copy_falls_back_a_step(trained: Path, tmp_path: Path, caplog: Any) -> None:
    run = fresh_copy(trained, tmp_path)
    shutil.rmtree(run / "local" / "b")
    # host a holds the only copy of rank 2's files for step 13: flip a byte in one
    data = place(run, "a") / "step_000000013" / "data"
    victim = sorted(
        p for p in data.iterdir() if p.name.startswith("rank_00002") or "00002" in p.name
    )[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    victim.write_bytes(bytes(raw))
    results = run_ranks(
        _restore, 3, str(run), ["a", "a", "c"], timeout=240, start_method="forkserver"
    )
    assert {r["restored"] for r in results} == {12}
    assert all(r["tier"] == "local" for r in results)
    check_exact(results, 12)
    assert (place(run, "a") / ".step_000000013.shardsafe-damaged").exists()


def test_damaged_copy_is_replaced_from_its_other_holder(trained: Path, tmp_path: Path) -> None:
    run = fresh_copy(trained, tmp_path)
    # both hosts survive; host a's replica of one of rank 2's files is corrupt, host b's original is fine
    data = place(run, "a") / "step_000000013" / "data"
    victim = sorted(p for p in data.iterdir() if "00002" in p.name)[0]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0x01
    victim.write_bytes(bytes(raw))
    # rank 2 on host a reads rows 8-11: the bad copy's rows, which host b holds too
    results = run_ranks(
        _restore, 3, str(run), ["a", "b", "a"], timeout=240, start_method="forkserver"
    )
    assert {r["restored"] for r in results} == {13}
    assert all(r["tier"] == "local" for r in results)
    check_exact(results, 13)
    # host a's copy was replaced by host b's intact one
    assert (
        victim.read_bytes()
        == (place(run, "b") / "step_000000013" / "data" / victim.name).read_bytes()
    )


def test_persistent_tier_when_no_local_step_is_complete(trained: Path, tmp_path: Path) -> None:
    run = fresh_copy(trained, tmp_path)
    shutil.rmtree(run / "local")  # every local disk lost
    results = run_ranks(_restore, 2, str(run), ["c", "d"], timeout=240, start_method="forkserver")
    assert {r["restored"] for r in results} == {10}
    assert all(r["tier"] == "persistent" for r in results)
    check_exact(results, 10)


# -- pure planning ----------------------------------------------------------------------------


def test_replica_peers_are_on_other_hosts() -> None:
    hosts = ["a", "a", "b", "b", "c", "c"]
    peers = replica_peers(hosts, 2)
    for rank, targets in enumerate(peers):
        assert len(set(hosts[t] for t in targets)) == 2
        assert hosts[rank] not in {hosts[t] for t in targets}
    received = [sum(rank in t for t in peers) for rank in range(len(hosts))]
    assert received == [2] * 6
    with pytest.raises(ValueError, match="at least 2 hosts"):
        replica_peers(["a", "a"], 1)
    assert replica_peers(["a"], 0) == [[]]


def test_plan_copies_fetches_only_what_is_missing_or_refused() -> None:
    A, B, C = ("a", "/l"), ("b", "/l"), ("c", "/l")
    held = {A: {"f1": 10, "f2": 20}, B: {"f2": 20, "f3": 5}, C: {}}
    sizes = {"f1": 10, "f2": 20, "f3": 5}
    ranks = {A: [0, 1], B: [2], C: [3]}
    copies, lost = plan_copies({A: {"f1", "f3"}, C: {"f2"}}, held, sizes, ranks)
    assert lost == {}
    assert Copy("f3", 5, 2, 0) in copies
    assert [c for c in copies if c.name == "f1"] == []
    assert {c.name for c in copies if c.dst == 3} == {"f2"}
    copies, lost = plan_copies({A: {"f2"}}, held, sizes, ranks, {(A, "f2")})
    assert [(c.name, c.src) for c in copies] == [("f2", 2)]
    _, lost = plan_copies({C: {"f1"}}, held, sizes, ranks, {(A, "f1")})
    assert lost == {C: ["f1"]}
    # the receiving rank a restore names (the file's only reader there) gets the file; one
    # not of the place is ignored (the least loaded rank of the place receives)
    D = ("d", "/l")
    ranks = {**ranks, D: [4, 5]}
    held = {**held, D: {}}
    copies, _ = plan_copies({D: {"f1", "f2"}}, held, sizes, ranks, set(), {(D, "f1"): 5})
    assert {c.name: c.dst for c in copies} == {"f1": 5, "f2": 4}
    copies, _ = plan_copies({D: {"f1"}}, held, sizes, ranks, set(), {(D, "f1"): 0})
    assert [c.dst for c in copies] == [4]
    assert complete_steps(
        {A: {"s1": {"f1": 10}}, B: {"s1": {"f2": 20}}}, {"s1": {"f1": 10, "f2": 20}}
    ) == ["s1"]
    assert complete_steps({A: {"s1": {"f1": 9}}}, {"s1": {"f1": 10}}) == []


def _drained(rank: int, world: int, tmp: str) -> Any:
    host = "ab"[rank]
    mgr = manager(tmp, host, drain=True)
    mgr.persistent_every = 2
    w = torch.zeros(ROWS // world, COLS, dtype=torch.float64)
    m = torch.zeros_like(w)
    state = state_of(rank, world, w, m, 0)
    for step in range(1, 5):
        train_step(w, m, rows_of(rank, world), step)
        state["step"] = step
        mgr.save(step, state)
    mgr.close()
    return None


def _drained_slow_leader(rank: int, world: int, tmp: str) -> Any:
    """Host b's leader (rank 1) renames each local step into place a moment after the others
    learnt that it committed: rank 2, on b too, must not read its files before."""
    import shardsafe.local_tier

    if rank == 1:
        original = shardsafe.local_tier.PlaceTarget.publish

        def slow(self: Any, *a: Any, **k: Any) -> Any:
            time.sleep(1.0)
            return original(self, *a, **k)

        shardsafe.local_tier.PlaceTarget.publish = slow  # type: ignore[method-assign]
    host = "abb"[rank]
    mgr = manager(tmp, host, drain=True)
    mgr.persistent_every = 2
    w = torch.zeros(ROWS // world, COLS, dtype=torch.float64)
    state = state_of(rank, world, w, torch.zeros_like(w), 0)
    for step in range(1, 3):
        state["step"] = step
        mgr.save(step, state)
    mgr.close()
    return None


def test_a_drain_waits_for_its_place_to_publish_the_step(tmp_path: Path) -> None:
    run_ranks(_drained_slow_leader, 3, str(tmp_path), timeout=240, start_method="forkserver")
    assert "step_000000002" in os.listdir(tmp_path / "persistent")


def test_drain_copies_local_steps_to_the_persistent_tier(tmp_path: Path) -> None:
    import subprocess
    import sys

    from shardsafe import load

    run_ranks(_drained, 2, str(tmp_path), timeout=240, start_method="forkserver")
    persistent = tmp_path / "persistent"
    assert sorted(os.listdir(persistent)) == ["latest", "step_000000002", "step_000000004"]
    assert (persistent / "latest").read_text().strip() == "step_000000004"
    ok = subprocess.run(
        [sys.executable, "-m", "shardsafe", "verify", str(persistent / "step_000000004")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    w = torch.zeros(ROWS, COLS, dtype=torch.float64)
    m = torch.zeros_like(w)
    loaded = load(state_of(0, 1, w, m, 0), persistent / "step_000000004")
    assert loaded["step"] == 4
    check_exact([{"step": 4, "w": w, "m": m}], 4)


class _FlippingReader:
    """A reader whose first read of a data file comes back with its middle byte flipped."""

    def __init__(self, inner: Any, left: list[int]) -> None:
        self._inner, self._left = inner, left

    def read_into(self, offset: int, out: memoryview) -> None:
        self._inner.read_into(offset, out)
        if self._left[0] and len(out):
            self._left[0] -= 1
            out[len(out) // 2] ^= 0x40

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _FlippingSource:
    """A sender's storage whose bytes go out damaged: its own files stay intact on its disk."""

    def __init__(self, inner: Any) -> None:
        self._inner, self._left = inner, [1]

    def open_read(self, rel: str) -> Any:
        return _FlippingReader(self._inner.open_read(rel), self._left)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _damaged_in_flight(rank: int, world: int, tmp: str) -> Any:
    import shardsafe.local_tier as local_tier

    if rank == 1:  # host b's copy of its file leaves it with one byte flipped
        real = local_tier.exchange_files

        def flipping(*args: Any, **kw: Any) -> list[str]:
            group, r, global_rank, copies, source, *rest = args
            return real(group, r, global_rank, copies, _FlippingSource(source), *rest, **kw)

        local_tier.exchange_files = flipping  # type: ignore[assignment]
    mgr = manager(tmp, "ab"[rank])
    w = torch.zeros(ROWS // world, COLS, dtype=torch.float64)
    m = torch.zeros_like(w)
    train_step(w, m, rows_of(rank, world), 1)
    mgr.save(1, state_of(rank, world, w, m, 1))
    try:
        mgr.wait()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    finally:
        mgr.close()
    return None


def test_a_copy_damaged_in_flight_fails_the_local_save(tmp_path: Path) -> None:
    results = run_ranks(_damaged_in_flight, 2, str(tmp_path), timeout=240)
    for rank, r in enumerate(results):
        assert r is not None, f"rank {rank} committed a step with a damaged copy"
        assert r["type"] == "CheckpointError", r
        # the receiver names the file, the sender and itself, with their hosts
        assert (
            "the copy of data/rank-00001-00.bin from rank 1 (b) arrived damaged" in r["message"]
        ), r["message"]
        assert "on rank 0 (a): bytes " in r["message"], r["message"]
    assert list((tmp_path / "local").rglob("manifest.json")) == []


def _exchange(rank: int, world: int, tmp: str) -> Any:
    import torch.distributed as dist

    from shardsafe.storage.local import LocalStorage
    from shardsafe.transfer import exchange_files

    storage = LocalStorage(f"{tmp}/r{rank}")
    for name, n in SIZES.items():  # each rank's files carry its rank in their names
        storage.write_bytes(f"src/data/r{rank}-{name}", _content(rank, n))
    # a ring plus a second stream into rank 0: ranks 0 and 1 send to and receive from each
    # other; several files per stream, one empty, streams of different lengths
    copies = [
        Copy(f"data/r{src}-{name}", n, src, dst)
        for src, dst in ((0, 1), (1, 2), (2, 0), (1, 0))
        for name, n in SIZES.items()
        if not (src == 1 and dst == 0 and name == "a.bin")
    ]
    # every received copy is checked as it arrives: one extent from byte 5 to 3 short of the
    # end, blocks of 64 bytes cut by the rounds of 100; rank 0 expects other bytes in r2-a.bin
    checks = {}
    for c in copies:
        if c.dst == rank and c.nbytes > 8:
            expected = _content(99 if c.name == "data/r2-a.bin" else c.src, c.nbytes)
            sums = tuple(block_checksums(expected[5 : c.nbytes - 3], 64))
            checks[c] = StreamCheck([Extent(c.name, 5, c.nbytes - 8, sums)], 64)
    errors = exchange_files(
        dist.group.WORLD,
        rank,
        lambda r: r,
        copies,
        storage,
        lambda n: f"src/{n}",
        storage,
        lambda n: f"got/{n}",
        chunk_bytes=100,
        checks=checks,
    )
    got = {c.name: storage.read_bytes(f"got/{c.name}") for c in copies if c.dst == rank}
    verdicts = {c.name: check.finish() for c, check in checks.items()}
    return errors, got, verdicts


SIZES = {"a.bin": 1000, "b.bin": 0, "c.bin": 333, "d.bin": 77}


def _content(rank: int, n: int) -> bytes:
    return bytes((rank * 31 + i) % 251 for i in range(n))


def test_files_move_between_ranks_in_bounded_chunks(tmp_path: Path) -> None:
    results = run_ranks(_exchange, 3, str(tmp_path), timeout=120)
    for rank, (errors, got, verdicts) in enumerate(results):
        assert errors == []
        assert len(verdicts) == {0: 5, 1: 3, 2: 3}[rank], verdicts
        for name, bad in verdicts.items():
            if rank == 0 and name == "data/r2-a.bin":  # every block differs, none is missing
                assert len(bad) == 16 and all("never arrived" not in b for b in bad), bad
                assert bad[0] == "bytes 5 (block 0 of an extent at 5)", bad
            else:
                assert bad == [], (rank, name, bad)
        for key, data in got.items():
            src, name = key.removeprefix("data/").split("-", 1)
            assert data == _content(int(src[1:]), SIZES[name]), (rank, key)
    assert sorted(results[0][1]) == [
        f"data/{n}"
        for n in (
            "r1-b.bin",
            "r1-c.bin",
            "r1-d.bin",
            "r2-a.bin",
            "r2-b.bin",
            "r2-c.bin",
            "r2-d.bin",
        )
    ]
    assert sorted(results[2][1]) == [f"data/r1-{n}" for n in ("a.bin", "b.bin", "c.bin", "d.bin")]


def test_places_disagreeing_on_a_manifest_fall_back_a_step(
    trained: Path, tmp_path: Path, caplog: Any
) -> None:
    run = fresh_copy(trained, tmp_path)
    # host b's manifest of step 13 is valid but not the one host a holds (written again with
    # other whitespace, sealed again: another digest); neither can be trusted over the other
    manifest = place(run, "b") / "step_000000013" / "manifest.json"
    manifest.write_bytes(sealed(json.loads(manifest.read_text()), indent=3))
    results = run_ranks(_restore, 2, str(run), ["a", "b"], timeout=240, start_method="forkserver")
    assert {r["restored"] for r in results} == {12}
    assert all(r["tier"] == "local" for r in results)
    check_exact(results, 12)
    for host in ("a", "b"):  # the step is marked damaged in every place that has it
        assert (place(run, host) / ".step_000000013.shardsafe-damaged").exists(), host


def test_a_place_with_an_unreadable_manifest_takes_the_step_from_another(
    trained: Path, tmp_path: Path
) -> None:
    run = fresh_copy(trained, tmp_path)
    # host a holds every file of step 13 (its own and its copies of b's), host b's manifest
    # is garbage: b's copy is not used, the step comes from a's, b's directory is replaced
    bad = place(run, "b") / "step_000000013" / "manifest.json"
    bad.write_text("{not json")
    results = run_ranks(_restore, 2, str(run), ["a", "b"], timeout=240, start_method="forkserver")
    assert {r["restored"] for r in results} == {13}
    assert all(r["tier"] == "local" for r in results)
    check_exact(results, 13)
    assert bad.read_bytes() == (place(run, "a") / "step_000000013" / "manifest.json").read_bytes()
    assert not [p for p in place(run, "b").iterdir() if "unreadable" in p.name]


def _restore_model_only(rank: int, world: int, tmp: str, hosts: list[str]) -> Any:
    """A restore that reads step 13's files, then fails in the load (not for damage): the
    template asks for the model only and ``strict="raise_all"`` refuses the unread optimizer."""
    mgr = manager(tmp, hosts[rank])
    w = torch.full((ROWS // world, COLS), float("nan"), dtype=torch.float64)
    state = state_of(rank, world, w, torch.zeros_like(w), 0)
    del state["optim"]
    try:
        mgr.restore(state, strict="raise_all")
    finally:
        mgr.close()
    raise AssertionError("the restore accepted a template missing the optimizer")


def _restore_logged(rank: int, world: int, tmp: str, hosts: list[str]) -> Any:
    """:func:`_restore`, with what the library logged at INFO and above."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    logger = logging.getLogger("shardsafe")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    return {**_restore(rank, world, tmp, hosts), "log": records}


def test_a_fresh_host_takes_fetched_bytes_into_its_tensors_and_keeps_no_partial_copy(
    trained: Path, tmp_path: Path
) -> None:
    """Host b's disk is gone; the restart puts ranks 2 and 3 on a fresh host c, in the saved
    layout. Each reads only its own files, so their bytes go from host a's copies straight
    into its tensors: no file holds them on c, and c keeps no copy of the step (a directory
    with holes must never become one, not even after a failed load)."""
    run = fresh_copy(trained, tmp_path)
    shutil.rmtree(run / "local" / "b")
    hosts = ["a", "a", "c", "c"]
    with pytest.raises(RankFailure) as info:
        run_ranks(_restore_model_only, 4, str(run), hosts, timeout=240, start_method="forkserver")
    assert all("requested by no rank" in e for e in info.value.errors.values()), info.value.errors
    # the failed load left the fetched directory, which nothing may take for the step
    assert not (place(run, "c") / "step_000000013").exists()
    assert [p.name for p in place(run, "c").iterdir() if p.name.startswith(".shardsafe-fetched")]
    results = run_ranks(_restore_logged, 4, str(run), hosts, timeout=240, start_method="forkserver")
    assert {r["restored"] for r in results} == {13}
    assert all(r["tier"] == "local" for r in results)
    check_exact(results, 13)
    share = 2 * (ROWS // 4) * COLS * 8  # w and m, float64
    for rank, r in enumerate(results):
        moved = [line for line in r["log"] if "went straight into" in line]
        if rank < 2:
            assert not moved, r["log"]
        else:
            assert moved and f": {share} bytes of " in moved[0], r["log"]
        assert not [line for line in r["log"] if "damaged" in line], r["log"]
    # c holds nothing of the step, and nothing was left behind
    assert sorted(p.name for p in place(run, "c").iterdir() if "000000013" in p.name) == []


def _restore_nothing_in_memory(rank: int, world: int, tmp: str, hosts: list[str]) -> Any:
    """:func:`_restore` where no fetched file may go into memory (as with tensors on a GPU)."""
    import shardsafe.local_restore

    shardsafe.local_restore.MAX_KEPT_BYTES = -1  # every file keeps too much outside its spans
    return _restore(rank, world, tmp, hosts)


def test_a_fresh_host_that_took_nothing_into_memory_keeps_the_fetched_step(
    trained: Path, tmp_path: Path
) -> None:
    """Where no rank of the fresh host took a file into memory, its fetched directory holds
    every file and becomes the step once loaded and synced, as a copy of the other hosts'."""
    run = fresh_copy(trained, tmp_path)
    shutil.rmtree(run / "local" / "b")
    results = run_ranks(
        _restore_nothing_in_memory,
        4,
        str(run),
        ["a", "a", "c", "c"],
        timeout=240,
        start_method="forkserver",
    )
    assert {r["restored"] for r in results} == {13}
    check_exact(results, 13)
    step = place(run, "c") / "step_000000013"
    assert (step / "manifest.json").read_bytes() == (
        place(run, "a") / "step_000000013" / "manifest.json"
    ).read_bytes()
    fetched = sorted(p.name for p in (step / "data").iterdir())
    assert fetched
    for name in fetched:
        assert (step / "data" / name).read_bytes() == (
            place(run, "a") / "step_000000013" / "data" / name
        ).read_bytes()
    assert not [p.name for p in place(run, "c").iterdir() if p.name.startswith(".shardsafe")]


def test_a_drained_step_stays_committed_when_its_bookkeeping_fails(
    s3_bucket_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an object store the drained files carry the drain's token: cleaning up after the
    commit, as if it had not happened, deleted the committed checkpoint's data."""
    import shardsafe
    from shardsafe.errors import CheckpointError

    w = torch.arange(64, dtype=torch.float32)
    mgr = CheckpointManager(s3_bucket_url, local_root=tmp_path / "local", drain=True)
    try:

        def refuse(name: str) -> None:
            raise OSError(f"pointer refused for {name}")

        monkeypatch.setattr(mgr._dir, "write_pointer", refuse)  # the bookkeeping after commit
        handle = mgr.save(1, {"w": w, "step": 1})
        assert handle is not None
        with pytest.raises(CheckpointError, match="pointer refused"):
            handle.result()
    finally:
        mgr.close()
    loaded = shardsafe.load({"w": torch.zeros(64)}, f"{s3_bucket_url}/step_000000001")
    assert torch.equal(loaded["w"], w) and loaded["step"] == 1


def _start_over(rank: int, world: int, tmp: str, restore: bool, run_id: str) -> Any:
    """Two ranks on hosts a and b save steps 1-3 locally; new managers then save step 1
    again, having restored or not."""
    host = "ab"[rank]
    w = torch.zeros(ROWS // world, COLS, dtype=torch.float64)
    state = state_of(rank, world, w, torch.zeros_like(w), 0)
    first = manager(tmp, host)  # persistent_every=10: these steps are local only
    for step in (1, 2, 3):
        state["step"] = step
        first.save(step, state)
    first.close()
    again = CheckpointManager(
        f"{tmp}/persistent", local_root=f"{tmp}/local/{host}", node_id=host, run_id=run_id
    )
    if restore:
        state = again.restore(state)
    try:
        again.save(1, state)
        again.wait()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        again.close()
    return None


def test_a_run_that_starts_over_without_restoring_is_refused(tmp_path: Path) -> None:
    """latest_step() reads the persistent tier only: a loop that resumes only when it names a
    step starts over while the local tier holds newer steps. Its first save is refused on
    every rank, naming the host and the step, instead of mixing two trainings in one run."""
    errors = run_ranks(_start_over, 2, str(tmp_path / "x"), False, "tiers", timeout=120)
    for e in errors:
        assert e is not None and e.startswith("CheckpointError"), errors
        assert "holds committed step 3" in e and "restored nothing" in e, e
    assert all("step 3 on hosts a, b (this host's" in e for e in errors), errors
    # a run that restored, or a run of its own (a new run_id), saves as usual
    assert run_ranks(_start_over, 2, str(tmp_path / "y"), True, "tiers", timeout=120) == [None] * 2
    assert run_ranks(_start_over, 2, str(tmp_path / "z"), False, "new", timeout=120) == [None] * 2


def _saves_both_tiers(rank: int, world: int, tmp: str, last: int) -> Any:
    """Hosts a and b, a local save every step and a persistent one every 2nd, to ``last``."""
    host = "ab"[rank]
    mgr = CheckpointManager(
        f"{tmp}/persistent",
        local_root=f"{tmp}/local/{host}",
        node_id=host,
        persistent_every=2,
        dead_after=2.0,
    )
    train_and_save(mgr, last, rank, world)
    mgr.close()
    return None


def _restore_both_tiers(rank: int, world: int, tmp: str) -> Any:
    host = "ab"[rank]
    mgr = CheckpointManager(
        f"{tmp}/persistent", local_root=f"{tmp}/local/{host}", node_id=host, dead_after=2.0
    )
    w = torch.full((ROWS // world, COLS), float("nan"), dtype=torch.float64)
    m = torch.full_like(w, float("nan"))
    state = mgr.restore(state_of(rank, world, w, m, 0))
    mgr.close()
    return {"step": state["step"], "tier": mgr.restored_tier, "w": w.numpy(), "m": m.numpy()}


def test_a_damaged_persistent_step_falls_back_to_a_newer_local_one(tmp_path: Path) -> None:
    """Persistent steps 2 and 4, local steps 3 and 4; local step 4 is gone and persistent
    step 4 is damaged. The newest intact step in reach is local step 3, not persistent step 2:
    a persistent step found damaged lets the local steps newer than the next one go first."""
    run_ranks(_saves_both_tiers, 2, str(tmp_path), 4, timeout=120)
    for host in ("a", "b"):
        shutil.rmtree(place(tmp_path, host) / "step_000000004")
    data = tmp_path / "persistent" / "step_000000004" / "data"
    victim = sorted(data.iterdir())[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    results = run_ranks(_restore_both_tiers, 2, str(tmp_path), timeout=120)
    assert all(r["tier"] == "local" for r in results), results
    check_exact(results, 3)
    assert (tmp_path / "persistent" / ".step_000000004.shardsafe-damaged").exists()


def _restore_or_error(rank: int, world: int, tmp: str) -> Any:
    try:
        return _restore_both_tiers(rank, world, tmp)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_every_local_step_damaged_and_no_persistent_step_is_no_fresh_start(
    tmp_path: Path,
) -> None:
    """Local step 1 only (persistent every 2nd), one file of it flipped on both hosts. A run
    that resumes by catching CheckpointNotFoundError would start over on top of it: the
    restore raises CorruptCheckpointError on every rank, naming the step and the damage."""
    run_ranks(_saves_both_tiers, 2, str(tmp_path), 1, timeout=120)
    assert not (tmp_path / "persistent").exists() or not any(
        n.startswith("step_") for n in os.listdir(tmp_path / "persistent")
    )
    for host in ("a", "b"):
        data = place(tmp_path, host) / "step_000000001" / "data"
        victim = sorted(p for p in data.iterdir() if "00000" in p.name.split("-")[1])[0]
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        victim.write_bytes(bytes(raw))
    errors = run_ranks(_restore_or_error, 2, str(tmp_path), timeout=120)
    for e in errors:
        assert isinstance(e, str) and e.startswith("CorruptCheckpointError"), errors
        assert "local step 1:" in e and "new run_id" in e, e
    assert (place(tmp_path, "a") / ".step_000000001.shardsafe-damaged").exists()
