"""The README's first example runs as written, on 2 ranks launched by torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A first example") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_example_is_short():
    assert len(_example().strip().splitlines()) <= 16


@pytest.mark.timeout(180)
def test_readme_example_runs_on_two_ranks(tmp_path):
    script = tmp_path / "example.py"
    check = (
        "\nassert torch.equal(out['w'][rank * (1024 // world):(rank + 1) * (1024 // world)], w)\n"
        "assert out['step'] == 100\n"
    )
    script.write_text(_example() + check)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    from distributed import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "step_100" / "manifest.json").exists()
