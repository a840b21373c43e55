"""A tampered manifest whose pieces overlap or leave holes is refused, never read as garbage."""

import json
import math

import pytest
import torch
from manifests import sealed

import shardsafe
from shardsafe.cli import main


def _tampered(tmp_path, mutate):
    path = tmp_path / "c"
    shardsafe.save({"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, path)
    manifest = json.loads((path / "manifest.json").read_text())
    mutate(manifest["tensors"]["w"])
    (path / "manifest.json").write_bytes(sealed(manifest))
    return path


def _half_twice(entry):
    piece = entry["pieces"][0]
    half = dict(piece, shape=[2], nbytes=8)
    entry["pieces"] = [half, dict(half)]


def _half_only(entry):
    entry["pieces"] = [dict(entry["pieces"][0], shape=[2], nbytes=8)]


@pytest.mark.parametrize("mutate", [_half_twice, _half_only], ids=["overlap", "hole"])
def test_overlapping_or_incomplete_pieces_are_refused(tmp_path, mutate):
    path = _tampered(tmp_path, mutate)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="'w'"):
        shardsafe.CheckpointReader(path).read_tensor("w")
    with pytest.raises(shardsafe.CorruptCheckpointError, match="'w'"):
        shardsafe.load({"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, path)
    try:  # overlapping extents are refused while parsing; a hole is reported by verify
        ok = shardsafe.CheckpointReader(path).verify().ok
    except shardsafe.CorruptCheckpointError as e:
        ok, _ = False, str(e)
    assert not ok


def test_content_metadata_must_fit_the_manifest(tmp_path):
    sd = {"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}
    with pytest.raises(shardsafe.ValidationError, match="content_metadata"):
        shardsafe.save(sd, tmp_path / "c", content_metadata={"bad": b"bytes need a blob"})
    assert not (tmp_path / "c").exists()
    shardsafe.save(sd, tmp_path / "nan", content_metadata={"nan": float("nan")})  # tagged
    assert math.isnan(shardsafe.load_content_metadata(tmp_path / "nan")["nan"])
    shardsafe.save(sd, tmp_path / "c", content_metadata={"layout": "tp2", "v": [1, 2]})
    assert shardsafe.load_content_metadata(tmp_path / "c") == {"layout": "tp2", "v": [1, 2]}


# --------------------------------------------------------------------------- the manifest's digest


def _saved(path):
    sd = {"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "step": 5}
    shardsafe.save(sd, path)
    return (path / "manifest.json").read_bytes()


def _flip(raw, at):
    """``raw`` with the hex digit at ``at`` changed."""
    return raw[:at] + (b"1" if raw[at : at + 1] == b"0" else b"0") + raw[at + 1 :]


EDITS = {
    "step": lambda raw: raw.replace(b'["step",5]', b'["step",6]'),
    "created": lambda raw: raw.replace(b'"created":"2', b'"created":"1'),
    "block checksum": lambda raw: _flip(raw, raw.index(b'"checksums":["') + 14),
    "digest itself": lambda raw: _flip(raw, len(raw) - 3),
    "re-indented": lambda raw: json.dumps(json.loads(raw), indent=1).encode(),
    "newline added": lambda raw: raw + b"\n",
    "digest moved first": lambda raw: (
        b'{"manifest_digest":"'
        + raw[-18:-2]
        + b'",'
        + raw[1 : raw.rindex(b',"manifest_digest"')]
        + b"}"
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_manifest_is_corrupt_everywhere(tmp_path, edit):
    path = tmp_path / "c"
    raw = _saved(path)
    edited = EDITS[edit](raw)
    assert edited != raw and json.loads(edited)["manifest_digest"]
    (path / "manifest.json").write_bytes(edited)
    where = str(path / "manifest.json")
    template = {"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.zeros(4)), "step": 0}
    for read in (
        lambda: shardsafe.load(template, path),
        lambda: shardsafe.load_metadata(path),
        lambda: shardsafe.CheckpointReader(path),
    ):
        with pytest.raises(shardsafe.CorruptCheckpointError, match="manifest_digest") as info:
            read()
        assert where in str(info.value)


def test_verify_and_restore_refuse_an_edited_step(tmp_path, capsys):
    manager = shardsafe.CheckpointManager(tmp_path, async_save=False)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((3,), float(step)), "step": step})
    manifest = tmp_path / "step_000000002" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'["step",2]', b'["step",7]'))
    assert main(["verify", str(manifest.parent)]) == 1
    err = capsys.readouterr().err
    assert str(manifest) in err and "does not match its manifest_digest" in err
    state = shardsafe.CheckpointManager(tmp_path).restore({"w": torch.zeros(3), "step": 0})
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))  # fell back


def test_a_manifest_written_without_a_digest_still_reads(tmp_path, capsys):
    path = tmp_path / "c"
    raw = _saved(path)
    old = raw[: raw.rindex(b',"manifest_digest"')] + b"}"  # as shardsafe wrote it before
    (path / "manifest.json").write_bytes(old)
    out = shardsafe.load({"w": torch.zeros(4), "step": 0}, path)
    assert out["step"] == 5 and torch.equal(out["w"], torch.arange(4.0))
    reader = shardsafe.CheckpointReader(path)
    assert reader.manifest.digest is None
    report = reader.verify()
    assert report.ok and "no manifest_digest" in report.notes[0]
    assert main(["verify", str(path)]) == 0
    assert "note: manifest.json has no manifest_digest" in capsys.readouterr().err
    assert shardsafe.CheckpointReader(tmp_path / "c").manifest.digest is None
    (path / "manifest.json").write_bytes(raw)
    assert shardsafe.CheckpointReader(path).manifest.digest == json.loads(raw)["manifest_digest"]
