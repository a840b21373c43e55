"""Save with 4 gloo ranks (TP2 x DP2, distributed-optimizer flat shards, uneven splits);
load with 1, 2 and 3 ranks in other layouts."""

import pytest
import torch
from distributed import run_ranks

import shardsafe

W_SHAPE = (12, 10)
U_ROWS = [0, 1, 4, 6, 7]  # uneven split of a (7, 5) tensor over 4 ranks


def full(name):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    shapes = {"w": W_SHAPE, "exp_avg": W_SHAPE, "u": (7, 5), "bias": (10,), "half": (6, 4)}
    return torch.randn(shapes[name], generator=g)


def flat_piece(key, tensor, chunk_offset, chunk_shape, start, stop, replica_id=0):
    chunk = tensor[tuple(slice(o, o + s) for o, s in zip(chunk_offset, chunk_shape))]
    data = chunk.reshape(-1)[start:stop].clone()
    return shardsafe.ShardedTensor.from_global_offset(
        key,
        data,
        tensor.shape,
        chunk_offset,
        flattened_range=slice(start, stop),
        local_shape=chunk_shape,
        replica_id=replica_id,
    )


def save_tp2_dp2(rank, world, path):
    tp, dp = rank % 2, rank // 2
    w, ea, u, bias = full("w"), full("exp_avg"), full("u"), full("bias")
    rows = W_SHAPE[0] // 2
    a, b = [(0, 27), (27, 60)][dp]  # the DP cut falls in the middle of a row of the TP chunk
    sd = {
        "w": shardsafe.ShardedTensor.from_rank_offsets(
            "w", w[tp * rows : (tp + 1) * rows].clone(), (0, tp, 2), replica_id=dp
        ),
        "bias": shardsafe.ShardedTensor.from_rank_offsets("bias", bias.clone(), replica_id=rank),
        "optim": {"exp_avg": flat_piece("exp_avg", ea, (tp * rows, 0), (rows, 10), a, b)},
        "u": shardsafe.ShardedTensor.from_global_offset(
            "u", u[U_ROWS[rank] : U_ROWS[rank + 1]].clone(), (7, 5), (U_ROWS[rank], 0)
        ),
        "half": shardsafe.ShardedTensor.from_rank_offsets(
            "half", full("half")[:, rank : rank + 1].to(torch.bfloat16).clone(), (1, rank, 4)
        ),
        "rng": shardsafe.ShardedObject(
            "rng", {"rank": rank, "state": torch.full((3,), rank)}, (4,), (rank,)
        ),
        "step": 11,
    }
    stats = shardsafe.save(sd, path)
    return stats.bytes_written


def request(rank, world):
    """Each load world size uses its own layout."""
    w, ea, u = full("w"), full("exp_avg"), full("u")
    if world == 1:
        return {
            "w": shardsafe.ShardedTensor.from_rank_offsets("w", torch.zeros(W_SHAPE)),
            "exp_avg": shardsafe.ShardedTensor.from_rank_offsets("exp_avg", torch.zeros(W_SHAPE)),
            "u": shardsafe.ShardedTensor.from_rank_offsets("u", torch.zeros(7, 5)),
        }, {"w": w, "exp_avg": ea, "u": u}
    if world == 2:  # TP1 x DP2: full weight replicated, flat optimizer ranges over the whole tensor
        a, b = [(0, 50), (50, 120)][rank]
        return {
            "w": shardsafe.ShardedTensor.from_rank_offsets(
                "w", torch.zeros(W_SHAPE), replica_id=rank
            ),
            "exp_avg": shardsafe.ShardedTensor.from_rank_offsets_flat(
                "exp_avg", torch.zeros(b - a), W_SHAPE, flattened_range=slice(a, b)
            ),
            "u": shardsafe.ShardedTensor.from_global_offset(
                "u", torch.zeros(7, [3, 2][rank]), (7, 5), (0, [0, 3][rank])
            ),
        }, {"w": w, "exp_avg": ea.reshape(-1)[a:b], "u": u[:, [0, 3][rank] : [3, 5][rank]]}
    # world 3: uneven column split of w; flat thirds of a TP3-by-columns chunk for exp_avg; u flattened
    cols = [0, 3, 7, 10]
    c0, c1 = cols[rank], cols[rank + 1]
    flat = [(0, 20), (20, 41), (5, 36)][rank]  # inside chunks of 36, 48 and 36 elements
    ua, ub = [(0, 12), (12, 13), (13, 35)][rank]
    chunk = ea[:, c0:c1]
    return {
        "w": shardsafe.ShardedTensor.from_global_offset(
            "w", torch.zeros(12, c1 - c0), W_SHAPE, (0, c0)
        ),
        "exp_avg": shardsafe.ShardedTensor.from_global_offset(
            "exp_avg",
            torch.zeros(flat[1] - flat[0]),
            W_SHAPE,
            (0, c0),
            flattened_range=slice(*flat),
            local_shape=(12, c1 - c0),
        ),
        "u": shardsafe.ShardedTensor.from_rank_offsets_flat(
            "u", torch.zeros(ub - ua), (7, 5), flattened_range=slice(ua, ub)
        ),
    }, {
        "w": w[:, c0:c1],
        "exp_avg": chunk.reshape(-1)[flat[0] : flat[1]],
        "u": u.reshape(-1)[ua:ub],
    }


def load_and_check(rank, world, path):
    template, want = request(rank, world)
    template["rng"] = shardsafe.ShardedObject("rng", None, (4,), (rank,))
    out = shardsafe.load(template, path)
    for key, value in want.items():
        assert torch.equal(out[key], value), (rank, key)
        assert out[key] is template[key].data
    assert out["rng"]["rank"] == rank and torch.equal(out["rng"]["state"], torch.full((3,), rank))
    assert out["step"] == 11
    return True


@pytest.mark.timeout(240)
def test_save_4_ranks_load_1_2_3(tmp_path):
    path = str(tmp_path / "ck")
    written = run_ranks(save_tp2_dp2, 4, path, timeout=120)
    # each unique piece is written once; replicated w/bias writing is spread over replicas
    assert all(b > 0 for b in written)
    reader = shardsafe.CheckpointReader(path)
    for key in ("w", "exp_avg", "u", "bias"):
        assert torch.equal(reader.read_tensor(key), full(key))
    assert torch.equal(reader.read_tensor("half"), full("half").to(torch.bfloat16))
    assert reader.verify().ok
    stored = reader.manifest.tensors
    assert (
        len(stored["w"].pieces) == 2
        and len(stored["bias"].pieces) == 1
        and len(stored["exp_avg"].pieces) == 4
    )
    load_and_check(0, 1, path)  # one process, no process group
    run_ranks(load_and_check, 2, path, timeout=120)
    run_ranks(load_and_check, 3, path, timeout=120)


def _balanced(rank, world, path):
    big = torch.full((1 << 16,), float(rank % 2))
    # 4 ranks hold 2 replicated copies of 2 pieces: each of the 4 ranks should write about half a piece's worth
    tp, dp = rank % 2, rank // 2
    sd = {
        f"t{i}": shardsafe.ShardedTensor.from_rank_offsets(
            f"t{i}", torch.full((1 << 14,), float(i)), replica_id=rank
        )
        for i in range(8)
    }
    sd["big"] = shardsafe.ShardedTensor.from_rank_offsets(
        "big", big[: 1 << 15].clone() * 0 + tp, (0, tp, 2), replica_id=dp
    )
    return shardsafe.save(sd, path).bytes_written


@pytest.mark.timeout(120)
def test_replicated_writes_are_spread_over_replicas(tmp_path):
    written = run_ranks(_balanced, 4, str(tmp_path / "ck"), timeout=90)
    # 2 big pieces of 128 KiB + 8 small of 64 KiB = 768 KiB over 4 ranks: no rank writes more than ~1/3
    assert max(written) < 0.4 * sum(written), written
    assert min(written) > 0, written
