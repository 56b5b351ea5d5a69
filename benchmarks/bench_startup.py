"""Start-up time of an MPI job: ``axondist.init()`` vs importing mpi4py.

    python benchmarks/bench_startup.py [--ranks 2] [--repeats 11] [--json out.json]

Times whole launches, alternating (axondist, mpi4py, numpy+mpi4py, ...):

* ``axondist``: ``mpiexec -n K python -c "import axondist; axondist.init();
  axondist.barrier()"`` (imports NumPy, starts MPI, duplicates COMM_WORLD, finds the node
  layout, and the first collective shows every rank got there);
* ``mpi4py``: ``mpiexec -n K python -c "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"``;
* ``numpy+mpi4py``: the same plus ``import numpy``, the floor for any
  NumPy-based MPI program (axondist cannot start without NumPy).

Reports milliseconds per launch and paired ratios against both baselines,
each as median (min-max) over the repeats; a launch's time is its slowest
rank's, since it ends when every rank has exited (target, on the median:
axondist/numpy+mpi4py <= 1.2). The CPU time of each launch (mpiexec and its ranks) is
reported beside it: on a machine other jobs share, it moves far less than the wall time.
Runs from the repository root, so the checkout's axondist is the one imported; mpiexec
is the one next to the Python interpreter. A warm start is measured: the launches may write
bytecode (``PYTHONDONTWRITEBYTECODE`` is dropped for them), so the warm-up
launch compiles what a source change left stale and the timed ones do not.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # _common

from _common import (  # noqa: E402
    alternate,
    format_spread,
    format_table,
    ratio_spread,
    spread,
    write_json,
)

# How benchmarks/run.py runs this file: plain Python (it launches mpiexec itself).
RUNNER = {"ranks": None, "quick_args": ["--repeats", "3"], "timeout": 600}

PROGRAMS = {
    "axondist": "import axondist; axondist.init(); axondist.barrier()",
    "mpi4py": "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()",
    "numpy+mpi4py": "import numpy; from mpi4py import MPI; MPI.COMM_WORLD.Barrier()",
}


def _children_cpu_s() -> float:
    """CPU seconds of the finished child processes (a launch's mpiexec, proxy and ranks)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _launcher(ranks: int, program: str, cpu: list[float]) -> Callable[[], None]:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-c", program]
    env = {**os.environ, "PYTHONPATH": str(_HERE.parent)}
    env.pop("AXONDIST_BACKEND", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # compiling every launch is not start-up

    def launch() -> None:
        before = _children_cpu_s()
        subprocess.run(cmd, check=True, cwd=_HERE.parent, env=env,
                       stdout=subprocess.DEVNULL)
        cpu.append(_children_cpu_s() - before)
    return launch


TARGET = 1.2
"""axondist/numpy+mpi4py start-up ratio that must not be exceeded (median): axondist cannot
start without NumPy, so that is its floor."""


def run(ranks: int, repeats: int) -> dict[str, Any]:
    """Milliseconds per launch of each program, the paired ratios and the target."""
    cpu: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    variants = {name: _launcher(ranks, prog, cpu[name]) for name, prog in PROGRAMS.items()}
    times = alternate(variants, batch=1, repeats=repeats, warmup=1, prime=False)
    cpu = {name: values[1:] for name, values in cpu.items()}  # the warm-up launch dropped
    ratios = {"axondist/mpi4py": ratio_spread(times["axondist"], times["mpi4py"]),
              "axondist/numpy+mpi4py": ratio_spread(times["axondist"], times["numpy+mpi4py"]),
              "axondist/numpy+mpi4py, CPU time": ratio_spread(cpu["axondist"],
                                                              cpu["numpy+mpi4py"])}
    return {
        "ranks": ranks,
        "repeats": repeats,
        "launches": [{"program": k, "time_ms": spread(v, 1e3), "cpu_ms": spread(cpu[k], 1e3)}
                     for k, v in times.items()],
        "ratios": [{"ratio": k, "value": v} for k, v in ratios.items()],
        "targets": {f"axondist/numpy+mpi4py <= {TARGET}":
                    ratios["axondist/numpy+mpi4py"]["median"] <= TARGET},
    }


def report(results: dict[str, Any]) -> str:
    """The tables as text."""
    lines = [f"mpiexec -n {results['ranks']} start-up, ms per launch, median (min-max) over "
             f"{results['repeats']} launches",
             format_table(["program", "ms", "CPU ms"],
                          [[r["program"], format_spread(r["time_ms"]), format_spread(r["cpu_ms"])]
                           for r in results["launches"]]),
             format_table(["ratio", "value"], [[r["ratio"], format_spread(r["value"])]
                                               for r in results["ratios"]]),
             format_table(["target", "met"], [[k, "met" if v else "MISSED"]
                                              for k, v in results["targets"].items()])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--json", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    results = run(args.ranks, args.repeats)
    print(report(results), flush=True)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
