"""Run readers on hostile inputs in a child process bounded in time and address space.

Each attack test builds its inputs, then hands a few lines of Python to :func:`run_calls`,
which runs them in a new process forked from a server that imported torch and shardsafe once.
Those lines call ``attempt(name, fn)`` once per hostile input, and ``cli(name, *argv)``
to run the ``shardsafe`` command's ``main`` in the same bounded child (one test per class
also runs the real ``python -m shardsafe`` in its own bounded process, :func:`run_cli`). The child caps its address
space (what it uses after importing shardsafe, plus :data:`EXTRA_AS`), records every file
it opens through Python (the ``open`` audit event) whose real path lies under the test's
``outside`` directory, times each call and measures the growth of its peak resident
memory, and reports one JSON document. :func:`assert_refused` then checks the three
promises: a ``CheckpointError`` subclass, nothing outside opened, time and memory bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from manifests import sealed

EXTRA_AS = 2 << 30
"""Address space a child may use beyond what importing shardsafe and torch took."""
CALL_SECONDS = 20.0
"""Upper bound on one hostile call (generous: CI machines are slow and shared)."""
CALL_MEMORY = 256 << 20
"""Upper bound on the growth of peak resident memory during one hostile call."""

_DRIVER = r'''
import json, os, resource, sys, time
import shardsafe, shardsafe.convert
from shardsafe import CheckpointError

OUTSIDE = os.path.realpath(sys.argv[1]) + os.sep
opened_outside = []

def _hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        real = os.path.realpath(path)
        refused_link = os.path.islink(path) and flags & os.O_NOFOLLOW
        if real.startswith(OUTSIDE) and not refused_link:
            opened_outside.append(real)

vsz = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
limit = vsz + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.addaudithook(_hook)
results = []

def attempt(name, fn):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.monotonic()
    try:
        fn()
        outcome, message = "ok", ""
    except CheckpointError as e:
        outcome, message = "CheckpointError", f"{type(e).__name__}: {e}"
    except BaseException as e:
        outcome, message = "raw", f"{type(e).__name__}: {e}"
    results.append({
        "name": name,
        "outcome": outcome,
        "message": message[:2000],
        "seconds": time.monotonic() - start,
        "memory": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
    })

def cli(name, *argv):
    """Run the ``shardsafe`` command in this process; record its exit status and output."""
    import contextlib, io
    from shardsafe.cli import main
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"raw {type(e).__name__}: {e}"
    results.append({
        "name": name,
        "outcome": f"exit {code}",
        "message": err.getvalue()[-3000:],
        "stdout": out.getvalue()[-3000:],
        "seconds": time.monotonic() - start,
        "memory": 0,
    })

exec(compile(sys.stdin.read(), "<attack>", "exec"))
print("@@RESULT@@" + json.dumps({"results": results, "outside": opened_outside}))
'''


def _child(code: str, outside: str, extra_as: int, conn: Any) -> None:
    """The bounded child: :data:`_DRIVER` as ``python -c`` would run it, forked from a server
    that imported torch and shardsafe once (a fresh interpreter spends seconds on that)."""
    import contextlib
    import io
    import traceback
    import warnings

    warnings.simplefilter("ignore")
    sys.argv = ["-c", outside, str(extra_as)]
    sys.stdin = io.StringIO(textwrap.dedent(code))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(_DRIVER, "<driver>", "exec"), {"__name__": "__main__"})
        conn.send((0, out.getvalue()))
    except BaseException:
        conn.send((1, out.getvalue()[-3000:] + traceback.format_exc()[-3000:]))
    finally:
        conn.close()


def run_calls(
    code: str, outside: Path, *, timeout: float = 110.0, extra_as: int = EXTRA_AS
) -> list[dict[str, Any]]:
    """Run ``code`` (which calls ``attempt``) in a bounded child; its per-call results."""
    import multiprocessing

    outside.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("forkserver")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(code, str(outside), extra_as, send), daemon=True)
    proc.start()
    send.close()
    try:
        assert recv.poll(timeout), f"the child did not finish within {timeout} s"
        try:
            status, stdout = recv.recv()
        except EOFError:
            proc.join(5)
            status, stdout = proc.exitcode, "(the child died without reporting)"
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        recv.close()
    marker = [line for line in stdout.splitlines() if line.startswith("@@RESULT@@")]
    assert status == 0 and marker, f"the child failed (status {status}):\n{stdout[-6000:]}"
    report = json.loads(marker[0][len("@@RESULT@@") :])
    assert report["outside"] == [], f"files outside the root were opened: {report['outside']}"
    return list(report["results"])


def assert_refused(
    results: list[dict[str, Any]],
    expected: int,
    *,
    match: str | None = None,
    seconds: float = CALL_SECONDS,
    memory: int = CALL_MEMORY,
) -> None:
    """Every call raised a CheckpointError subclass, within the time and memory bounds."""
    assert len(results) == expected, [r["name"] for r in results]
    for r in results:
        assert r["outcome"] == "CheckpointError", f"{r['name']}: {r['outcome']}: {r['message']}"
        assert r["seconds"] < seconds, f"{r['name']}: took {r['seconds']:.1f} s"
        assert r["memory"] < memory, f"{r['name']}: peak memory grew by {r['memory'] >> 20} MiB"
        if match is not None:
            assert match in r["message"], f"{r['name']}: {r['message']}"


_CLI = r"""
import resource, runpy, sys
import torch, shardsafe, shardsafe.cli
vsz = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
limit = vsz + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.argv = ["shardsafe", *sys.argv[2:]]
runpy.run_module("shardsafe", run_name="__main__", alter_sys=True)
"""


def run_cli(
    *args: str, timeout: float = 60.0, extra_as: int = EXTRA_AS
) -> subprocess.CompletedProcess[str]:
    """``python -m shardsafe ARGS`` with its address space capped at what importing torch and
    shardsafe took plus ``extra_as``: an absolute cap would not fit a CUDA build of torch,
    whose import alone maps several GiB."""
    return subprocess.run(
        [sys.executable, "-c", _CLI, str(extra_as), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def assert_cli_refuses(
    proc: subprocess.CompletedProcess[str], codes: tuple[int, ...] = (1, 2)
) -> None:
    """Exit 1 or 2 with one line on stderr, starting ``error:``, and no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode in codes, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]


def assert_cli_refused(r: dict[str, Any], codes: tuple[int, ...] = (1, 2)) -> None:
    """A :func:`run_calls` ``cli(...)`` result: exit 1 or 2, one ``error:`` line, no traceback."""
    lines = [line for line in r["message"].splitlines() if line.strip()]
    assert r["outcome"] in {f"exit {c}" for c in codes}, (r["name"], r["outcome"], r["message"])
    assert "Traceback" not in r["message"], r["message"]
    assert len(lines) == 1 and lines[0].startswith("error: "), (r["name"], r["message"])
    assert r["seconds"] < CALL_SECONDS, (r["name"], r["seconds"])


def save_small(path: Path, **saver: Any) -> dict[str, Any]:
    """A small real checkpoint at ``path``; returns its manifest as JSON."""
    import torch

    import shardsafe

    sd = {
        "w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.arange(64.0).reshape(8, 8)),
        "step": 3,
        "blob": b"x" * 100,
    }
    shardsafe.Saver(**saver).save(sd, path) if saver else shardsafe.save(sd, path)
    return dict(json.loads((path / "manifest.json").read_text()))


def write_manifest(path: Path, doc: dict[str, Any]) -> None:
    (path / "manifest.json").write_bytes(sealed(doc))


READERS = """
import torch
def _readers(path):
    st = shardsafe.ShardedTensor.from_rank_offsets
    yield "load", lambda: shardsafe.load({"w": st("w", torch.zeros(8, 8))}, path)
    yield "load_metadata", lambda: shardsafe.load_metadata(path)
    yield "load_content_metadata", lambda: shardsafe.load_content_metadata(path)
    yield "read_tensor", lambda: shardsafe.CheckpointReader(path).read_tensor("w")
    yield "common", lambda: shardsafe.CheckpointReader(path).common()
    yield "load_plain_tensors", lambda: shardsafe.load_plain_tensors(path)
    yield "load_common_state_dict", lambda: shardsafe.load_common_state_dict(path)
    def verify():
        report = shardsafe.CheckpointReader(path).verify()
        if report.ok:
            raise AssertionError("verify says OK")
        raise shardsafe.CorruptCheckpointError("; ".join(report.problems))
    yield "verify", verify
def every_reader(path, label=""):
    for name, fn in _readers(path):
        attempt(f"{label}{name}", fn)
"""
"""Driver code: ``every_reader(path)`` attempts each public reader of our format on ``path``."""
N_READERS = 8
