"""Commit signalling through the process group's key-value store.

An async save finishes in background threads, while the training loop runs its own
collectives; mixing our collectives in would race with them. Instead each rank posts its
write result under a key unique to the save, the coordinator waits for all of them (with a
timeout that names missing ranks), commits, and posts the outcome that every rank's
handle waits for.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from .dist import Comm
from .errors import DistributedError, describe_ranks

_POLL = 0.05


def default_store() -> Any:
    """The default process group's store (shared by every group created from it)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception as e:  # pragma: no cover - torch internals moved
        raise DistributedError(
            f"cannot reach the process group's store for async commit: {e}"
        ) from e


class StoreChannel:
    """Keys ``shardsafe/<token>/...`` in the store, for one save."""

    def __init__(self, comm: Comm, token: str, store: Any | None = None) -> None:
        self.comm = comm
        self.prefix = f"shardsafe/{token}"
        self.store = store if store is not None else default_store()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def post(self, record: dict[str, Any]) -> None:
        self.store.set(self._key(f"rank{self.comm.rank}"), json.dumps(record))

    def collect(self, timeout: float) -> list[dict[str, Any]]:
        """Coordinator: every rank's record; ranks missing after ``timeout`` are reported as failed."""
        keys = [self._key(f"rank{r}") for r in range(self.comm.world_size)]
        deadline = time.monotonic() + timeout
        pending = set(range(self.comm.world_size))
        while pending and time.monotonic() < deadline:
            pending = {r for r in pending if not self.store.check([keys[r]])}
            if pending:
                time.sleep(_POLL)
        records: list[dict[str, Any]] = []
        for r in range(self.comm.world_size):
            if r in pending:
                records.append(
                    {
                        "error": {
                            "type": "DistributedError",
                            "message": f"rank {r} did not finish writing within {timeout:.0f} s (dead or stuck)",
                            "origin": "Timeout",
                            "trace": "",
                        }
                    }
                )
            else:
                records.append(json.loads(self.store.get(keys[r])))
        return records

    def publish(self, status: dict[str, Any]) -> None:
        self.store.set(self._key("status"), json.dumps(status))

    def await_status(self, timeout: float) -> dict[str, Any]:
        key = self._key("status")
        try:
            self.store.wait([key], timedelta(seconds=timeout))
        except Exception as e:
            raise DistributedError(
                f"rank {self.comm.rank}: no commit outcome from the coordinator (rank 0) within {timeout:.0f} s; "
                f"it may have died ({type(e).__name__})"
            ) from None
        return dict(json.loads(self.store.get(key)))

    def cleanup(self) -> None:
        """The last rank to read the outcome deletes the save's keys."""
        try:
            if int(self.store.add(self._key("acks"), 1)) == self.comm.world_size:
                for name in [f"rank{r}" for r in range(self.comm.world_size)] + ["status", "acks"]:
                    self.store.delete_key(self._key(name))
        except Exception:
            pass  # stores without delete keep a few bytes; harmless


def missing_ranks_message(pending: set[int]) -> str:
    return describe_ranks(sorted(pending))


_ = tdist
