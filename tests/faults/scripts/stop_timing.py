"""How late the watchdog speaks: seconds from a fault to the stall warning, to the timeout's
message and to the job's end, over a few trials, printed as a table.

``python tests/faults/scripts/stop_timing.py sigstop [--launcher mpi|torch] [-n 2]
[--trials 3] [--timeout 10] [--stall 5]`` freezes the last rank with SIGSTOP mid-training
(``stop_cases.py stopped``). ``python tests/faults/scripts/stop_timing.py cut_link`` cuts
the second host's link on a 2-host x 2-rank simulated cluster (``tests/cluster``; needs
root). Each trial is a subprocess under its own limit; the clock of each line is when it
reached this process.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
LIMIT = 120.0


def _env(timeout: float, stall: float) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "AXONDIST_TIMEOUT": f"{timeout:g}",
            "AXONDIST_STALL_WARNING": f"{stall:g}", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}


def _stream(proc: subprocess.Popen[str]) -> list[tuple[float, str]]:
    """Every line ``proc`` prints (stdout and stderr merged), with when it arrived."""
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(LIMIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(5)
    return lines


def _first(lines: list[tuple[float, str]], pattern: str) -> tuple[float, re.Match[str]] | None:
    for at, line in lines:
        found = re.search(pattern, line)
        if found:
            return at, found
    return None


def sigstop_trial(launcher: str, n: int, timeout: float, stall: float) -> dict[str, float]:
    """One frozen-rank run: seconds from ``STOPPED at`` to each event, and the quotes."""
    script = [str(HERE / "stop_cases.py"), "stopped", launcher]
    if launcher == "mpi":
        command = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(n), sys.executable,
                   *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(n), *script]
    proc = subprocess.Popen(command, cwd=REPO, env=_env(timeout, stall), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    lines = _stream(proc)
    ended = time.time()
    stopped = _first(lines, r"STOPPED at (\d+\.\d+)")
    if stopped is None:
        raise RuntimeError("no rank stopped:\n" + "".join(t for _, t in lines[-40:]))
    at = float(stopped[1][1])
    row = {"end": ended - at}
    warned = _first(lines, r"stall: rank \d+ has waited (\d+\.\d) s")
    if warned:
        row["warning"], row["warning quotes"] = warned[0] - at, float(warned[1][1])
    timed_out = _first(lines, r"timed out on rank \d+ of \d+ after (\d+\.\d) s")
    if timed_out:
        row["message"], row["message quotes"] = timed_out[0] - at, float(timed_out[1][1])
    else:
        said = _first(lines, r"cannot complete|CONTINUED|no rank ended")
        row["no timeout; first said"] = (said[0] - at) if said else float("nan")
    return row


def cut_link_trial(timeout: float, stall: float) -> dict[str, float]:
    """One run of 2 x 2 ranks all-reducing on a simulated cluster, node1's link cut."""
    sys.path.insert(0, str(REPO / "tests"))
    from cluster.simcluster import SimCluster  # the tests' own cluster

    checks = str(REPO / "tests" / "cluster" / "rank_checks.py")
    env = {"AXONDIST_TIMEOUT": f"{timeout:g}", "AXONDIST_STALL_WARNING": f"{stall:g}"}
    with SimCluster(hosts=2) as cluster:
        proc, out = cluster.start([2, 2], ["-m", "mpi4py", checks, "all_reduce_forever"],
                                  env=env)
        files = [out / f"rank{r}.txt" for r in range(4)]
        begun = time.monotonic()
        while sum(f.exists() and "STARTED" in f.read_text() for f in files) < 4:
            if proc.poll() is not None or time.monotonic() - begun > 60:
                raise RuntimeError("the job did not start")
            time.sleep(0.1)
        time.sleep(1.0)
        struck = time.monotonic()
        cluster.set_link(1, up=False)
        launch = cluster.finish(proc, out, 4, LIMIT, struck)
        text = launch.launcher + "".join(launch.ranks)
    row = {"end": launch.seconds}
    quoted = re.search(r"timed out on rank \d+ of \d+ after (\d+\.\d) s", text)
    if quoted:
        row["message quotes"] = float(quoted[1])
    warned = re.search(r"stall: rank \d+ has waited (\d+\.\d) s", text)
    if warned:
        row["warning quotes"] = float(warned[1])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("fault", choices=("sigstop", "cut_link"))
    parser.add_argument("--launcher", choices=("mpi", "torch"), default="mpi")
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--stall", type=float, default=5.0)
    args = parser.parse_args()
    rows = []
    for trial in range(args.trials):
        if args.fault == "sigstop":
            row = sigstop_trial(args.launcher, args.n, args.timeout, args.stall)
        else:
            row = cut_link_trial(args.timeout, args.stall)
        rows.append(row)
        print(f"trial {trial + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()),
              flush=True)
    keys = sorted({k for r in rows for k in r})
    print(f"{args.fault} ({args.launcher}, n={args.n}, AXONDIST_TIMEOUT={args.timeout:g}, "
          f"AXONDIST_STALL_WARNING={args.stall:g}): seconds after the fault, median [min, max]")
    for k in keys:
        values = [r[k] for r in rows if k in r]
        print(f"  {k:>24}: {statistics.median(values):5.1f} [{min(values):.1f}, "
              f"{max(values):.1f}] ({len(values)} of {len(rows)} trials)")


if __name__ == "__main__":
    main()
