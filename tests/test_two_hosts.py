"""Two hosts on one machine: network, UTS, PID and mount namespaces joined by a veth pair,
``torchrun --nnodes 2`` with c10d rendezvous between them, a checkpoint root both see.

* 2 x 2 ranks save; host A (the coordinator's) is SIGKILLed in the middle of a save; host B
  restarts alone with another world size: it resumes from the last committed step, cleans
  the dead host's leftovers once their lease expired, and saves again to the same names.
* Host B has a private file system mounted over the root: the save fails on every rank,
  naming the rank and its host, and nothing is committed.

Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``/``unshare``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import namespaces
import pytest
from distributed import free_port
from twohosts_worker import LEASE_TTL

HERE = Path(__file__).parent
SRC = HERE.parent / "src"


@dataclass
class Hosts:
    ns: namespaces.Hosts

    @property
    def hostnames(self) -> tuple[str, ...]:
        return self.ns.hostnames

    def start(
        self,
        i: int,
        mode: str,
        root: Path,
        marker: Path,
        nproc: int,
        nnodes: int,
        port: int,
        private: Path | None = None,
        disk: tuple[Path, Path] | None = None,
        rdzv_host: int = 0,
    ) -> subprocess.Popen[str]:
        """torchrun on host ``i``: its own hostname, PIDs and mounts, in its network namespace.
        ``disk=(source, path)`` bind-mounts the host's own directory over ``path``: a node-local
        disk only this host sees, which outlives the host's processes."""
        extra = [str(disk[1])] if disk is not None else []
        run = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.ns.ips[rdzv_host] if nnodes > 1 else self.ns.ips[i]}:{port}",
            "--rdzv-id=twohosts", "--max-restarts=0", "--monitor-interval=0.5",
            str(HERE / "twohosts_worker.py"), mode, str(root), str(marker), *extra,
        ]  # fmt: skip
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": "eth0",
            "PYTHONPATH": f"{SRC}:{HERE}",
            "OMP_NUM_THREADS": "1",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        cmd = self.ns.command(
            i,
            run,
            binds=[disk] if disk is not None else [],
            tmpfs=[private] if private is not None else [],
        )
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    try:
        with namespaces.made(("hosta", "hostb"), tmp_path_factory.mktemp("etc")) as ns:
            yield Hosts(ns)
    except namespaces.Refused as e:
        pytest.skip(f"two-host tests: {e}")


def _finish(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        out += "\n[killed after timeout]"
    return out


def _reports(marker: Path, ranks: int) -> list[dict[str, object]]:
    return [json.loads(Path(f"{marker}.rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.timeout(400)
def test_host_killed_mid_save_restart_elsewhere_resumes_and_saves(
    hosts: Hosts, tmp_path: Path
) -> None:
    root, marker = tmp_path / "run", tmp_path / "killed"
    root.mkdir()
    port = free_port()
    a = hosts.start(0, "save", root, marker, 2, 2, port)
    b = hosts.start(1, "save", root, marker, 2, 2, port)
    procs = [a, b]
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert a.poll() is None and b.poll() is None, _finish(a, 5) + _finish(b, 5)
            assert time.monotonic() < deadline, "step 3 never reached the written stage"
            time.sleep(0.2)
        dead = hosts.hostnames.index(marker.read_text())  # the coordinator's host
        other = 1 - dead
        victim, survivor = procs[dead], procs[other]
        victim.send_signal(signal.SIGKILL)  # --kill-child: the whole PID namespace goes with it
        victim.wait(30)
        out = _finish(survivor, 90)
        assert survivor.returncode != 0, out
        left = sorted(n for n in os.listdir(root) if "000000003" in n)
        assert (
            any(".shardsafe-tmp-" in n for n in left) and ".step_000000003.shardsafe-lock" in left
        )
        lease = json.loads((root / ".step_000000003.shardsafe-lock").read_text())
        assert lease["host"] == hosts.hostnames[dead]

        marker2 = tmp_path / "resumed"
        port2 = free_port()
        c = hosts.start(other, "resume", root, marker2, 3, 1, port2)
        procs.append(c)
        out_c = _finish(c, 200)
        assert c.returncode == 0, out_c
        reps = _reports(marker2, 3)
        assert all(r["host"] == hosts.hostnames[other] and r["world"] == 3 for r in reps)
        assert all(r["restored"] == 2 and r["restored_ok"] for r in reps), reps
        # at the restart the dead host's lease was still valid: nothing of step 3 was touched
        # (4-5 s here: the survivor's dead_after and a new namespace's start)
        assert reps[0]["lease_age_at_start"] < LEASE_TTL, "the restart came too late to check this"
        assert reps[0]["left_at_start"] == left
        assert sorted(reps[0]["cleaned"]) == left  # removed once it expired
        assert reps[0]["steps"] == [1, 2, 3, 4]
        assert reps[0]["listing"] == [
            "latest",
            "step_000000001",
            "step_000000002",
            "step_000000003",
            "step_000000004",
        ]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.timeout(300)
def test_a_host_without_the_shared_root_fails_the_save_everywhere(
    hosts: Hosts, tmp_path: Path
) -> None:
    root, marker = tmp_path / "shared", tmp_path / "private"
    root.mkdir()
    port = free_port()
    a = hosts.start(0, "private", root, marker, 2, 2, port)
    b = hosts.start(1, "private", root, marker, 2, 2, port, private=root)
    out_a, out_b = _finish(a, 200), _finish(b, 30)
    assert a.returncode == 0 and b.returncode == 0, out_a + out_b
    reps = _reports(marker, 4)
    coordinator_host = reps[0]["host"]
    blind = [r for r, rep in enumerate(reps) if rep["host"] != coordinator_host]
    assert len(blind) == 2
    for rep in reps:
        err = str(rep["error"])
        for r in blind:
            host = reps[r]["host"]
            assert f"rank {r} on host {host} cannot see the work directory" in err, err
    assert os.listdir(root) == []  # nothing committed on the shared root, nothing left


@pytest.mark.timeout(400)
def test_local_tier_host_lost_restart_with_three_ranks_resumes_from_local_step(
    hosts: Hosts, tmp_path: Path
) -> None:
    """Each host has its own local disk (a directory bind-mounted over the same path); the
    coordinator's host is killed while saving step 14 and its disk is lost; the job restarts
    with 3 ranks (2 on the survivor, 1 on a replacement host with an empty disk) and resumes
    from the newest local step (persistent has only step 10), exactly as an uninterrupted run."""
    root, marker = tmp_path / "persistent", tmp_path / "killed"
    local = tmp_path / "local"  # the mount point; each host binds its own disk here
    disks = (tmp_path / "disk-a", tmp_path / "disk-b")
    for d in (root, local, *disks):
        d.mkdir()
    port = free_port()
    procs = [
        hosts.start(i, "tier", root, marker, 2, 2, port, disk=(disks[i], local)) for i in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert all(p.poll() is None for p in procs), "".join(_finish(p, 5) for p in procs)
            assert time.monotonic() < deadline, "step 14 was never reached"
            time.sleep(0.2)
        dead = hosts.hostnames.index(marker.read_text())
        other = 1 - dead
        procs[dead].send_signal(signal.SIGKILL)
        procs[dead].wait(30)
        out = _finish(procs[other], 120)
        assert procs[other].returncode != 0, out
        assert sorted(os.listdir(root)) == ["latest", "step_000000010"]
        (run_dir,) = disks[other].glob("run-*")  # the run's own directory on the disk
        held = sorted(n for n in os.listdir(run_dir) if n.startswith("step_"))
        # the killed coordinator may have committed step 14 before it died (its writer thread
        # runs on while the training thread waits): the survivor then holds 13 and 14
        assert held in (["step_000000012", "step_000000013"], ["step_000000013", "step_000000014"])
        newest = int(held[-1].removeprefix("step_"))
        shutil.rmtree(disks[dead])  # the dead host's disk is lost with it
        disks[dead].mkdir()  # its replacement starts empty

        marker2 = tmp_path / "resumed"
        port2 = free_port()
        # the survivor's agent hosts the rendezvous: node rank 0 there
        resumed = [
            hosts.start(
                other,
                "tier-resume",
                root,
                marker2,
                2,
                2,
                port2,
                disk=(disks[other], local),
                rdzv_host=other,
            ),
        ]
        procs += resumed
        time.sleep(1.0)
        procs.append(
            hosts.start(
                dead,
                "tier-resume",
                root,
                marker2,
                1,
                2,
                port2,
                disk=(disks[dead], local),
                rdzv_host=other,
            )
        )
        outs = [_finish(p, 240) for p in procs[2:]]
        assert all(p.returncode == 0 for p in procs[2:]), "\n".join(outs)
        reps = _reports(marker2, 3)
        assert sorted(r["host"] for r in reps) == sorted(
            [hosts.hostnames[other]] * 2 + [hosts.hostnames[dead]]
        )
        assert all(r["restored"] == newest and r["tier"] == "local" for r in reps), reps
        assert all(r["exact"] for r in reps), reps
        assert (root / "step_000000020" / "manifest.json").exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
