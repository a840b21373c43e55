"""A tiny training run whose result does not depend on the layout: SGD with momentum on an
elementwise loss over rows of ``w`` split across the ranks. Any row split gives the same bits,
so a resumed run in another layout can be compared exactly with an uninterrupted one."""

from __future__ import annotations

from typing import Any

import torch

from shardsafe import ShardedTensor

ROWS, COLS = 12, 6
LR, MOMENTUM = 0.01, 0.9


def target(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS).sin() * (1 + step % 3)


def train_step(w: torch.Tensor, m: torch.Tensor, rows: slice, step: int) -> None:
    """One SGD-with-momentum step on an elementwise loss: any row split gives the same bits."""
    g = 2 * (w - target(step)[rows])
    m.mul_(MOMENTUM).add_(g)
    w.sub_(LR * m)


def reference(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The uninterrupted run on one process, after ``step`` steps."""
    w = torch.zeros(ROWS, COLS, dtype=torch.float64)
    m = torch.zeros_like(w)
    for s in range(1, step + 1):
        train_step(w, m, slice(0, ROWS), s)
    return w, m


def rows_of(rank: int, world: int) -> slice:
    per = ROWS // world
    return slice(rank * per, (rank + 1) * per)


def state_of(rank: int, world: int, w: torch.Tensor, m: torch.Tensor, step: int) -> dict[str, Any]:
    return {
        "model": {"w": ShardedTensor.from_rank_offsets("model.w", w, (0, rank, world))},
        "optim": {"m": ShardedTensor.from_rank_offsets("optim.m", m, (0, rank, world))},
        "step": step,
    }


def train_and_save(mgr: Any, last: int, rank: int = 0, world: int = 1) -> None:
    """Steps 1..last from scratch, each saved through the manager ``mgr`` (both tiers as it
    is configured), waiting for the last save."""
    w = torch.zeros(ROWS // world, COLS, dtype=torch.float64)
    m = torch.zeros_like(w)
    state = state_of(rank, world, w, m, 0)
    for step in range(1, last + 1):
        train_step(w, m, rows_of(rank, world), step)
        state["step"] = step
        mgr.save(step, state)
    mgr.wait()
