"""Ranks of a :class:`~lit_balance.stream.StreamBatches` run in threads of one process, their collectives replaced by
a barrier over shared slots: many seeded runs of the engine's own code (reading, planning, moving token ids, state)
in one test, without processes. The real collectives (gloo) are tested in tests/ddp/test_stream_ddp.py."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from lit_balance.stream import StreamBatches


class ThreadWorld:
    """Collectives among ``num_replicas`` threads: every rank calls them in the same order, as with gloo."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.barrier = threading.Barrier(num_replicas, timeout=20)
        self.slots: list[Any] = [None] * num_replicas

    def _share(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def attach(self, batches: StreamBatches) -> StreamBatches:
        r = batches.rank
        batches._all_gather = lambda v: np.stack(self._share(r, v.copy()))
        batches._all_gather_object = lambda obj: self._share(r, obj)

        def exchange(send: np.ndarray, send_sizes: list[int], recv_sizes: list[int]) -> np.ndarray:
            shared = self._share(r, (send.copy(), list(send_sizes)))
            parts = []
            for i, (buffer, sizes) in enumerate(shared):
                at = sum(sizes[:r])
                parts.append(buffer[at:at + sizes[r]])
                assert sizes[r] == recv_sizes[i], (i, r, sizes, recv_sizes)
            return np.concatenate(parts) if parts else np.zeros(0, np.int32)

        batches._exchange = exchange
        return batches


def run_ranks(make: Any, num_replicas: int, *, stop_after: int | None = None, state: dict | None = None,
              timeout_s: float = 60) -> dict:
    """Run ``make(rank)`` (a StreamBatches of ``num_replicas`` ranks) on every rank, each in a thread.

    Returns ``{"batches": [per rank: list of (indices, is_fill, num_padded_tokens, step_real_tokens)], "states": [per
    rank state after stop_after micro-batches or at the end], "errors": [per rank exception or None]}``. A thread that
    does not end within ``timeout_s`` fails (a hang).
    """
    world = ThreadWorld(num_replicas)
    out = {"batches": [[] for _ in range(num_replicas)], "states": [None] * num_replicas,
           "errors": [None] * num_replicas}

    def body(rank: int) -> None:
        try:
            batches = world.attach(make(rank))
            if state is not None:
                batches.load_state_dict(state)
            for k, batch in enumerate(batches):
                out["batches"][rank].append((batch["indices"].tolist(), batch["is_fill"].tolist(),
                                             int(batch["num_padded_tokens"]), int(batch["step_real_tokens"])))
                if stop_after is not None and k + 1 == stop_after:
                    break
            out["states"][rank] = batches.state_dict()
        except BaseException as error:  # noqa: BLE001 (reported per rank)
            out["errors"][rank] = error  # a rank that raises alone leaves the others to the barrier's timeout

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(num_replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a rank hung"
    return out
