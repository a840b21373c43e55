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
    # imported already when an earlier test used object storage: import it again, without
    monkeypatch.delitem(sys.modules, "shardsafe.storage.fsspec", raising=False)
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


def test_ls_lists_checkpoints_only_and_shows_damage_marks(tmp_path, capsys):
    from shardsafe.directory import StepDirectory

    root = tmp_path / "run"
    for step in (10, 20):
        _save(root / f"step_{step:09d}")
    (root / "logs").mkdir()  # not a checkpoint: never listed
    (root / "tokenizer" / "sub").mkdir(parents=True)
    (root / "latest").write_text("step_000000020\n")
    StepDirectory(root).mark_damaged("step_000000020", "checksum mismatch in data/x.bin")
    assert main(["ls", str(root), "--json"]) == 0
    rows = {r["name"]: r["state"] for r in json.loads(capsys.readouterr().out)}
    assert rows == {"step_000000010": "committed", "step_000000020": "damaged"}


@pytest.mark.parametrize("cmd", ["ls", "inspect", "verify", "diff", "convert"])
def test_a_missing_path_gets_one_message_from_every_command(tmp_path, capsys, cmd):
    missing = str(tmp_path / "nope")
    argv = {"diff": [missing, missing], "convert": [missing, str(tmp_path / "o"), "--to", "torch"]}
    assert main([cmd, *argv.get(cmd, [missing])]) == 2
    assert capsys.readouterr().err == f"error: {missing}: no such file or directory\n"


def test_verify_takes_a_manager_root_and_its_latest(tmp_path, capsys):
    root = tmp_path / "ckpt"
    manager = shardsafe.CheckpointManager(root, keep_last=3, async_save=False)
    for step in (1, 2):
        manager.save(step, {"model": torch.nn.Linear(3, 2).state_dict(), "step": step})
    manager.close()
    assert main(["verify", str(root / "latest")]) == 0
    out = capsys.readouterr().out
    assert "-> step_000000002" in out and "OK " in out
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 2 and "2 of 2 committed checkpoints intact" in out
    reader = shardsafe.CheckpointReader(root / "step_000000001")
    extent = next(iter(reader.manifest.tensors.values())).pieces[0].extent
    data = root / "step_000000001" / extent.file
    raw = bytearray(data.read_bytes())
    raw[extent.byte_offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["verify", str(root)]) == 1
    captured = capsys.readouterr()
    assert "1 of 2 committed checkpoints intact, 1 damaged" in captured.out
    assert "FAILED" in captured.err and "step_000000001" in captured.err
    assert main(["verify", str(root / "latest")]) == 0  # step 2 is intact
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 2


def _trained_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 3,
        "pair": [torch.ones(2), 5],
    }


def test_inspect_shows_no_placeholders_of_tensors(tmp_path, capsys):
    shardsafe.save(_trained_state(), tmp_path / "c")
    assert main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    common = out.split("common state:")[1]
    assert "None" not in common and "model = {}" not in common and "state.0 = {}" not in common
    assert "pair = [<tensor>, 5]" in common and "step = 3" in common
    assert "optim.param_groups = " in common


@pytest.mark.parametrize("fmt", ["torch", "dcp", "megatron", "hf", "shardsafe"])
def test_diff_of_an_export_against_its_source_is_equal(tmp_path, capsys, fmt):
    shardsafe.save(_trained_state(), tmp_path / "c")
    out = tmp_path / ("e.pt" if fmt == "torch" else "e")
    assert main(["convert", str(tmp_path / "c"), str(out), "--to", fmt]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "c"), str(out)]) == 0, capsys.readouterr().out
    # a real difference in the common state is still found
    state = _trained_state()
    state["optim"]["param_groups"][0]["lr"] = 0.5
    shardsafe.save(state, tmp_path / "c2")
    capsys.readouterr()
    if fmt != "hf":
        assert main(["diff", str(tmp_path / "c2"), str(out)]) == 1
        assert "['optim']['param_groups'][0]['lr'] differs: 0.5 vs 0.001" in capsys.readouterr().out


def test_hf_export_names_the_common_state_it_leaves_out(tmp_path, capsys):
    shardsafe.save(_trained_state(), tmp_path / "c")
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "UserWarning" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("warning: export_hf")]
    assert "optim.param_groups" in line and "step" in line and "pair" in line
    with pytest.warns(UserWarning, match=r"not exported.*optim\.param_groups.*step"):
        shardsafe.convert.export_hf(shardsafe.CheckpointReader(tmp_path / "c"), tmp_path / "hf2")


def test_a_shardsafe_export_keeps_the_content_metadata(tmp_path, capsys):
    """``convert --to shardsafe`` (whole or a selection of keys) carries the source's
    ``content_metadata`` over, exactly (tuples and int keys included), as a Megatron export does."""
    content = {"singleton_local_shards": False, "layout": ("tp", 2), 3: "three"}
    shardsafe.save(_trained_state(), tmp_path / "c", content_metadata=content)
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "s"), "--to", "shardsafe"]) == 0
    assert shardsafe.load_content_metadata(tmp_path / "s") == content
    picked = shardsafe.convert.SelectedSource(
        shardsafe.CheckpointReader(tmp_path / "c"), dtype=torch.bfloat16
    )
    shardsafe.convert.native.export_shardsafe(picked, tmp_path / "p")
    assert shardsafe.load_content_metadata(tmp_path / "p") == content
