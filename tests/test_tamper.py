"""A tampered manifest whose pieces overlap or leave holes is refused, never read as garbage."""

import json
import math

import pytest
import torch

import shardsafe


def _tampered(tmp_path, mutate):
    path = tmp_path / "c"
    shardsafe.save({"w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, path)
    manifest = json.loads((path / "manifest.json").read_text())
    mutate(manifest["tensors"]["w"])
    (path / "manifest.json").write_text(json.dumps(manifest))
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
