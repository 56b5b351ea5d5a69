"""A layer that fails on one rank in FSDP's layered step ends the run on every rank, never a hang.

The failing rank raises inside its forward while the others go on to wait for the
next unit's all-gather (prefetched or not, in forward or in backward); each run is a
subprocess under its own ``timeout`` with ``AXONDIST_TIMEOUT=10``, on the mock world
and under ``mpiexec -n 2``, and must end non-zero, printing the layer's error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi

REPO = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
HARD_LIMIT = 90.0  # past it, a hang
ENV = {"AXONDIST_TIMEOUT": "10", "PYTHONPATH": str(REPO),
       "MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
       "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1"}

SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    import axondist as ad
    from axondist.fsdp import FSDP
    from axondist.launching.worlds import launched_by_mpi
    from axondist.optim import SGD
    from axondist.pipeline import PipelineStage

    WHERE, PREFETCH = sys.argv[1], sys.argv[2] == "prefetch"

    def body(world):
        def forward(pa, x):
            if world.rank == 1 and WHERE == "forward":
                raise ArithmeticError("layer failed on rank 1")
            return x * pa[0], x

        def backward(pa, x, gy):
            if world.rank == 1 and WHERE == "backward":
                raise ArithmeticError("layer failed on rank 1")
            return gy * pa[0], [(gy * x).sum(0)]

        layers = [PipelineStage(forward, backward, [ad.Parameter(np.ones(4), f"s{k}")])
                  for k in range(3)]
        f = FSDP.from_layers(layers, world, loss_fn=lambda y, t: (float(y.sum()),
                                                                  np.ones_like(y)),
                             prefetch=PREFETCH)
        opt = SGD(f.sharded_parameters(), lr=0.1)
        for _ in range(3):
            f.step(np.ones((2, 4)), None, optimizer=opt)

    if launched_by_mpi():
        body(ad.init("mpi"))
    else:
        ad.spawn(body, 2)
    print("CASE OK")
''')


def run_case(tmp_path: Path, launcher: str, where: str, prefetch: str) -> tuple[int, str]:
    script = tmp_path / "layer_fault.py"
    script.write_text(SCRIPT, encoding="utf-8")
    cmd = [sys.executable, str(script), where, prefetch]
    if launcher == "mpi":
        if not MPIEXEC.exists():
            pytest.skip("mpiexec is not installed next to this Python")
        cmd = [str(MPIEXEC), "-n", "2", *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "HYDI_"))}
    proc = subprocess.run(cmd, env={**env, **ENV}, capture_output=True, text=True,
                          timeout=HARD_LIMIT, check=False)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.skipif(launched_by_mpi(), reason="starts its own worlds")
@pytest.mark.parametrize("launcher", ["mock", "mpi"])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("prefetch", ["prefetch", "no-prefetch"])
def test_a_layer_failing_on_one_rank_ends_every_rank(tmp_path: Path, launcher: str, where: str,
                                                     prefetch: str) -> None:
    code, out = run_case(tmp_path, launcher, where, prefetch)
    assert code != 0, out
    assert "CASE OK" not in out, out
    assert "ArithmeticError: layer failed on rank 1" in out, out
    if launcher == "mpi":
        assert "rank 1 failed: aborting the MPI job so the other ranks do not wait" in out, out
    else:
        assert "raised on rank 1 of 2 (axondist.spawn)" in out, out
