"""DTensor state dicts: geometry against torch's own sharding, and FSDP2 / tensor-parallel /
plain modules saving and loading into each other, uneven and empty shards included."""

import itertools

import pytest
import torch
import torch.nn as nn
from distributed import run_ranks

import shardsafe
from shardsafe.integrations import (
    dtensor_aware,
    dtensor_local_boxes,
    has_dtensor,
    to_sharded_state_dict,
)

placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
Shard, Replicate, Partial = (
    placement_types.Shard,
    placement_types.Replicate,
    placement_types.Partial,
)
StridedShard = placement_types._StridedShard


class Net(nn.Module):
    """Odd sizes on purpose: 7 rows over 2 ranks split 4 + 3, ``gate``'s single row leaves
    rank 1 of an FSDP2 mesh an empty shard."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)
        self.gate = nn.Parameter(torch.randn(1, 3))
        self.register_buffer("counts", torch.arange(4.0) + seed)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.gate


def reference():
    return {k: v.clone() for k, v in Net(0).state_dict().items()}


# --------------------------------------------------------------------------- geometry


def _split_like_torch(full, mesh_shape, coord, placements):
    """The local shard DTensor itself would give, from its placements' own split code."""
    t = full
    for size, c, p in zip(mesh_shape, coord, placements):
        if not isinstance(p, Replicate):
            t = p._split_tensor(t, size, with_padding=False, contiguous=True)[0][c]
    return t


def test_local_boxes_match_torch_sharding():
    multi = 0
    for shape in [(7,), (7, 5), (5, 3), (1, 4), (9, 2)]:
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
        choices += [StridedShard(d, split_factor=s) for d in range(len(shape)) for s in (2, 3)]
        for mesh_shape in [(2,), (3,), (2, 2), (3, 2)]:
            for placements in itertools.product(choices, repeat=len(mesh_shape)):
                for coord in itertools.product(*[range(s) for s in mesh_shape]):
                    local = _split_like_torch(full, mesh_shape, coord, placements)
                    boxes = dtensor_local_boxes(shape, mesh_shape, coord, placements)
                    assert sum(torch.Size(b.shape).numel() for b in boxes) == local.numel()
                    for b in boxes:
                        lo = tuple(slice(o, o + n) for o, n in zip(b.local_offset, b.shape))
                        gl = tuple(slice(o, o + n) for o, n in zip(b.global_offset, b.shape))
                        assert torch.equal(local[lo], full[gl]), (shape, placements, coord, b)
                    multi += len(boxes) > 1
    assert multi > 100  # strided placements that leave several boxes were exercised


def test_uneven_split_and_partial_refused():
    boxes = [dtensor_local_boxes((7, 5), (2,), (r,), [Shard(0)]) for r in range(2)]
    assert [(b[0].global_offset, b[0].shape) for b in boxes] == [((0, 0), (4, 5)), ((4, 0), (3, 5))]
    assert dtensor_local_boxes((1, 3), (2,), (1,), [Shard(0)]) == []  # empty shard
    with pytest.raises(ValueError, match="partial"):
        dtensor_local_boxes((4,), (2,), (0,), [Partial()])


def test_plain_state_dict_without_distributed(tmp_path):
    sd = to_sharded_state_dict(Net(0).state_dict(), prefix="m.")
    assert not has_dtensor(Net(0).state_dict())
    assert sd["fc1.weight"].key == "m.fc1.weight" and sd["fc1.weight"].replica_id == 0
    shardsafe.save(sd, tmp_path / "c")
    other = Net(1)
    shardsafe.load(to_sharded_state_dict(other.state_dict(), prefix="m."), tmp_path / "c")
    for k, v in reference().items():
        assert torch.equal(other.state_dict()[k], v), k


# --------------------------------------------------------------------------- 2 ranks


def _fsdp2(seed, mesh):
    from torch.distributed.fsdp import fully_shard

    m = Net(seed)
    fully_shard(m.fc1, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _tp(seed, mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    m = Net(seed)
    parallelize_module(m, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return m


def _full(sd):
    """Whole tensors as numpy arrays (tensors would travel back through shared memory).

    Collective: every rank calls it with the same keys."""
    return {k: (_gathered(v) if hasattr(v, "to_local") else v).numpy() for k, v in sd.items()}


def _gathered(dt):
    """The whole tensor of DTensor ``dt``, assembled from every rank's local shard.

    Each element's place comes from splitting an index tensor with torch's own split code for
    ``dt``'s placements (:func:`_split_like_torch`), not from ``full_tensor()``: its
    redistribution of ``_StridedShard`` fails on some torch releases (2.11)."""
    import torch.distributed as dist

    mesh = dt.device_mesh
    index = torch.arange(dt.numel()).reshape(dt.shape)
    local_index = _split_like_torch(index, mesh.shape, mesh.get_coordinate(), dt.placements)
    mine = (local_index.reshape(-1).cpu(), dt.to_local().detach().reshape(-1).cpu())
    pieces: list = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    full = torch.zeros(dt.numel(), dtype=dt.dtype)
    covered = torch.zeros(dt.numel(), dtype=torch.bool)
    for idx, values in pieces:
        full[idx] = values
        covered[idx] = True
    assert bool(covered.all()), "the local shards do not cover the whole tensor"
    return full.reshape(dt.shape)


def _two_ranks(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    ref = reference()
    checks: dict = {}

    # FSDP2 saves; the empty shard of `gate` on rank 1 and the 4 + 3 split of fc1 included.
    fsdp = _fsdp2(0, mesh)
    sd = to_sharded_state_dict(fsdp.state_dict())
    assert type(sd["gate"]).__name__ == ("ShardedTensor" if rank == 0 else "ShardedTensorFactory")
    shardsafe.save(sd, f"{root}/fsdp")

    # (a) into FSDP2 on the same mesh, (b) into tensor parallel; both fill in place.
    for name, build in (("fsdp", _fsdp2), ("tp", _tp)):
        model = build(1, mesh)
        live = model.state_dict()
        loaded = shardsafe.load(to_sharded_state_dict(live), f"{root}/fsdp")
        checks[name] = _full(model.state_dict())
        lt = getattr(live["fc1.weight"], "_local_tensor", live["fc1.weight"])
        assert loaded["fc1.weight"].data_ptr() == lt.data_ptr()

    # Tensor parallel saves too (fc2.bias is Replicate(): replica ids 0 and 1).
    tp = _tp(0, mesh)
    shardsafe.save(to_sharded_state_dict(tp.state_dict()), f"{root}/tp")

    # dtensor_aware: DTensors nested in a larger sharded state dict, returned as DTensors.
    shardsafe.save(dtensor_aware({"model": fsdp.state_dict(), "step": 3}), f"{root}/aware")
    tp2 = _tp(1, mesh)
    live = tp2.state_dict()
    out = shardsafe.load(dtensor_aware({"model": live}), f"{root}/aware")
    assert out["step"] == 3 and out["model"]["fc1.weight"] is live["fc1.weight"]
    # TP leaves `gate` a plain tensor: a whole replicated tensor, filled in place too
    assert torch.equal(live["gate"], ref["gate"])
    checks["aware"] = {k: v for k, v in _full(tp2.state_dict()).items() if k.startswith("fc")}

    # No wrapper at all: save/load apply dtensor_aware themselves.
    shardsafe.save({"model": fsdp.state_dict(), "step": 4}, f"{root}/direct")
    tp3 = _tp(1, mesh)
    out = shardsafe.load({"model": tp3.state_dict()}, f"{root}/direct")
    assert out["step"] == 4
    checks["direct"] = {k: v for k, v in _full(tp3.state_dict()).items() if k.startswith("fc")}

    # A strided placement whose local shard is two separate boxes (rows 0-1 and 4-5 of 8).
    full = torch.arange(40.0).reshape(8, 5)
    strided = distribute_tensor(full, mesh, [StridedShard(0, split_factor=2)])
    pieces = to_sharded_state_dict({"s": strided})["s"]
    assert type(pieces).__name__ == "ShardedTensorFactory" and len(pieces.build()) == 2
    shardsafe.save({"s": pieces}, f"{root}/strided")
    into = distribute_tensor(torch.zeros(8, 5), mesh, [Shard(0)])
    shardsafe.load(to_sharded_state_dict({"s": into}), f"{root}/strided")
    checks["strided"] = _full({"s": into})
    back = distribute_tensor(torch.zeros(8, 5), mesh, [StridedShard(0, split_factor=2)])
    shardsafe.load(to_sharded_state_dict({"s": back}), f"{root}/strided")
    checks["strided_back"] = _full({"s": back})
    assert all(
        torch.equal(torch.from_numpy(v), ref[k]) for k, v in _full(fsdp.state_dict()).items()
    )
    return checks


@pytest.mark.timeout(120)
def test_fsdp2_tp_and_plain_load_each_other(tmp_path):
    results = run_ranks(_two_ranks, 2, str(tmp_path), timeout=110)
    ref = reference()
    for rank_checks in results:
        for name in ("fsdp", "tp", "aware", "direct"):
            for k, v in rank_checks[name].items():
                assert torch.equal(torch.from_numpy(v), ref[k]), (name, k)
        for name in ("strided", "strided_back"):
            assert torch.equal(
                torch.from_numpy(rank_checks[name]["s"]), torch.arange(40.0).reshape(8, 5)
            )
    # (c) a plain module in this single process, from either mesh's checkpoint
    for ck in ("fsdp", "tp"):
        plain = Net(2)
        shardsafe.load(to_sharded_state_dict(plain.state_dict()), tmp_path / ck)
        for k, v in ref.items():
            assert torch.equal(plain.state_dict()[k], v), (ck, k)


# --------------------------------------------------------------------------- 4 ranks, 2-D


def _fsdp2_tp(seed, mesh):
    from torch.distributed.fsdp import fully_shard

    m = _tp(seed, mesh["tp"])
    fully_shard(m, mesh=mesh["dp"])
    return m


def _four_ranks(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _fsdp2_tp(0, mesh)
    sd = model.state_dict()
    # FSDP2 over TP: fc1 is _StridedShard on dp; `gate` (outside the TP plan) lives on the dp
    # mesh only and is a replica over tp; fc2.bias is (Shard(0), Replicate()).
    assert "_StridedShard" in type(sd["fc1.weight"].placements[0]).__name__
    shardsafe.save(to_sharded_state_dict(sd), f"{root}/2d")
    other = _fsdp2_tp(1, mesh)
    shardsafe.load(to_sharded_state_dict(other.state_dict()), f"{root}/2d")
    return _full(other.state_dict())


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fsdp2_over_tp_on_a_2d_mesh(tmp_path):
    ref = reference()
    for full in run_ranks(_four_ranks, 4, str(tmp_path), timeout=140):
        for k, v in full.items():
            assert torch.equal(torch.from_numpy(v), ref[k]), k
    plain = Net(2)
    shardsafe.load(to_sharded_state_dict(plain.state_dict()), tmp_path / "2d")
    for k, v in ref.items():
        assert torch.equal(plain.state_dict()[k], v), k
