"""What the one-call layered FSDP step holds, against the unit loop a user writes by hand.

Both run the same MLP (one unit per layer, FULL_SHARD, Adam) on a 2-rank mock
world; tracemalloc (NumPy reports its buffers to it) gives the highest traced
memory reached during steps taken after a first one, above what was traced
before them (shards and Adam state). The one-call step without prefetch must
reach no higher than the loop, and with prefetch by at most the prefetched
unit's full parameters per rank. The ranks are threads of one process, so the
figures are the two ranks' sum; the slack is a small fraction of a unit.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import comm
from axondist.fsdp import FSDP
from axondist.optim import Adam
from axondist.pipeline import PipelineStage

RANKS = 2
Model = tuple[int, int, int]  # layers, width, batch


def initial_values(model: Model) -> list[np.ndarray]:
    layers, width, _ = model
    rng = np.random.default_rng(0)
    out = []
    for _ in range(layers):
        out.append(rng.standard_normal((width, width), dtype=np.float32) / np.float32(width))
        out.append(np.zeros(width, np.float32))
    return out


def layer_forward(pa: list[Any], x: Any) -> tuple[Any, Any]:
    h = np.tanh(x @ pa[0] + pa[1])
    return h, (x, h)


def layer_backward(pa: list[Any], saved: Any, gy: Any) -> tuple[Any, list[Any]]:
    x, h = saved
    d = gy * (1.0 - h * h)
    return d @ pa[0].T, [x.T @ d, d.sum(axis=0)]


def mse(y: Any, target: Any) -> tuple[float, Any]:
    d = y - target
    return 0.5 * float(np.mean(np.sum(d * d, axis=1))), d / len(y)


def params_of(model: Model) -> list[ad.Parameter]:
    return [ad.Parameter(v, f"p{k}") for k, v in enumerate(initial_values(model))]


def one_call(world: ad.World, model: Model, x: Any, y: Any, prefetch: bool) -> Callable[[], Any]:
    params = params_of(model)
    layers = [PipelineStage(layer_forward, layer_backward, params[2 * k:2 * k + 2])
              for k in range(model[0])]
    f = FSDP.from_layers(layers, world, loss_fn=mse, prefetch=prefetch)
    opt = Adam(f.sharded_parameters(), lr=1e-3)
    return lambda: f.step(x, y, optimizer=opt)


def unit_loop(world: ad.World, model: Model, x: Any, y: Any) -> Callable[[], Any]:
    layers = model[0]
    f = FSDP(params_of(model), world, units=[[2 * k, 2 * k + 1] for k in range(layers)])
    opt = Adam(f.sharded_parameters(), lr=1e-3)
    full = f.full_parameters()

    def step() -> float:
        h, saved = x, []
        for u in range(layers):
            f.gather_parameters(u)
            h, s = layer_forward([full[2 * u].data, full[2 * u + 1].data], h)
            saved.append(s)
            f.reshard_parameters(u)
        loss, g = mse(h, y)
        for u in reversed(range(layers)):
            f.gather_parameters(u)
            g, (full[2 * u].grad, full[2 * u + 1].grad) = layer_backward(
                [full[2 * u].data, full[2 * u + 1].data], saved[u], g)
            saved[u] = None
            f.reshard_parameters(u)
            f.sync_gradients(u)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def step_peak(world: ad.World, step: Callable[[], Any], steps: int = 2) -> tuple[int, list[Any]]:
    """Traced bytes the steps after the first one rose to above what was traced before them
    (both ranks' allocations: rank 0 reads the process-wide figures while rank 1 waits)."""
    losses = [step()]
    gc.collect()
    comm.barrier(world)
    base = tracemalloc.get_traced_memory()[0]
    if world.rank == 0:
        tracemalloc.reset_peak()
    comm.barrier(world)
    losses += [step() for _ in range(steps)]
    comm.barrier(world)
    peak = tracemalloc.get_traced_memory()[1] - base
    comm.barrier(world)  # rank 1 allocates nothing until rank 0 has read the peak
    return peak, losses


def measure(world: ad.World, model: Model) -> dict[str, tuple[int, list[Any]]]:
    rng = np.random.default_rng([1, world.rank])
    x = rng.standard_normal((model[2], model[1]), dtype=np.float32)
    y = rng.standard_normal((model[2], model[1]), dtype=np.float32)
    builders = {"loop": lambda: unit_loop(world, model, x, y),
                "one-call": lambda: one_call(world, model, x, y, False),
                "prefetch": lambda: one_call(world, model, x, y, True)}
    out = {}
    for name, build in builders.items():
        gc.collect()
        out[name] = step_peak(world, build())
    return out


@pytest.fixture
def traced() -> Iterator[None]:
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        yield
    finally:
        if not was_tracing:
            tracemalloc.stop()


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.integers(2, 4), width=st.sampled_from([128, 192, 256]),
       batch=st.integers(1, 4))
def test_one_call_step_holds_no_more_than_the_unit_loop(traced: None, layers: int, width: int,
                                                        batch: int) -> None:
    model = (layers, width, batch)
    results = ad.spawn(measure, RANKS, model, timeout=60)
    peaks = {name: peak for name, (peak, _) in results[0].items()}
    unit = (width * width + width) * 4  # one layer's full parameters (or gradients), one rank
    slack = unit // 8
    assert peaks["one-call"] <= peaks["loop"] + slack, (peaks, unit)
    assert peaks["prefetch"] <= peaks["loop"] + RANKS * unit + slack, (peaks, unit)
    for rank in results:  # the three take the same steps on the same model
        losses = [r[1] for r in rank.values()]
        assert losses[0] == losses[1] == losses[2]
