"""What the one-call layered FSDP step holds, against the unit loop a user writes by hand.

Both run the same MLP (one unit per layer, FULL_SHARD, Adam) on 2 ranks;
tracemalloc (NumPy reports its buffers to it) gives each rank's highest traced
memory during steps taken after a first one, above what was traced before them
(shards and Adam state). The one-call step without prefetch must reach no
higher than the loop, and with prefetch by at most the prefetched unit's full
parameters; the slack is a small fraction of a unit.

Each rank is a process of its own (``mpiexec -n 2`` runs this file as a script, under its
own timeout), so each figure is one rank's alone: ranks that are threads of one process
share tracemalloc's figure, and their sum moves with how the threads interleave, which the
machine's load decides. What else a rank's process allocates meanwhile (the backend's
threads, a log line) only adds: the layers are wide enough (a unit of 0.6-1 MiB) that it
is far below the slack, and each figure is the lowest of a fixed number of rounds, each with
the garbage collector off after a full collection. The verdict depends on the steps alone,
not on the machine's load or on the tests that ran before.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import comm
from axondist.fsdp import FSDP
from axondist.launching.worlds import launched_by_mpi
from axondist.optim import Adam
from axondist.pipeline import PipelineStage

REPO = Path(__file__).resolve().parents[2]
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


ROUNDS = 2  # measured rounds per variant; a figure is the lowest
TIMEOUT = 120.0  # seconds one example's mpiexec job may take
MPIEXEC = Path(sys.executable).parent / "mpiexec"
MPICH_YIELDS = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
                "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1"}  # waiting ranks yield


def step_peak(world: ad.World, step: Callable[[], Any], steps: int = 2,
              rounds: int = ROUNDS) -> tuple[int, list[Any]]:
    """Traced bytes this rank's steps after the first one rose to above what was traced
    before them: the lowest of ``rounds`` rounds of ``steps`` steps, collector off."""
    losses = [step()]
    peaks = []
    for _ in range(rounds):
        gc.collect()
        gc.disable()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            losses += [step() for _ in range(steps)]
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
        finally:
            gc.enable()
        comm.barrier(world)
    return min(peaks), losses


def measure(world: ad.World, model: Model) -> dict[str, tuple[int, list[Any]]]:
    rng = np.random.default_rng([1, world.rank])
    x = rng.standard_normal((model[2], model[1]), dtype=np.float32)
    y = rng.standard_normal((model[2], model[1]), dtype=np.float32)
    builders = {"loop": lambda: unit_loop(world, model, x, y),
                "one-call": lambda: one_call(world, model, x, y, False),
                "prefetch": lambda: one_call(world, model, x, y, True)}
    out = {}
    for name, build in builders.items():
        out[name] = step_peak(world, build())
    return out


def measure_this_rank(model: Model) -> dict[str, Any]:
    """This rank's peak of each variant, and whether the variants' losses agree."""
    world = ad.init("mpi")
    tracemalloc.start()
    results = measure(world, model)
    tracemalloc.stop()
    losses = {repr(r[1]) for r in results.values()}
    return {"rank": world.rank, "peaks": {name: peak for name, (peak, _) in results.items()},
            "same_losses": len(losses) == 1}


def measure_on_two_processes(model: Model) -> list[dict[str, Any]]:
    """``mpiexec -n 2`` of this file: each rank's :func:`measure_this_rank`."""
    env = {**os.environ, **MPICH_YIELDS,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("AXONDIST_BACKEND", None)
    proc = subprocess.run([str(MPIEXEC), "-n", str(RANKS), sys.executable, __file__,
                           *map(str, model)], capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one JSON object per rank (mpiexec may join the ranks' lines)
    ranks = [json.loads(m) for m in re.findall(r'\{"rank".*?"same_losses": \w+\}', proc.stdout)]
    assert sorted(r["rank"] for r in ranks) == list(range(RANKS)), proc.stdout + proc.stderr
    return ranks


@pytest.mark.mpi
@pytest.mark.skipif(launched_by_mpi(), reason="starts its own mpiexec job")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or not MPIEXEC.exists(),
                    reason="needs mpi4py and MPICH's mpiexec next to the interpreter")
@settings(max_examples=6, deadline=None)
@given(layers=st.integers(2, 3), width=st.sampled_from([384, 448, 512]),
       batch=st.integers(1, 4))
def test_one_call_step_holds_no_more_than_the_unit_loop(layers: int, width: int,
                                                        batch: int) -> None:
    unit = (width * width + width) * 4  # one layer's full parameters (or gradients)
    slack = unit // 8
    for rank in measure_on_two_processes((layers, width, batch)):
        peaks = rank["peaks"]
        assert peaks["one-call"] <= peaks["loop"] + slack, (rank, unit)
        assert peaks["prefetch"] <= peaks["loop"] + unit + slack, (rank, unit)
        assert rank["same_losses"], rank  # the three take the same steps on the same model


if __name__ == "__main__":
    sys.stdout.write(json.dumps(measure_this_rank((int(sys.argv[1]), int(sys.argv[2]),
                                                   int(sys.argv[3])))) + "\n")
    sys.stdout.flush()
