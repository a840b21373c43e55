"""The command line: ls, inspect, verify, diff, convert in every direction, exit codes."""

import json
import subprocess
import sys

import pytest
import torch

import shardsafe
from shardsafe import ShardedTensor
from shardsafe.cli import main


def _save(path, scale=1.0, step=1):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g) * scale
    sd = {
        "model": {
            "w": ShardedTensor.from_rank_offsets("model.w", w),
            "emb": ShardedTensor.from_rank_offsets(
                "model.emb", torch.arange(10, dtype=torch.bfloat16)
            ),
        },
        "step": step,
    }
    shardsafe.save(sd, path)
    return w


def test_ls_shows_committed_and_uncommitted(tmp_path, capsys):
    root = tmp_path / "root"
    _save(root / "step_000010", step=10)
    _save(root / "step_000020", step=20)
    (root / ".step_000030.shardsafe-tmp-abc" / "data").mkdir(parents=True)
    (root / "step_000040" / "data").mkdir(parents=True)
    assert main(["ls", str(root), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["step_000010"]["state"] == "committed" and rows["step_000010"]["step"] == 10
    assert rows["step_000020"]["bytes"] > 0
    assert rows[".step_000030.shardsafe-tmp-abc"]["state"] == "uncommitted"
    assert rows["step_000040"]["state"] == "uncommitted"
    assert main(["ls", str(root)]) == 0
    assert "committed" in capsys.readouterr().out


def test_inspect_json_and_text(tmp_path, capsys):
    _save(tmp_path / "c")
    assert main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    keys = {t["key"]: t for t in info["tensors"]}
    assert keys["model.w"]["shape"] == [6, 4] and keys["model.emb"]["dtype"] == "bfloat16"
    assert main(["inspect", str(tmp_path / "c")]) == 0
    assert "model.w" in capsys.readouterr().out


def test_diff_exit_codes(tmp_path, capsys):
    _save(tmp_path / "a")
    _save(tmp_path / "b")
    _save(tmp_path / "c", scale=1.001)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "model.w" in out and "max_rel" in out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--rtol", "0.01"]) == 0
    shardsafe.save({"x": ShardedTensor.from_rank_offsets("x", torch.zeros(2))}, tmp_path / "d")
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "d"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["only_in_a"] == ["model.emb", "model.w"] and report["only_in_b"] == ["x"]


def test_convert_round_trips_in_every_direction(tmp_path):
    w = _save(tmp_path / "ss")
    steps = [
        ("ss", "t.pt", "torch"),
        ("t.pt", "hf", "hf"),
        ("hf", "ss2", "shardsafe"),
        ("ss2", "dcp", "dcp"),
        ("dcp", "ss3", "shardsafe"),
        ("ss3", "t2.pt", "torch"),
        ("t2.pt", "dcp2", "dcp"),
        ("dcp2", "hf2", "hf"),
    ]
    for src, dst, fmt in steps:
        assert main(["convert", str(tmp_path / src), str(tmp_path / dst), "--to", fmt]) == 0, (
            src,
            dst,
        )
    for name in ("ss2", "ss3", "hf2", "dcp2", "t2.pt"):
        assert main(["diff", str(tmp_path / "ss"), str(tmp_path / name)]) == 0, name
    assert torch.equal(torch.load(tmp_path / "t.pt", weights_only=True)["model.w"], w)
    assert torch.load(tmp_path / "t.pt", weights_only=True)["step"] == 1


def test_convert_options_prefix_rename_dtype_and_refusals(tmp_path):
    _save(tmp_path / "ss")
    rc = main(
        [
            "convert",
            str(tmp_path / "ss"),
            str(tmp_path / "hf"),
            "--to",
            "hf",
            "--prefix",
            "model.",
            "--rename",
            r"^w$ => weight",
            "--dtype",
            "bfloat16",
            "--max-shard-size",
            "40",
        ]
    )
    assert rc == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"weight", "emb"}
    from safetensors.torch import load_file

    tensors = {}
    for f in set(index["weight_map"].values()):
        tensors.update(load_file(tmp_path / "hf" / f))
    assert tensors["weight"].dtype == torch.bfloat16 and tensors["weight"].shape == (6, 4)
    assert (
        main(["convert", str(tmp_path / "ss"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    )  # exists, no --overwrite
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "x"), "--to", "torch"]) == 2


def test_hf_weights_load_straight_into_a_tensor_parallel_layout(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    q = torch.randn(8, 6)
    save_file(
        {"layers.0.q.weight": q, "norm.weight": torch.ones(6)},
        tmp_path / "hf" / "model.safetensors",
    )
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ss"), "--to", "shardsafe"]) == 0
    # TP2 column-parallel: each "rank" asks for half the rows; a ZeRO shard asks for a flat range
    for tp in range(2):
        dest = torch.zeros(4, 6)
        shardsafe.load(
            {"q": ShardedTensor.from_rank_offsets("layers.0.q.weight", dest, (0, tp, 2))},
            tmp_path / "ss",
        )
        assert torch.equal(dest, q[tp * 4 : (tp + 1) * 4])
    flat = torch.zeros(11)
    shardsafe.load(
        {
            "q": ShardedTensor.from_rank_offsets_flat(
                "layers.0.q.weight", flat, (8, 6), flattened_range=slice(5, 16)
            )
        },
        tmp_path / "ss",
    )
    assert torch.equal(flat, q.reshape(-1)[5:16])


def test_console_script_help_and_usage_errors(tmp_path):
    argvs = {"help": ["--help"], "bad": ["convert", "a", "b"]}
    procs = {  # concurrently: each interpreter spends seconds importing torch
        name: subprocess.Popen(
            [sys.executable, "-m", "shardsafe", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in argvs.items()
    }
    try:
        done = {name: (*p.communicate(timeout=120), p.returncode) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    stdout, _, rc = done["help"]
    assert rc == 0 and "examples:" in stdout and "convert" in stdout
    _, stderr, rc = done["bad"]
    assert rc == 2 and "--to" in stderr


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_missing_path_is_a_clear_error(tmp_path, capsys, cmd):
    rc = main([cmd, str(tmp_path / "missing")])
    assert rc in (1, 2) and "missing" in capsys.readouterr().err


def test_overlap_compares_resolved_local_paths_and_object_store_keys(tmp_path):
    from shardsafe.convert.publish import overlap

    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert overlap(tmp_path / "real", tmp_path / "alias") == "is"
    assert overlap(tmp_path / "real", tmp_path / "alias" / "x" / "..") == "is"
    assert overlap(tmp_path / "alias", tmp_path / "real" / "hf") == "lies inside"
    assert overlap(tmp_path / "real" / "ck", tmp_path) == "contains"
    assert overlap(tmp_path / "real", tmp_path / "realer") is None
    assert overlap("s3://b/run/ck", "s3://b/run/ck/") == "is"
    assert overlap("s3://b/run/ck", "s3://b/run/x/../ck/hf") == "lies inside"
    assert overlap("s3://b/run/ck", "s3://b/run") == "contains"
    assert overlap("s3://b/run/ck", "s3://other/run/ck") is None
    assert overlap("s3://b/run/ck", str(tmp_path / "run" / "ck")) is None


def test_convert_between_object_store_paths_refuses_overlap_before_any_io(capsys):
    # the refusal comes before the object store is reached: no server, no credentials needed
    assert main(["convert", "s3://b/run/ck", "s3://b/run/ck/../ck", "--to", "dcp"]) == 2
    err = capsys.readouterr().err
    assert "never writes where it reads" in err and "Traceback" not in err
