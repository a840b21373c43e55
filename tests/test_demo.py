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
