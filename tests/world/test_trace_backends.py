"""Tracing needs no backend of its own: the NCCL backend (on the CPU stand-in of CuPy and
NCCL, tests/support/nccl_fake.py) is traced through its flight recorder, with its
clock exchange over NCCL's send and receive."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import LAUNCHED

import axondist as ad

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> Any:
    sys.path.insert(0, str(SUPPORT))
    try:
        import nccl_fake
    finally:
        sys.path.pop(0)
    monkeypatch.delenv("AXONDIST_DEBUG", raising=False)
    return nccl_fake.install(monkeypatch, device_count=2)


@pytest.mark.skipif(LAUNCHED, reason="runs its own NCCL world on threads")
def test_nccl_calls_are_traced(fake_nccl: Any, tmp_path: Path) -> None:
    from axondist.launching.worlds import spawn_on_devices

    def body(world: ad.World) -> None:
        ad.trace.start(str(tmp_path))
        x = ad.to_device(np.ones(256, np.float32))
        for _ in range(3):
            with ad.trace_span("step"):
                ad.all_reduce(x)
                ad.broadcast(x, src=0)
        ad.trace.stop()

    spawn_on_devices(body, [0, 1], timeout=30.0)
    timeline = ad.trace.read_timeline(str(tmp_path))
    collectives, partial = timeline.collectives()
    assert [c.label.split(" (")[0] for c in collectives] == ["all_reduce", "broadcast"] * 3
    assert partial == 0
    for trace in timeline.ranks.values():
        assert {c.bytes for c in trace.calls if c.op == "all_reduce"} == {1024}
        assert [s.name for s in trace.spans] == ["step"] * 3
        assert [c["phase"] for c in trace.clocks] == ["start", "stop"]


@pytest.mark.skipif(LAUNCHED, reason="shifts the clock of one thread of a mock world")
def test_clock_exchange_finds_a_rank_whose_clock_is_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time
    import types

    from axondist.trace import clock

    skew = {"axondist-rank1": 0.005, "axondist-rank2": -0.003}  # seconds ahead of rank 0

    def monotonic() -> float:
        return time.monotonic() + skew.get(threading.current_thread().name, 0.0)

    monkeypatch.setattr(clock, "time", types.SimpleNamespace(monotonic=monotonic))

    def body(world: ad.World) -> Any:
        return clock.exchange(world.backend_for("test"))

    samples = ad.spawn(body, 3)
    assert samples[0].offset_s == 0.0
    for rank, sample in enumerate(samples[1:], start=1):
        expected = -skew[f"axondist-rank{rank}"]  # add it to this rank's clock to get rank 0's
        assert abs(sample.offset_s - expected) <= sample.rtt_s / 2 + 1e-6, (rank, sample)
        assert sample.rtt_s < 0.2  # the shortest of 8 round trips between threads
