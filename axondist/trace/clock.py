"""Clock offsets between ranks by a ping exchange over the backend (as NTP does).

Each rank ``r`` sends rank 0 its clock reading ``t1``; rank 0 answers with
its own ``t2``; ``r`` reads ``t3`` when the answer arrives. Then
``t2 - (t1 + t3) / 2`` is rank 0's clock minus ``r``'s, off by at most half the
round trip ``t3 - t1``; of ``rounds`` exchanges the one with the shortest
round trip is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._array import to_host

#: Ping exchanges per rank; the one with the shortest round trip is kept.
ROUNDS = 8
#: Message tag of the exchange (apart from the user's tags).
_TAG = 0x7ACE


@dataclass(frozen=True)
class ClockSample:
    """This rank's clock against rank 0's, as one exchange measured it."""

    offset_s: float
    """Seconds to add to this rank's ``time.monotonic()`` to get rank 0's."""
    rtt_s: float
    """The exchange's round trip: the offset is off by at most half of it."""
    at: float
    """This rank's ``time.monotonic()`` when the exchange ended."""

    def as_record(self, phase: str) -> dict[str, Any]:
        """The trace file's clock record for this sample (``phase``: "start" or "stop")."""
        return {"phase": phase, "reference_rank": 0, "offset_s": self.offset_s,
                "rtt_s": self.rtt_s, "at": self.at}


def exchange(backend: Any, rounds: int = ROUNDS) -> ClockSample:
    """Measure this rank's clock offset to rank 0 of ``backend``'s group; every rank calls it.

    Rank 0 answers the other ranks in turn, ``rounds`` pings each. Returns
    rank 0's own sample as offset 0.
    """
    if rounds < 1:
        raise ValueError(f"clock exchange: rounds must be >= 1, got {rounds}")
    rank, size = backend.rank, backend.world_size
    buf = backend.metadata_buffer(np.zeros(1, np.float64))
    if rank == 0:
        for peer in range(1, size):
            for _ in range(rounds):
                backend.recv(buf, peer, _TAG)
                backend.send(backend.metadata_buffer(np.array([time.monotonic()])), peer, _TAG)
        return ClockSample(0.0, 0.0, time.monotonic())
    best: ClockSample | None = None
    for _ in range(rounds):
        t1 = time.monotonic()
        backend.send(backend.metadata_buffer(np.array([t1])), 0, _TAG)
        backend.recv(buf, 0, _TAG)
        t3 = time.monotonic()
        t2 = float(to_host(buf)[0])
        sample = ClockSample(t2 - (t1 + t3) / 2, t3 - t1, t3)
        if best is None or sample.rtt_s < best.rtt_s:
            best = sample
    assert best is not None
    return best


__all__ = ["ROUNDS", "ClockSample", "exchange"]
