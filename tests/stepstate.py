"""A small checkpoint whose content depends on the step: rows of ``w`` split over the ranks
(TP), a replicated bias, one object per rank and common state. Shared by the fault and S3
tests, which save one step, break the next, and check what is left."""

from __future__ import annotations

from typing import Any

import torch

from shardsafe import ShardedObject, ShardedTensor

ST = ShardedTensor


class StepState:
    """State dicts and checks for a ``rows x cols`` weight over ``world`` ranks."""

    def __init__(self, rows: int, cols: int, world: int = 2) -> None:
        self.rows, self.cols, self.world = rows, cols, world

    def full_w(self, step: int) -> torch.Tensor:
        return (
            torch.arange(self.rows * self.cols, dtype=torch.float32).reshape(self.rows, self.cols)
            + step
        )

    def rank_state(self, rank: int, step: int) -> dict[str, Any]:
        """What rank ``rank`` saves at ``step``."""
        half = self.rows // self.world
        return {
            "w": ST.from_rank_offsets(
                "w",
                self.full_w(step)[rank * half : (rank + 1) * half].clone(),
                (0, rank, self.world),
            ),
            "b": ST.from_rank_offsets("b", torch.arange(8) + step, replica_id=rank),
            "rng": ShardedObject("rng", {"seed": rank, "step": step}, (self.world,), (rank,)),
            "step": step,
        }

    def rank_template(self, rank: int) -> dict[str, Any]:
        half = self.rows // self.world
        return {
            "w": ST.from_rank_offsets("w", torch.zeros(half, self.cols), (0, rank, self.world)),
            "b": ST.from_rank_offsets("b", torch.zeros(8, dtype=torch.int64), replica_id=rank),
            "rng": ShardedObject("rng", None, (self.world,), (rank,)),
        }

    def whole_state(self, step: int) -> dict[str, Any]:
        """The same checkpoint content, saved by one process."""
        return {
            "w": ST.from_rank_offsets("w", self.full_w(step)),
            "b": ST.from_rank_offsets("b", torch.arange(8) + step),
            "rng": [
                ShardedObject("rng", {"seed": r, "step": step}, (self.world,), (r,))
                for r in range(self.world)
            ],
            "step": step,
        }

    def whole_template(self) -> dict[str, Any]:
        return {
            "w": ST.from_rank_offsets("w", torch.zeros(self.rows, self.cols)),
            "b": ST.from_rank_offsets("b", torch.zeros(8, dtype=torch.int64)),
            "rng": [ShardedObject("rng", None, (self.world,), (r,)) for r in range(self.world)],
        }

    def assert_holds_step(self, out: dict[str, Any], step: int) -> None:
        """``out`` from ``load``, or from ``CheckpointManager.restore`` (entries kept sharded)."""

        def data(x: Any) -> Any:
            return x.data if isinstance(x, (ShardedTensor, ShardedObject)) else x

        assert torch.equal(data(out["w"]), self.full_w(step))
        assert torch.equal(data(out["b"]), torch.arange(8) + step)
        assert [data(o) for o in out["rng"]] == [
            {"seed": r, "step": step} for r in range(self.world)
        ]
        assert out["step"] == step
