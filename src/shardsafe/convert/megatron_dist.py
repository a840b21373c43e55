"""Megatron-Core ``torch_dist`` and PyTorch DCP checkpoints loaded straight into any layout by
``shardsafe.load``.

A run that used to save with ``megatron.core.dist_checkpointing`` keeps its old checkpoints:
``shardsafe.load(model_sd, "iter_0000100")`` reads them into the template's layout (other
TP/PP sizes included) the way it reads its own checkpoints. Each requested key is read whole
through :class:`~shardsafe.convert.dcp.DcpSource` (which never runs pickled code unless
trusted, and checks that the stored chunks tile every tensor exactly), and the template's boxes
are cut from it. Megatron-Core does not need to be installed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..errors import CorruptCheckpointError, IncompatibleRequestError, MissingKeyError
from ..load_result import apply_factories_recording, get_at, merge_common, replace_at
from ..loading import StrictHandling
from ..sharding import ShardedTensor, ShardedTensorFactory, adapt, split_state_dict
from .dcp import DcpSource

log = logging.getLogger(__name__)


def load_torch_dist(
    template: Any, path: str | os.PathLike[str], strict: StrictHandling, trust: bool = False
) -> Any:
    """This rank's part of ``load``: fill the template's pieces from a ``torch_dist`` directory."""
    return _load(template, path, strict, trust, plain_tensors=False)


def load_dcp(
    template: Any, path: str | os.PathLike[str], strict: StrictHandling, trust: bool = False
) -> Any:
    """This rank's part of ``load`` from a PyTorch DCP directory (``FileSystemWriter``): plain
    tensor leaves of the template are DCP's keys (their dotted paths), filled in place, and
    DCP's non-tensor items are the common state."""
    return _load(template, path, strict, trust, plain_tensors=True)


def _load(
    template: Any,
    path: str | os.PathLike[str],
    strict: StrictHandling,
    trust: bool,
    plain_tensors: bool,
) -> Any:
    source = DcpSource(path, trust=trust)
    factories: list[tuple[Any, ShardedTensorFactory]] = []
    tree = apply_factories_recording(adapt(template), (), factories)
    # Megatron keeps plain leaves in common state; DCP stores them as tensors under their paths
    split = split_state_dict(tree, plain_tensors=plain_tensors)
    tensor_keys = set(source.tensor_keys())
    object_keys = set(source.object_keys())
    unexpected = [st.key for _, st in split.tensors if st.key not in tensor_keys]
    unexpected += [o.unique_key for _, o in split.objects if o.unique_key not in object_keys]
    if unexpected:
        msg = (
            f"{os.fspath(path)}: {len(unexpected)} requested keys are not in this {'DCP' if plain_tensors else 'Megatron'} "
            f"checkpoint: {sorted(set(unexpected))[:10]}"
        )
        if strict.raises_unexpected:
            raise MissingKeyError(msg + "; pass strict='log_unexpected' to load the rest")
        log.warning("%s", msg)
    skip = set(unexpected)
    values: dict[int, Any] = {}
    wanted = sorted((st for _, st in split.tensors if st.key not in skip), key=lambda st: st.key)
    current: tuple[str, torch.Tensor] | None = None
    for st in wanted:
        if current is None or current[0] != st.key:
            current = (st.key, source.read_tensor(st.key))  # one whole tensor in memory at a time
        values[id(st)] = _cut(st, current[1], os.fspath(path))
    common = source.common()
    for _, o in split.objects:
        if o.unique_key not in skip:
            stored = common[o.unique_key]
            if not (isinstance(stored, list) and len(stored) == 1):
                raise CorruptCheckpointError(
                    f"{os.fspath(path)}: object {o.unique_key!r} is not Megatron's one-element list"
                )
            values[id(o)] = stored[0]
    if plain_tensors:
        plain: Any = common  # DCP's non-tensor items, nested again by their recorded paths
    else:
        plain = source.megatron_common()  # common.pt, or megatron-core 0.19's common_state
    filled = {split.tensors[i][0]: split.tensors[i][1] for i in split.replicated}
    result = merge_common(tree, plain, values, filled, ())
    for fpath, factory in reversed(factories):
        result = replace_at(result, fpath, factory.merge_fn(get_at(result, fpath)))
    if strict.returns:
        return result, set(), set(unexpected)
    return result


def _cut(st: ShardedTensor, full: torch.Tensor, where: str) -> torch.Tensor:
    """The template's piece of the stored global tensor, written into its data when given."""
    stored = tuple(full.shape)
    if stored != st.global_shape and not st.allow_shape_mismatch:
        raise IncompatibleRequestError(
            f"{where}: {st.key!r} is stored with global shape {stored}, the template asks for "
            f"{st.global_shape}; set allow_shape_mismatch=True on the ShardedTensor to load the overlap"
        )
    if st.data is not None:
        data = st.data
    elif st.allow_shape_mismatch:
        data = torch.zeros(
            st.local_shape if st.flattened_range is None else (st.numel,), dtype=st.dtype
        )
    else:
        data = torch.empty(
            st.local_shape if st.flattened_range is None else (st.numel,), dtype=st.dtype
        )
    if st.allow_shape_mismatch and stored != st.global_shape:
        data.zero_()
    flat = data.view(-1) if st.flattened_range is not None else None
    with torch.no_grad():
        for pos, box in st.boxes():
            src_region = tuple(
                slice(min(o, s), min(o + n, s))
                for o, n, s in zip(box.offset, box.shape, stored, strict=True)
            )
            piece = full[src_region].to(st.dtype)
            if flat is not None:
                flat[pos : pos + piece.numel()].copy_(piece.reshape(-1))
                continue
            local = tuple(
                slice(r.start - o, r.stop - o)
                for r, o in zip(src_region, st.global_offset, strict=True)
            )
            view = data.view((1,) * st.prepend_axis_num + tuple(st.local_shape))
            view[local].copy_(piece)
    return data
