"""Every supported element type round-trips bit-exactly, resharded."""

import pytest
import torch

import shardsafe
from shardsafe.dtypes import supported_dtypes


def sample(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (6, 10), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        return raw % 2 == 1
    if dtype.is_complex:
        return torch.randn(6, 10, generator=g, dtype=dtype)
    if dtype.itemsize == 1:
        return raw.view(dtype)  # every bit pattern, NaNs of float8 included
    return torch.randint(0, 256, (6, 10 * dtype.itemsize), generator=g, dtype=torch.uint8).view(
        dtype
    )


@pytest.mark.parametrize("dtype", supported_dtypes(), ids=lambda d: str(d).removeprefix("torch."))
def test_dtype_round_trip_resharded(tmp_path, dtype):
    full = sample(dtype)
    shardsafe.save(
        {
            f"p{r}": shardsafe.ShardedTensor.from_rank_offsets(
                "x", full[r * 3 : r * 3 + 3].clone(), (0, r, 2)
            )
            for r in range(2)
        },
        tmp_path / "c",
    )
    dest = torch.zeros(37, dtype=dtype)
    out = shardsafe.load(
        {
            "x": shardsafe.ShardedTensor.from_rank_offsets_flat(
                "x", dest, (6, 10), flattened_range=slice(11, 48)
            )
        },
        tmp_path / "c",
    )
    assert torch.equal(out["x"].view(torch.uint8), full.reshape(-1)[11:48].view(torch.uint8))
    got = shardsafe.CheckpointReader(tmp_path / "c").read_tensor("x")
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), full.view(torch.uint8))


def test_float8_family_is_covered():
    names = {str(d) for d in supported_dtypes()}
    assert {"torch.float8_e4m3fn", "torch.float8_e5m2", "torch.bfloat16", "torch.bool"} <= names


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_lazily_conjugated_and_negated_views_store_their_values(tmp_path, mode):
    """``t.conj()`` and ``torch._neg_view`` only set a bit; their bytes are resolved first."""
    c = torch.complex(torch.arange(12.0), torch.arange(12.0) + 0.5)
    state = {"c": c.conj(), "n": torch._neg_view(torch.arange(4.0))}
    saver = shardsafe.Saver()
    try:
        if mode == "save":
            saver.save(state, tmp_path / "ck")
        else:
            saver.async_save(state, tmp_path / "ck").result()
    finally:
        saver.close()
    out = shardsafe.load(
        {"c": torch.zeros(12, dtype=torch.complex64), "n": torch.zeros(4)}, tmp_path / "ck"
    )
    assert torch.equal(out["c"], c.conj().resolve_conj())
    assert torch.equal(out["n"], -torch.arange(4.0))
