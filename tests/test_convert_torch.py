"""Single torch.save files: the streaming writer, the reader, and bounded memory for every writer."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from shardsafe import CheckpointReader, load
from shardsafe.convert import (
    DictSource,
    TorchFileSource,
    UnsafePickleError,
    UnsupportedFormatError,
    detect_format,
    export_torch,
    open_source,
)
from shardsafe.convert.native import export_shardsafe
from shardsafe.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingKeyError,
)


def test_export_is_a_plain_weights_only_torch_file(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(5, 3, generator=g),
        "a.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "mask": torch.rand(3, 3, generator=g) > 0.5,
        "scalar": torch.tensor(7, dtype=torch.int16),
        "empty": torch.zeros(0, 2),
        "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
    }
    common = {
        "step": 12,
        "config": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "run", "nested": {"depth": 2}},
        "args": argparse.Namespace(seed=1, dtype=torch.float16),
        "rng": [torch.arange(3), 5],
        "callback": print,
        "a.weight": "clashes with a tensor",
    }
    progress: list[tuple[int, int, str]] = []
    with pytest.warns(
        UserWarning,
        match=r"2 common entries skipped.*callback \(builtins.builtin_function_or_method\).*a\.weight \(name taken",
    ):
        out = export_torch(
            DictSource(tensors, common),
            tmp_path / "sub" / "m.pt",
            progress=lambda *a: progress.append(a),
        )
    assert out == tmp_path / "sub" / "m.pt" and not list((tmp_path / "sub").glob(".*tmp*"))
    with zipfile.ZipFile(out) as zf:
        assert zf.testzip() is None  # every record's CRC-32 is right
    loaded = torch.load(out, weights_only=True)
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype and loaded[key].shape == tensor.shape, key
        assert bytes(loaded[key].reshape(-1).view(torch.uint8).numpy()) == bytes(
            tensor.reshape(-1).view(torch.uint8).numpy()
        ), key
    assert (
        loaded["step"] == 12
        and loaded["config.lr"] == 1e-3
        and loaded["config.betas"] == (0.9, 0.95)
    )
    assert (
        loaded["config.nested.depth"] == 2
        and loaded["args.seed"] == 1
        and loaded["args.dtype"] == torch.float16
    )
    assert torch.equal(loaded["rng.0"], torch.arange(3)) and loaded["rng.1"] == 5
    assert "callback" not in loaded and loaded["a.weight"].shape == (5, 3)
    assert list(loaded)[: len(tensors)] == list(tensors)  # tensors first, in source order
    total = sum(t.nbytes for t in tensors.values()) + torch.arange(3).nbytes
    assert progress[-1][:2] == (total, total) and [p[2] for p in progress][: len(tensors)] == list(
        tensors
    )

    with pytest.raises(CheckpointExistsError, match="overwrite"):
        export_torch(DictSource(tensors), out)
    source = TorchFileSource(out)
    assert detect_format(out) == "torch" and isinstance(open_source(out), TorchFileSource)
    assert set(source.tensor_keys()) == {*tensors, "rng.0"}
    assert source.tensor_meta("a.bias") == ((5,), torch.bfloat16)
    assert source.common()["config.name"] == "run"
    with pytest.raises(MissingKeyError):
        source.read_tensor("step")


def test_export_without_skip_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Older torch lacks skip_data: the export still works, holding the tensors at once."""
    monkeypatch.delattr(torch.serialization, "skip_data")
    source = DictSource(
        {"w": torch.arange(6.0).reshape(2, 3)}, {"meta": {"step": 4}, "rng": [torch.ones(2)]}
    )
    with pytest.warns(UserWarning, match="skip_data"):
        out = export_torch(source, tmp_path / "m.pt")
    loaded = torch.load(out, weights_only=True)
    assert torch.equal(loaded["w"], torch.arange(6.0).reshape(2, 3)) and loaded["meta.step"] == 4
    assert torch.equal(loaded["rng.0"], torch.ones(2))


def test_reader_flattens_nested_and_legacy_files(tmp_path: Path) -> None:
    state = {
        "model": {"layer": {"w": torch.ones(2, 2)}},
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "lr": 0.1},
    }
    torch.save(state, tmp_path / "nested.pt", _use_new_zipfile_serialization=False)
    assert detect_format(tmp_path / "nested.pt") == "torch"
    source = TorchFileSource(tmp_path / "nested.pt")
    assert source.tensor_keys() == ["model.layer.w", "optimizer.state.0.exp_avg"]
    assert source.common() == {"optimizer.lr": 0.1}
    assert torch.equal(source.read_tensor("model.layer.w"), torch.ones(2, 2))


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.path}",))


def test_reader_refuses_unsafe_pickles(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(1), "evil": _Marker(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(UnsafePickleError, match=r"system.*trust=True"):
        TorchFileSource(tmp_path / "evil.pt")
    assert not marker.exists()

    torch.save({"w": torch.ones(1), "when": argparse.ArgumentParser}, tmp_path / "odd.pt")
    with pytest.raises(UnsafePickleError, match=r"argparse\.ArgumentParser"):
        TorchFileSource(tmp_path / "odd.pt")
    trusted = TorchFileSource(tmp_path / "odd.pt", trust=True)
    assert trusted.common()["when"] is argparse.ArgumentParser
    with pytest.warns(UserWarning, match="when"):
        export_torch(trusted, tmp_path / "clean.pt")
    assert set(torch.load(tmp_path / "clean.pt", weights_only=True)) == {"w"}


def test_detection_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        detect_format(tmp_path / "absent")
    with pytest.raises(UnsupportedFormatError, match=r"manifest\.json"):
        detect_format(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UnsupportedFormatError):
        detect_format(tmp_path / "notes.txt")
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(UnsupportedFormatError, match="list"):
        TorchFileSource(tmp_path / "list.pt")
    (tmp_path / "ss").mkdir()
    (tmp_path / "ss" / "manifest.json").write_text("{}")
    assert detect_format(tmp_path / "ss") == "shardsafe"
    with pytest.raises(
        CorruptCheckpointError, match=r"manifest\.json"
    ):  # detected, then read strictly
        open_source(tmp_path / "ss")


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch
    from shardsafe.convert import DcpSource, DictSource, export_dcp, export_hf, export_torch
    from shardsafe.convert.native import export_shardsafe

    COUNT, NUMEL = 8, 16 * 2**20  # 8 tensors of 64 MiB
    out = Path(sys.argv[1])

    def source(numel=NUMEL):
        make = lambda i: lambda: torch.full((numel,), float(i))
        return DictSource({f"layer.{i}": ((numel,), torch.float32, make(i)) for i in range(COUNT)})

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    def measure(run, warm_up):
        warm_up()  # lazy imports and one-time set-up are not the export's cost
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak (VmHWM) to the current RSS
        base = status("VmRSS")
        run()
        return status("VmHWM") - base

    small = lambda: source(1024)
    print(json.dumps({
        "torch": measure(lambda: export_torch(source(), out / "m.pt"), lambda: export_torch(small(), out / "w.pt")),
        "hf": measure(
            lambda: export_hf(source(), out / "hf", max_shard_size="200MB"), lambda: export_hf(small(), out / "w_hf")
        ),
        "dcp": measure(lambda: export_dcp(source(), out / "dcp"), lambda: export_dcp(small(), out / "w_dcp")),
        "shardsafe": measure(
            lambda: export_shardsafe(source(), out / "ss"), lambda: export_shardsafe(small(), out / "w_ss")
        ),
        "dcp_to_hf": measure(
            lambda: export_hf(DcpSource(out / "dcp"), out / "hf2", max_shard_size="200MB"),
            lambda: export_hf(DcpSource(out / "w_dcp"), out / "w_hf2"),
        ),
    }))
    """
)


@pytest.mark.timeout(120)
def test_memory_stays_within_a_few_tensors(tmp_path: Path) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to measure peak memory")
    script = tmp_path / "measure.py"
    script.write_text(_MEMORY_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])
    tensor, model = 64 * 2**20, 8 * 64 * 2**20
    for name, value in growth.items():
        assert value < 3 * tensor, (
            f"{name}: peak memory grew by {value / 2**20:.0f} MiB for a {model // 2**20} MiB model"
        )

    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf2" / "model-00004-of-00004.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("layer.7")[:5], torch.full((5,), 7.0))
    with zipfile.ZipFile(tmp_path / "m.pt") as zf:
        assert len([n for n in zf.namelist() if "/data/" in n]) == 8
    loaded = torch.load(tmp_path / "m.pt", weights_only=True, mmap=True)
    assert torch.equal(loaded["layer.5"][-3:], torch.full((3,), 5.0))
    reader = CheckpointReader(tmp_path / "ss")
    assert torch.equal(reader.read_tensor("layer.6")[-3:], torch.full((3,), 6.0))


def test_export_to_shardsafe_is_a_save_that_commits_or_leaves_nothing(tmp_path: Path) -> None:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    good = DictSource({"model.w": w, "b": torch.ones(2, dtype=torch.bfloat16)}, {"step": 7})
    manifest = export_shardsafe(good, tmp_path / "ss")
    assert sorted(manifest.tensors) == ["b", "model.w"] and manifest.world_size == 1
    loaded = load(
        {"model.w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "ss"
    )
    assert torch.equal(loaded["model.w"], w) and loaded["step"] == 7
    with pytest.raises(CheckpointExistsError):
        export_shardsafe(good, tmp_path / "ss")
    # a tensor that does not match its description fails the save: nothing published, no leftovers
    lying = DictSource({"w": ((4,), torch.float32, lambda: torch.zeros(5))})
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        export_shardsafe(lying, tmp_path / "bad")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ss"]
