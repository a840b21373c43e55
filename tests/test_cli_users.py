"""What a command-line user sees: exit codes, no tracebacks, common state, plural forms."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

import shardsafe
import shardsafe.convert
import shardsafe.convert.native
from shardsafe import ShardedObject
from shardsafe.cli import build_parser, main, plural


def _save(path, lr=0.1):
    model = torch.nn.Linear(3, 2)
    state = {
        "model": model.state_dict(),
        "layout": {"tp": 2, "pp": 1},
        "opt": {"lr": lr},
        "rng": ShardedObject("rng", torch.arange(3), (1,), (0,)),
    }
    shardsafe.save(state, path)


def test_verify_of_nothing_is_unreadable_input(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_missing_s3_extra_names_the_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "fsspec", None)
    code = main(["inspect", "s3://bucket/ckpt"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.startswith("error: "), err
    assert "shardsafe[s3]" in err


def test_inspect_shows_common_state_and_counts_in_words(tmp_path, capsys):
    _save(tmp_path / "c")
    assert main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "layout.tp = 2" in out and "opt.lr = 0.1" in out
    assert "model.weight" in out and "1 piece " in out and "1 pieces" not in out
    assert main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["common"]["layout"] == {"tp": 2, "pp": 1}
    assert {t["key"] for t in info["tensors"]} == {"model.weight", "model.bias"}


def test_diff_names_the_common_keys_that_differ(tmp_path, capsys):
    _save(tmp_path / "a")
    torch.manual_seed(0)
    _save(tmp_path / "b", lr=0.2)
    main(["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert "['opt']['lr'] differs: 0.1 vs 0.2" in out


def test_convert_names_the_flag_and_help_shows_defaults(tmp_path, capsys):
    _save(tmp_path / "c")
    (tmp_path / "out.pt").write_bytes(b"x")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (
            main(["convert", str(tmp_path / "c"), str(tmp_path / "out.pt"), "--to", "torch"]) == 2
        )
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert sub["verify"].description and sub["ls"].description
    assert "default: 0.0" in sub["diff"].format_help()
    assert plural(1, "problem") == "1 problem" and plural(2, "entry") == "2 entries"


def test_exports_keep_nesting_and_name_what_they_leave_out(tmp_path):
    import torch.distributed.checkpoint as dcp

    _save(tmp_path / "c")
    with pytest.warns(UserWarning, match=r"per-rank object.*rng"):
        shardsafe.convert.export_torch(
            shardsafe.CheckpointReader(tmp_path / "c"), tmp_path / "t.pt"
        )
    flat = torch.load(tmp_path / "t.pt", weights_only=True)
    assert "model" not in flat and flat["layout.tp"] == 2 and "model.weight" in flat
    with pytest.warns(UserWarning, match=r"per-rank object.*rng"):
        shardsafe.convert.export_dcp(shardsafe.CheckpointReader(tmp_path / "c"), tmp_path / "d")
    # DCP's own load gets the nesting back, and so does reading it here
    back = {"layout": {"tp": 0, "pp": 0}, "opt": {"lr": 0.0}}
    dcp.load(back, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert back == {"layout": {"tp": 2, "pp": 1}, "opt": {"lr": 0.1}}
    source = shardsafe.convert.open_source(tmp_path / "d")
    assert source.common() == {"layout": {"tp": 2, "pp": 1}, "opt": {"lr": 0.1}}
    shardsafe.convert.native.export_shardsafe(source, tmp_path / "s")
    assert shardsafe.CheckpointReader(tmp_path / "s").common()["layout"] == {"tp": 2, "pp": 1}
