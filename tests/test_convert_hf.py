"""Hugging Face safetensors folders: the streaming writer, the reader, and transformers loading them."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch

from shardsafe.convert import (
    DictSource,
    HfSource,
    TorchFileSource,
    detect_format,
    export_hf,
    export_torch,
    parse_rename_rules,
    parse_size,
)
from shardsafe.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleRequestError,
)


def _all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g)
    tensors = {
        "f64": base.double(),
        "f32": base,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "i64": torch.arange(-7, 8, dtype=torch.int64).reshape(3, 5),
        "i32": torch.arange(15, dtype=torch.int32),
        "i16": torch.arange(15, dtype=torch.int16),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": base > 0,
        "c64": torch.complex(base, -base),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        tensors[name] = base.to(getattr(torch, name))
    for name in ("uint16", "uint32", "uint64"):
        tensors[name] = torch.arange(6).to(getattr(torch, name))
    return tensors


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality for every dtype, float8 included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy()
    )


def test_writer_is_read_by_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = _all_dtypes()
    export_hf(DictSource(tensors), tmp_path)
    path = tmp_path / "model.safetensors"
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert _equal(loaded[key], tensor), key
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert _equal(f.get_tensor("bf16"), tensors["bf16"])
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    assert header_len % 8 == 0
    # Wider elements first, so every tensor's data starts aligned to its element size.
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    for name, info in header.items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % tensors[name].element_size() == 0, name

    source = HfSource(tmp_path)
    assert sorted(source.tensor_keys()) == sorted(tensors)
    for key, tensor in tensors.items():
        assert source.tensor_meta(key) == (tuple(tensor.shape), tensor.dtype)
        assert _equal(source.read_tensor(key), tensor), key
    assert _equal(HfSource(path).read_tensor("c64"), tensors["c64"])


def test_reader_reads_safetensors_files(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {k: v for k, v in _all_dtypes().items() if k != "empty"}
    save_file(tensors, tmp_path / "weights.safetensors", metadata={"format": "pt"})
    source = HfSource(tmp_path)
    assert (
        detect_format(tmp_path) == "hf" and detect_format(tmp_path / "weights.safetensors") == "hf"
    )
    for key, tensor in tensors.items():
        assert _equal(source.read_tensor(key), tensor), key


def test_sharding_index_and_round_trip_through_torch(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {f"layers.{i}.weight": torch.randn(16, 16, generator=g) for i in range(6)}
    tensors["norm"] = torch.ones(16, dtype=torch.bfloat16)
    written = export_hf(DictSource(tensors), tmp_path / "a", max_shard_size="2100B")
    names = sorted(p.name for p in written)
    assert names[-1] == "model.safetensors.index.json"
    assert (
        all(re.fullmatch(r"model-0000\d-of-00003\.safetensors", n) for n in names[:-1])
        and len(names) == 4
    )
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    for file in set(index["weight_map"].values()):  # data within the limit, plus a header
        assert (tmp_path / "a" / file).stat().st_size <= 2100 + 1024

    # HF -> torch -> HF, exact.
    export_torch(HfSource(tmp_path / "a"), tmp_path / "m.pt")
    export_hf(TorchFileSource(tmp_path / "m.pt"), tmp_path / "b")
    back = HfSource(tmp_path / "b")
    assert (tmp_path / "b" / "model.safetensors").is_file()
    assert sorted(back.tensor_keys()) == sorted(tensors)
    for key, tensor in tensors.items():
        assert _equal(back.read_tensor(key), tensor), key


def test_prefix_rename_dtype(tmp_path: Path) -> None:
    tensors = {
        "model.embed.weight": torch.randn(4, 3),
        "model.layers.0.attn.q.weight": torch.randn(3, 3),
        "model.layers.0.attn.k.weight": torch.randn(3, 3),
        "model.steps": torch.arange(3),
        "optimizer.exp_avg": torch.randn(3),
        "modelx.other": torch.randn(2),
    }
    rules = parse_rename_rules(
        r"""
        # attention projections get HF names
        attn\.(q|k)\.weight => self_attn.\1_proj.weight
        ^embed\. => embed_tokens.
        ^steps$ =>
        """
    )
    export_hf(DictSource(tensors), tmp_path, prefix="model", rename=rules, dtype=torch.bfloat16)
    source = HfSource(tmp_path)
    assert sorted(source.tensor_keys()) == [
        "embed_tokens.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.q_proj.weight",
    ]
    q = source.read_tensor("layers.0.self_attn.q_proj.weight")
    assert q.dtype == torch.bfloat16 and torch.equal(
        q, tensors["model.layers.0.attn.q.weight"].bfloat16()
    )

    export_hf(
        DictSource(tensors),
        tmp_path / "fn",
        prefix="model.",
        rename=lambda n: None if "layers" in n else n.upper(),
    )
    assert sorted(HfSource(tmp_path / "fn").tensor_keys()) == ["EMBED.WEIGHT", "STEPS"]
    assert HfSource(tmp_path / "fn").tensor_meta("STEPS")[1] == torch.int64  # only floats are cast

    with pytest.raises(IncompatibleRequestError, match="both be written"):
        export_hf(
            DictSource(tensors),
            tmp_path / "c",
            rename=[(r"^model\.embed\.weight$", "x"), (r"^modelx\.other$", "x")],
        )
    with pytest.raises(IncompatibleRequestError, match="no tensor lies under prefix 'decoder'"):
        export_hf(DictSource(tensors), tmp_path / "d", prefix="decoder")
    with pytest.raises(IncompatibleRequestError, match="line 1"):
        parse_rename_rules("no arrow here\n")
    with pytest.raises(IncompatibleRequestError, match="bad regex"):
        parse_rename_rules("( => x")
    rules_file = tmp_path / "rules.txt"
    rules_file.write_text("a => b\n")
    assert [(p.pattern, r) for p, r in parse_rename_rules(rules_file)] == [("a", "b")]
    assert [(p.pattern, r) for p, r in parse_rename_rules(str(rules_file))] == [("a", "b")]


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5kb") == 1500
    assert parse_size(1024) == 1024
    assert parse_size("77") == 77
    for bad in ("five", "0", "-3GB"):
        with pytest.raises(IncompatibleRequestError):
            parse_size(bad)


def test_overwrite_and_unsupported_dtype(tmp_path: Path) -> None:
    source = DictSource({"a": torch.ones(4), "b": torch.zeros(4)})
    export_hf(source, tmp_path, max_shard_size=16)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match="overwrite"):
        export_hf(source, tmp_path)
    export_hf(source, tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]

    with pytest.raises(IncompatibleRequestError, match="complex128"):
        export_hf(DictSource({"z": torch.zeros(2, dtype=torch.complex128)}), tmp_path / "z")


def test_damaged_folders(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        HfSource(tmp_path / "absent")
    export_hf(
        DictSource({"a": torch.arange(100.0), "b": torch.ones(3)}), tmp_path, max_shard_size=100
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = tmp_path / index["weight_map"]["a"]
    data = victim.read_bytes()
    victim.write_bytes(data[:-8])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        HfSource(tmp_path).read_tensor("a")
    victim.write_bytes(b"\xff" * 16)
    with pytest.raises(CorruptCheckpointError, match="header"):
        HfSource(tmp_path)
    victim.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        HfSource(tmp_path)
    index["weight_map"]["a"] = "../elsewhere.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="outside"):
        HfSource(tmp_path)


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.timeout(120)
def test_tiny_llama_loads_with_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import LlamaForCausalLM

    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits

    # The state dict as a training checkpoint would hold it: under a prefix, a torch.save file.
    state = {f"module.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "train.pt")
    for name, shard_size in (("single", "5GB"), ("sharded", "40KB")):
        out = tmp_path / name
        export_hf(
            TorchFileSource(tmp_path / "train.pt"), out, prefix="module", max_shard_size=shard_size
        )
        model.config.save_pretrained(out)
        assert (out / "model.safetensors.index.json").is_file() == (name == "sharded")
        reloaded = LlamaForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, expected), name

    # What transformers itself writes reads back exactly.
    model.save_pretrained(tmp_path / "native")
    native = HfSource(tmp_path / "native")
    for key, value in model.state_dict().items():
        if key in native.tensor_keys():
            assert torch.equal(native.read_tensor(key), value), key
