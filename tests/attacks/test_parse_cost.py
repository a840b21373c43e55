"""Class 12: parsing a manifest costs a bounded multiple of its size.

Python spends about 64 bytes on an empty list or object, which JSON writes in 3 bytes: a
16 MiB manifest of ``[[],[],...]`` grew memory by about 25 times its size (400 MiB; with the
1 GiB cap on manifests, 25 GiB). Before parsing, a manifest may open at most one list or
object per 16 bytes (plus 4,096; ``format.check_json_density``), which bounds parsing to
about 16 times the text (the densest scalars, a list of two-character strings, cost 15.5
times). Real manifests open about one per 40 bytes and load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .harness import (
    N_READERS,
    READERS,
    assert_cli_refused,
    assert_refused,
    run_calls,
    save_small,
)

pytestmark = pytest.mark.timeout(300)
SIZE = 16 << 20


def test_dense_containers_are_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "dense"
    doc = save_small(path)
    head = json.dumps(doc)[:-1]  # everything but the closing brace
    filler = ",".join(["[]"] * (SIZE // 3))
    (path / "manifest.json").write_text(f'{head},"padding":[{filler}]}}')
    code = READERS + f"every_reader({str(path)!r})\ncli('verify', 'verify', {str(path)!r})\n"
    results = run_calls(code, tmp_path / "outside")
    # every reader refuses within 256 MiB of growth: parsing the text would take 400 MiB
    assert_refused(results[:N_READERS], N_READERS, match="JSON lists or objects")
    assert_cli_refused(results[N_READERS])
    assert "JSON lists or objects" in results[N_READERS]["message"]


def test_dense_megatron_json_is_refused(tmp_path: Path) -> None:
    """Megatron-Core's ``metadata.json`` and ``integrity.json`` go through the same bound."""
    from .foreign import FOREIGN, make_dcp

    filler = ",".join(["[]"] * (SIZE // 3))
    for name in ("metadata.json", "integrity.json"):
        path = make_dcp(tmp_path / name, megatron=True)
        (path / name).write_text(f'{{"sharded_backend": "torch_dist", "x": [{filler}]}}')
    code = (
        FOREIGN
        + f"""
read_foreign({str(tmp_path / "metadata.json")!r}, "metadata.json: ")
from shardsafe.convert import DcpSource
attempt("integrity.json", lambda: DcpSource({str(tmp_path / "integrity.json")!r}).verify_integrity())
"""
    )
    assert_refused(run_calls(code, tmp_path / "outside"), 2, match="JSON lists or objects")


def test_real_manifests_pass_the_bound(tmp_path: Path) -> None:
    """A manifest of 40,000 pieces laid out as sharded saves write them (2-d offsets and
    shapes, one checksum each), about 9 MB, loads; so do small ones."""
    import torch

    import shardsafe
    from shardsafe.format import MAX_CONTAINERS_PER_BYTE, Manifest, check_json_density

    path = tmp_path / "real"
    doc = save_small(path)
    raw = (path / "manifest.json").read_bytes()
    Manifest.loads(raw)
    pieces = [
        {
            "offset": [i * 8, 0],
            "shape": [8, 8],
            "flat": None,
            "file": "data/rank-00000-00.bin",
            "byte_offset": 0,
            "nbytes": 256,
            "checksums": ["0123456789abcdef"],
        }
        for i in range(40_000)
    ]
    doc["tensors"]["big"] = {"dtype": "float32", "shape": [320_000, 8], "pieces": pieces}
    text = json.dumps(doc).encode()
    opened = text.count(b"[") + text.count(b"{")
    assert opened < len(text) * MAX_CONTAINERS_PER_BYTE / 2  # well within the bound
    check_json_density(text, "test")
    shardsafe.save({"w": torch.ones(3)}, tmp_path / "small")
    assert shardsafe.load_common_state_dict(tmp_path / "small") is not None
