"""Class 7: a deflated ``torch.save`` archive is refused, never converted to nonsense.

Memory-mapping a deflated record hands back its compressed bytes as tensor data; the
conversion used to succeed with exit 0. Every restricted ``torch.load`` now checks the
archive first (``codec.check_torch_archive``) and refuses compressed records.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from .foreign import FOREIGN, deflated, make_dcp, torch_bytes
from .harness import assert_cli_refuses, assert_refused, run_calls, run_cli

pytestmark = pytest.mark.timeout(240)


def _deflate_dcp_tensor(path: Path) -> None:
    """Rewrite the tensor record of ``w`` in its .distcp file as a deflated archive."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    meta = pickle.loads((path / ".metadata").read_bytes())
    tensor = torch.arange(48.0).reshape(8, 6)
    data = deflated(torch_bytes(tensor))
    (path / "__w.distcp").write_bytes(data)
    for index in list(meta.storage_data):
        if index.fqn == "w":
            meta.storage_data[index] = _StorageInfo("__w.distcp", 0, len(data))
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def test_deflated_torch_archives_are_refused(tmp_path: Path) -> None:
    state = {"w": torch.arange(1000.0), "b": torch.ones(7, dtype=torch.int64)}
    (tmp_path / "deflated.pt").write_bytes(deflated(torch_bytes(state)))
    (tmp_path / "plain.pt").write_bytes(torch_bytes(state))
    make_dcp(tmp_path / "dcp")
    _deflate_dcp_tensor(tmp_path / "dcp")
    code = FOREIGN + "".join(
        f"read_foreign({str(tmp_path / name)!r}, {name + ': '!r})\n"
        for name in ("deflated.pt", "dcp", "plain.pt")
    )
    results = run_calls(code, tmp_path / "outside")
    assert results[2]["outcome"] == "ok", results[2]  # the same content, stored: reads fine
    assert_refused(results[:2], 2, match="compressed")
    dst = tmp_path / "out"
    assert_cli_refuses(
        run_cli("convert", str(tmp_path / "deflated.pt"), str(dst), "--to", "shardsafe")
    )
    assert not dst.exists()
