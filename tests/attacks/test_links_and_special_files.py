"""Class 6: no reader follows a link or opens anything but a regular file inside its root.

Every file a reader of a checkpoint directory opens (ours, DCP / Megatron ``torch_dist``,
Hugging Face folders) goes through ``storage.local.open_checked``: a symbolic link in
place of a file is refused after an ``lstat`` (its target is neither opened nor stat'ed),
a FIFO or device is refused without blocking (``O_NONBLOCK``, then ``fstat``), and sizes
come from the opened descriptor. The child records every file opened under ``outside/``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from .foreign import FOREIGN, make_dcp, make_hf
from .harness import (
    N_READERS,
    READERS,
    assert_cli_refused,
    assert_cli_refuses,
    assert_refused,
    run_calls,
    run_cli,
    save_small,
)

pytestmark = pytest.mark.timeout(240)


def _link(target: Path | str) -> Callable[[Path], None]:
    def plant(file: Path) -> None:
        file.unlink(missing_ok=True)
        file.symlink_to(target)

    return plant


def _fifo(file: Path) -> None:
    file.unlink(missing_ok=True)
    os.mkfifo(file)


def _each(plant: Callable[[Path], None]) -> Callable[[Path], None]:
    """Apply ``plant`` to every data file."""

    def run(data_dir: Path) -> None:
        for f in list(data_dir.iterdir()):
            plant(f)

    return run


def _secrets(outside: Path) -> dict[str, Path]:
    outside.mkdir(parents=True, exist_ok=True)
    torch.save({"secret": torch.full((4,), 42.0), "password": "hunter2"}, outside / "secret.pt")
    make_dcp(outside / "dcp")
    make_hf(outside / "hf")
    return {
        "pt": outside / "secret.pt",
        "metadata": outside / "dcp" / ".metadata",
        "index": outside / "hf" / "model.safetensors.index.json",
        "shard": outside / "hf" / "model-00001-of-00002.safetensors",
    }


def test_foreign_readers_refuse_links_and_special_files(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    secret = _secrets(outside)
    cases: dict[str, tuple[str, str, Callable[[Path], None]]] = {
        # label: (format, file to replace, how)
        "common.pt -> secret": ("megatron", "common.pt", _link(secret["pt"])),
        ".metadata -> outside": ("dcp", ".metadata", _link(secret["metadata"])),
        "metadata.json -> /dev/zero": ("megatron", "metadata.json", _link("/dev/zero")),
        "__0.metadata -> /dev/zero": ("dcp-rank", "__0.metadata", _link("/dev/zero")),
        "index -> outside": ("hf", "model.safetensors.index.json", _link(secret["index"])),
        "index -> /dev/zero": ("hf", "model.safetensors.index.json", _link("/dev/zero")),
        "shard -> outside": ("hf", "model-00001-of-00002.safetensors", _link(secret["shard"])),
        "fifo .metadata": ("dcp", ".metadata", _fifo),
        "fifo __0.metadata": ("dcp-rank", "__0.metadata", _fifo),
        "fifo metadata.json": ("megatron", "metadata.json", _fifo),
        "fifo common.pt": ("megatron", "common.pt", _fifo),
        "fifo .distcp": ("dcp", "__0_0.distcp", _fifo),
        "fifo index": ("hf", "model.safetensors.index.json", _fifo),
        "fifo shard": ("hf", "model-00002-of-00002.safetensors", _fifo),
    }
    roots = {}
    for i, (label, (fmt, name, plant)) in enumerate(cases.items()):
        root = tmp_path / f"case{i}"
        if fmt == "hf":
            make_hf(root)
        else:
            make_dcp(root, megatron=fmt == "megatron")
            if fmt == "dcp-rank":
                (root / ".metadata").rename(root / "__0.metadata")
        plant(root / name)
        roots[label] = root
    code = FOREIGN + "".join(
        f"read_foreign({str(r)!r}, {label + ': '!r})\n" for label, r in roots.items()
    )
    controls = [
        make_dcp(tmp_path / "ok-dcp"),
        make_dcp(tmp_path / "ok-mcore", megatron=True),
        make_hf(tmp_path / "ok-hf"),
    ]
    code += "".join(f"read_foreign({str(r)!r}, 'control: ')\n" for r in controls)
    results = run_calls(code, outside)
    assert [r["outcome"] for r in results[len(cases) :]] == ["ok"] * 3, results[len(cases) :]
    results = results[: len(cases)]
    assert_refused(results, len(cases))
    for r in results:
        assert "hunter2" not in r["message"] and "42." not in r["message"], r
    dst = tmp_path / "converted"
    assert_cli_refuses(
        run_cli("convert", str(roots["common.pt -> secret"]), str(dst), "--to", "shardsafe")
    )
    assert not dst.exists()


def test_our_readers_refuse_links_and_special_files(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    save_small(outside / "theirs")
    cases: dict[str, tuple[str, Callable[[Path], None]]] = {
        "manifest -> outside": ("manifest.json", _link(outside / "theirs" / "manifest.json")),
        "manifest -> /dev/zero": ("manifest.json", _link("/dev/zero")),
        "fifo manifest": ("manifest.json", _fifo),
        "data -> outside": (
            "data",
            _each(lambda f: _link(outside / "theirs" / "data" / f.name)(f)),
        ),
        "fifo data": ("data", _each(_fifo)),
        "data dir -> outside": (
            "data",
            lambda p: (shutil.rmtree(p), p.symlink_to(outside / "theirs" / "data")),
        ),
    }
    roots = {}
    for i, (label, (name, plant)) in enumerate(cases.items()):
        root = tmp_path / f"case{i}"
        save_small(root)
        plant(root / name)
        roots[label] = root
    code = READERS + "".join(
        f"every_reader({str(r)!r}, {label + ': '!r})\n" for label, r in roots.items()
    )
    code += "".join(
        f"cli({c!r}, {c!r}, {str(roots['fifo manifest'])!r})\n" for c in ("verify", "inspect")
    )
    results = run_calls(code, outside)
    for r in results[-2:]:
        assert_cli_refused(r)
    results = results[:-2]
    # the metadata readers read the manifest only: with the data files replaced they succeed
    data_cases = ("data -> outside", "fifo data", "data dir -> outside")
    ok = [
        r
        for r in results
        if r["name"].startswith(data_cases)
        and r["name"].endswith((": load_metadata", ": load_content_metadata"))
    ]
    assert len(ok) == 6 and all(r["outcome"] == "ok" for r in ok)
    # common state lives in the data files too, so every other reader refuses
    rest = [r for r in results if r not in ok]
    assert_refused(rest, N_READERS * len(cases) - 6)
