"""Ring attention: step time against max(compute, transfer), and parallel efficiency.

    python benchmarks/bench_context_parallel.py               # mock world, 4 ranks on threads
    mpiexec -n 4 python benchmarks/bench_context_parallel.py  # MPI, one rank per process

For each per-rank token count ``T`` (``--tokens``; the sequence is ``W * T``) every
rank measures, all ranks at once, barrier before and after, the slowest rank's time:

* ``compute``: one ring step's block (``T`` queries against ``T`` keys, non-causal,
  so every step costs the same);
* ``transfer``: one ring exchange of a key/value block, nothing computed;
* ``ring``: the whole ``attention(..., method="ring", causal=False)`` forward.

The ring's ``W - 1`` transfers each overlap one block, so it should take
``(W - 1) * max(compute, transfer) + compute`` (``overlapped``) rather than
``(W - 1) * (compute + transfer) + compute`` (``serial``); ``ring/overlapped`` near 1
and ``ring/serial`` below 1 show the overlap, once compute is large enough to hide the
transfer. ``efficiency`` is the one-rank forward and backward of the whole sequence
(rank 0 alone, the others asleep) over ``W`` times the ring's forward and backward:
1 is perfect scaling (on a machine with fewer cores than ranks it cannot be).
Medians (min-max) over ``--repeats`` timed runs after one warm-up; only rank 0 prints;
``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one BLAS thread per rank: ranks are the parallelism

import numpy as np  # noqa: E402
from _common import format_spread, format_table, ratio_spread, spread, write_json  # noqa: E402

import axondist as ad  # noqa: E402
from axondist import context_parallel as cp  # noqa: E402
from axondist.context_parallel.kernel import MaskRule, block_forward, block_mask  # noqa: E402
from axondist.context_parallel.ring_link import KV_TAG, RingLink  # noqa: E402
from axondist.launching.worlds import launched_by_mpi  # noqa: E402

#: How benchmarks/run.py runs this file.
RUNNER = {"ranks": 4, "quick_args": ["--repeats", "3", "--tokens", "64", "256"]}


def idle_barrier(world: ad.ProcessGroup) -> None:
    """A barrier that sleeps while it waits (MPI's blocking one spins, stealing a core)."""
    if launched_by_mpi():
        from mpi4py import MPI

        request = MPI.COMM_WORLD.Ibarrier()
        while not request.Test():
            time.sleep(0.002)
    else:
        ad.barrier(world)


def timed(world: ad.ProcessGroup, fn: Callable[[], Any], repeats: int) -> list[float]:
    """The slowest rank's seconds for ``fn``, ``repeats`` times after one warm-up."""
    times = []
    for rep in range(repeats + 1):
        idle_barrier(world)
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        idle_barrier(world)
        if rep:
            times.append(ad.all_reduce_scalar(elapsed, "max", group=world))
    return times


def measure(world: ad.ProcessGroup, tokens: int, args: argparse.Namespace,
            solo: ad.ProcessGroup) -> dict[str, Any]:
    w, r = world.world_size, world.rank
    n = w * tokens
    rng = np.random.default_rng(r)
    q, k, v, go = (rng.standard_normal((args.heads, tokens, args.dim)).astype(np.float32)
                   for _ in range(4))
    pos = np.arange(tokens)
    mask = block_mask(MaskRule(False), pos, pos, np)
    kg, vg = k[:, None].astype(np.float32), v[:, None].astype(np.float32)
    qg = q[:, None]
    kv = np.concatenate([k.reshape(-1), v.reshape(-1)])
    incoming = np.empty_like(kv)
    backend = world.backend_for("bench")

    def compute() -> None:
        block_forward(qg, kg, vg, mask, 0.125)

    def transfer() -> None:
        with RingLink(backend) as link:
            link.start(kv, incoming, KV_TAG).wait()

    def ring() -> None:
        cp.attention(q, k, v, world, causal=False, method="ring")

    def ring_step() -> None:
        out, lse = cp.attention(q, k, v, world, causal=False, method="ring")
        cp.attention_backward(q, k, v, out, lse, go, world, causal=False, method="ring")

    c, x, t = (timed(world, fn, args.repeats) for fn in (compute, transfer, ring))
    overlapped = [(w - 1) * max(ci, xi) + ci for ci, xi in zip(c, x)]
    serial = [(w - 1) * (ci + xi) + ci for ci, xi in zip(c, x)]
    both = timed(world, ring_step, args.repeats)
    full = [a for a in (rng.standard_normal((args.heads, n, args.dim)).astype(np.float32)
                        for _ in range(4))]

    def one_rank() -> None:
        if r == 0:
            out, lse = cp.attention(*full[:3], solo, causal=False)
            cp.attention_backward(*full[:3], out, lse, full[3], solo, causal=False)

    alone = timed(world, one_rank, args.repeats)
    return {"tokens_per_rank": tokens, "sequence": n,
            "kv_block_bytes": int(kv.nbytes),
            "compute_ms": spread(c, 1e3), "transfer_ms": spread(x, 1e3),
            "ring_ms": spread(t, 1e3),
            "ring/overlapped": ratio_spread(t, overlapped),
            "ring/serial": ratio_spread(t, serial),
            "one_rank_fwd_bwd_ms": spread(alone, 1e3), "ring_fwd_bwd_ms": spread(both, 1e3),
            "efficiency": spread([a / (w * b) for a, b in zip(alone, both)])}


def run(world: ad.ProcessGroup, args: argparse.Namespace) -> list[dict[str, Any]]:
    solo = world.new_group([0])
    try:
        return [measure(world, t, args, solo) for t in args.tokens]
    finally:
        solo.destroy()


def report(rows: list[dict[str, Any]], where: str, ranks: int) -> str:
    head = f"Ring attention on {where}, {ranks} ranks ({os.cpu_count()} CPUs), float32"
    return head + "\n" + format_table(
        ["T/rank", "N", "compute ms", "transfer ms", "ring ms", "ring/overlapped",
         "ring/serial", "efficiency"],
        [[row["tokens_per_rank"], row["sequence"], format_spread(row["compute_ms"]),
          format_spread(row["transfer_ms"]), format_spread(row["ring_ms"]),
          format_spread(row["ring/overlapped"]), format_spread(row["ring/serial"]),
          format_spread(row["efficiency"])] for row in rows])


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="mock world size (MPI: the job's)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512],
                    help="tokens per rank")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per figure (>= 3)")
    ap.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = ap.parse_args(argv)
    if args.repeats < 3:
        ap.error(f"--repeats must be at least 3 (a median and a spread), got {args.repeats}")
    if launched_by_mpi():
        world = ad.init("mpi")
        rows, where, rank = run(world, args), "MPI", world.rank
    else:
        rows, where, rank = ad.spawn(run, args.ranks, args)[0], "the mock world", 0
    results = {where: rows}
    if rank == 0:
        print(report(rows, where, args.ranks if where != "MPI" else ad.world_size()), flush=True)
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
