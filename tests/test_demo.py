"""``make demo`` in short: examples/demo.py --quick trains, is SIGKILLed mid-save, and resumes
in four layouts; it must pass every one of its own checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HARD_TIMEOUT = 150  # the quick demo takes ~25 s on an idle 2-core machine


@pytest.mark.timeout(HARD_TIMEOUT + 30)
def test_quick_demo_passes_all_its_checks(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # start_new_session: on timeout the whole group (fork server and ranks) can be killed.
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=HARD_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"the quick demo did not finish within {HARD_TIMEOUT} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    assert "ALL CHECKS PASSED" in out, out[-6000:]
    passed = re.search(r"checks passed\s*:\s*(\d+)/(\d+)", out)
    assert passed and passed.group(1) == passed.group(2) and int(passed.group(2)) >= 12, out[-3000:]
    assert re.search(r"resume checks\s*:\s*4/4 passed", out), out[-3000:]
    # The flow really happened: a SIGKILL mid-save, a refused load, resumes in other layouts.
    assert "SIGKILL to all 4 ranks -> exit codes [-9, -9, -9, -9]" in out
    assert "[PASS] loading the killed step is refused: IncompleteCheckpointError" in out
    for layout in ("TP1 x DP2", "TP1 x DP3", "TP1 x PP3 x DP1", "TP2 x DP2"):
        assert f"[PASS] resume into {layout}" in out, layout
    assert "FAIL" not in out
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept[-1] == "step_000000016" and "latest" in kept


def test_make_demo_installs_the_core_only_and_make_test_the_dev_extras_after_it(tmp_path: Path):
    """``make demo`` once installed every dev extra (a 1.6 GB .venv for a demo needing torch
    and shardsafe); the two targets share .venv, so ``make test`` after it must still install
    the dev extras. Dry runs (``make -n``) against a copy of the Makefile."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make here")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)

    def dry(target: str) -> str:
        done = subprocess.run(["make", "-n", target], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    demo = dry("demo")
    assert "pip install -q -e ." in demo and "[dev]" not in demo and "examples/demo.py" in demo
    os.utime(tmp_path / "pyproject.toml", (1, 1))  # older than the stamps made below
    os.utime(tmp_path / "Makefile", (1, 1))
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / ".installed-core").touch()  # as `make demo` leaves it
    test = dry("test")
    main_venv = "\n".join(line for line in test.splitlines() if ".venv312" not in line)
    assert "'.[dev]'" in test and "pytest" in test and "torch==" not in main_venv
    (tmp_path / ".venv" / ".installed").touch()  # as `make test` leaves it
    assert "pip" not in dry("demo")
