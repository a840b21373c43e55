"""Per-rank RNG states (torch CPU, CUDA, Python ``random``, numpy) in a checkpoint.

Each rank saves its generators as one cell of a ``(world_size,)`` grid of
:class:`ShardedObject`\\ s; the state records the rank and world size it came from. RNG
streams cannot be resharded, so a restore under a different layout needs a decision, made
explicit by :class:`RngPolicy`:

* ``AUTO`` (default): restore exactly when the saved grid equals the current one (same world
  size), otherwise re-derive, with a warning. Never fails because the world size changed.
* ``KEEP``: restore exactly; a changed layout raises :class:`IncompatibleRequestError`.
* ``REDERIVE``: always derive fresh, deterministic states from the saved rank-0 state and
  the current rank (the same checkpoint and rank always give the same streams, and ranks
  differ from each other).
* ``DROP``: warn and keep the current states.

Saving::

    sd = {"model": ..., **rng_sharded_state_dict()}
    shardsafe.save(sd, path)

Restoring, on its own (no collective; any subset of ranks may call it)::

    restore_rng(path)                      # or restore_rng(CheckpointReader(path), policy=...)

or inside the one ``load`` of the whole state::

    template = {"model": ..., **rng_load_template(path)}
    loaded = shardsafe.load(template, path)
    apply_rng_state(loaded.get("rng"))     # None (no RNG state saved) is handled too
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import random
import warnings
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import torch

from ..errors import IncompatibleRequestError, MissingKeyError
from ..sharding import ShardedObject

if TYPE_CHECKING:  # the reader imports loading, which may import this package
    from ..reader import CheckpointReader

log = logging.getLogger("shardsafe")

PathOrReader: TypeAlias = "str | os.PathLike[str] | CheckpointReader"


class RngPolicy(enum.Enum):
    """What to do with saved RNG states; see the module docstring."""

    AUTO = "auto"
    KEEP = "keep"
    REDERIVE = "rederive"
    DROP = "drop"


def _rank_world(process_group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank(process_group)), int(dist.get_world_size(process_group))
    return 0, 1


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states. CUDA is included only once CUDA is initialised, so a
    CPU job never initialises it."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` returned (a CUDA state only where CUDA exists)."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_python_state(state["python"]))
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        else:
            log.warning("the saved RNG state has a CUDA generator but CUDA is unavailable here")


def _as_python_state(value: Any) -> tuple[Any, ...]:
    """``random.setstate`` wants tuples all the way down; be lenient about lists."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


def rng_sharded_state_dict(key: str = "rng", process_group: Any = None) -> dict[str, ShardedObject]:
    """``{key: ShardedObject}`` holding this rank's RNG states, cell ``(rank,)`` of ``(world,)``."""
    rank, world = _rank_world(process_group)
    state = capture_rng_state()
    state["rank"] = rank
    state["world_size"] = world
    return {key: ShardedObject(key, state, (world,), (rank,))}


def _reader(path_or_reader: PathOrReader) -> CheckpointReader:
    from ..reader import CheckpointReader

    if isinstance(path_or_reader, CheckpointReader):
        return path_or_reader
    return CheckpointReader(path_or_reader)


def _saved_cells(reader: CheckpointReader, key: str) -> dict[tuple[int, ...], str]:
    """Saved grid cells of ``key``: ``{global_offset: unique_key}``, with the grid shape."""
    return {
        tuple(o.global_offset): ukey for ukey, o in reader.manifest.objects.items() if o.key == key
    }


def _saved_grid(reader: CheckpointReader, key: str) -> tuple[int, ...] | None:
    for o in reader.manifest.objects.values():
        if o.key == key:
            return tuple(o.global_shape)
    return None


def _cell_to_read(
    grid: tuple[int, ...], policy: RngPolicy, rank: int, world: int
) -> tuple[int, ...]:
    if grid == (world,) and policy in (RngPolicy.AUTO, RngPolicy.KEEP):
        return (rank,)
    return (0,) * len(grid)


def rng_load_template(
    path_or_reader: PathOrReader,
    key: str = "rng",
    policy: RngPolicy | str = RngPolicy.AUTO,
    process_group: Any = None,
) -> dict[str, ShardedObject]:
    """The entry to add to a ``load`` template so that the right saved cell is read: this
    rank's own cell when the layout matches, the rank-0 cell otherwise. Empty when the
    checkpoint has no ``key`` (then :func:`apply_rng_state` gets nothing and applies the
    policy to that). Reads only the manifest."""
    policy = RngPolicy(policy)
    reader = _reader(path_or_reader)
    grid = _saved_grid(reader, key)
    if grid is None or policy is RngPolicy.DROP:
        return {}
    rank, world = _rank_world(process_group)
    return {key: ShardedObject(key, None, grid, _cell_to_read(grid, policy, rank, world))}


def apply_rng_state(
    state: dict[str, Any] | None,
    policy: RngPolicy | str = RngPolicy.AUTO,
    process_group: Any = None,
) -> RngPolicy:
    """Apply ``policy`` to a loaded RNG state (``None``: the checkpoint had none).

    Returns what was done: ``KEEP`` (restored exactly), ``REDERIVE`` or ``DROP``.
    """
    policy = RngPolicy(policy)
    rank, world = _rank_world(process_group)
    if policy is RngPolicy.DROP:
        warnings.warn(
            "RNG states not restored (RngPolicy.DROP): the generators keep their current state",
            stacklevel=2,
        )
        return RngPolicy.DROP
    if state is None:
        if policy is RngPolicy.KEEP:
            raise MissingKeyError("the checkpoint holds no RNG state to restore (RngPolicy.KEEP)")
        warnings.warn(
            "the checkpoint holds no RNG state; the generators keep their current state",
            stacklevel=2,
        )
        return RngPolicy.DROP
    same = state.get("world_size") == world and state.get("rank") == rank
    if policy is RngPolicy.REDERIVE or (policy is RngPolicy.AUTO and not same):
        if policy is RngPolicy.AUTO:
            warnings.warn(
                f"RNG states were saved by {state.get('world_size')} ranks and are restored on "
                f"{world}: re-deriving rank {rank}'s generators from the saved rank-0 state "
                "(deterministic, but not the uninterrupted streams)",
                stacklevel=2,
            )
        _rederive(state, rank)
        return RngPolicy.REDERIVE
    if not same:
        raise IncompatibleRequestError(
            f"RNG states were saved by {state.get('world_size')} ranks, this job has {world}: "
            "RngPolicy.KEEP needs the same layout; use RngPolicy.AUTO or REDERIVE to derive new "
            "states, or DROP to keep the current ones"
        )
    set_rng_state(state)
    return RngPolicy.KEEP


def _derive_seed(state: dict[str, Any], rank: int, stream: str) -> int:
    """A 64-bit seed from the saved CPU generator state, the rank and the generator's name."""
    h = hashlib.blake2b(digest_size=8)
    h.update(stream.encode())
    h.update(rank.to_bytes(8, "little"))
    h.update(state["torch"].contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def _rederive(state: dict[str, Any], rank: int) -> None:
    torch.manual_seed(_derive_seed(state, rank, "torch"))
    random.seed(_derive_seed(state, rank, "python"))
    np.random.seed(_derive_seed(state, rank, "numpy") % 2**32)
    if torch.cuda.is_available() and ("cuda" in state or torch.cuda.is_initialized()):
        torch.cuda.manual_seed(_derive_seed(state, rank, "cuda"))


def restore_rng(
    path_or_reader: PathOrReader,
    key: str = "rng",
    policy: RngPolicy | str = RngPolicy.AUTO,
    process_group: Any = None,
) -> RngPolicy:
    """Read this rank's RNG state from a checkpoint and apply ``policy``; no collective.

    ``process_group`` only tells this rank's position and the current world size. Returns
    what was done (see :func:`apply_rng_state`).
    """
    policy = RngPolicy(policy)
    reader = _reader(path_or_reader)
    grid = _saved_grid(reader, key)
    state = None
    if grid is not None and policy is not RngPolicy.DROP:
        rank, world = _rank_world(process_group)
        cell = _cell_to_read(grid, policy, rank, world)
        ukey = _saved_cells(reader, key).get(cell)
        if ukey is not None:
            state = reader.read_object(ukey)
    return apply_rng_state(state, policy, process_group)
