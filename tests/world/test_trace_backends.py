"""Tracing needs no backend of its own: the NCCL backend (on the CPU stand-in of CuPy and
NCCL, tests/integration/nccl_fake.py) is traced through its flight recorder, with its
clock exchange over NCCL's send and receive."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import UNDER_MPI

import axondist as ad

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> Any:
    sys.path.insert(0, str(INTEGRATION))
    try:
        import nccl_fake
    finally:
        sys.path.pop(0)
    monkeypatch.delenv("AXONDIST_DEBUG", raising=False)
    return nccl_fake.install(monkeypatch, device_count=2)


@pytest.mark.skipif(UNDER_MPI, reason="runs its own NCCL world on threads")
def test_nccl_calls_are_traced(fake_nccl: Any, tmp_path: Path) -> None:
    from axondist.launch import spawn_on_devices

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
