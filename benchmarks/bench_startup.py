"""Start-up time of an MPI job: ``axondist.init()`` vs importing mpi4py.

    python benchmarks/bench_startup.py [--ranks 2] [--repeats 11] [--json out.json]

Times whole launches, alternating (axondist, mpi4py, numpy+mpi4py, ...):

* ``axondist``: ``mpiexec -n K python -c "import axondist; axondist.init()"``
  (imports NumPy, starts MPI, duplicates COMM_WORLD, finds the node layout);
* ``mpi4py``: ``mpiexec -n K python -c "from mpi4py import MPI"``;
* ``numpy+mpi4py``: the same plus ``import numpy``, the floor for any
  NumPy-based MPI program (axondist cannot start without NumPy).

Reports median seconds per launch and paired ratios against both
baselines (target: axondist/mpi4py <= 1.5). Runs from the repository root,
so the checkout's axondist is the one imported; mpiexec is the one next to
the Python interpreter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # _common

from _common import alternate, format_table, median, paired_ratio, write_json  # noqa: E402

# How benchmarks/run.py runs this file: plain Python (it launches mpiexec itself).
RUNNER = {"ranks": None, "quick_args": ["--repeats", "3"], "timeout": 600}

PROGRAMS = {
    "axondist": "import axondist; axondist.init()",
    "mpi4py": "from mpi4py import MPI",
    "numpy+mpi4py": "import numpy; from mpi4py import MPI",
}


def _launcher(ranks: int, program: str) -> Callable[[], None]:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-c", program]
    env = {**os.environ, "PYTHONPATH": str(_HERE.parent)}
    env.pop("AXONDIST_BACKEND", None)

    def launch() -> None:
        subprocess.run(cmd, check=True, cwd=_HERE.parent, env=env,
                       stdout=subprocess.DEVNULL)
    return launch


def run(ranks: int, repeats: int) -> dict[str, Any]:
    """Median seconds per launch of each program, and the paired ratios."""
    variants = {name: _launcher(ranks, prog) for name, prog in PROGRAMS.items()}
    times = alternate(variants, batch=1, repeats=repeats, warmup=1, prime=False)
    return {
        "ranks": ranks,
        "rows": [{"program": k, "ms": median(v) * 1e3} for k, v in times.items()],
        "seconds": {k: median(v) for k, v in times.items()},
        "axondist/mpi4py": paired_ratio(times["axondist"], times["mpi4py"]),
        "axondist/numpy+mpi4py": paired_ratio(times["axondist"], times["numpy+mpi4py"]),
    }


def report(results: dict[str, Any]) -> str:
    """The table as text."""
    rows = [[name, s * 1e3] for name, s in results["seconds"].items()]
    lines = [f"mpiexec -n {results['ranks']} start-up, median ms per launch",
             format_table(["program", "ms"], rows),
             f"axondist/mpi4py = {results['axondist/mpi4py']:.2f} (target <= 1.5)",
             f"axondist/numpy+mpi4py = {results['axondist/numpy+mpi4py']:.2f}"]
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
