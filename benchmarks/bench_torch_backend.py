"""axondist's torch backend vs raw torch.distributed (gloo), and vs the MPI backend, in one launch.

    mpiexec -n 2 python benchmarks/bench_torch_backend.py [--json results.json]

Every rank sets torchrun's variables from MPI's rank and size (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``
chosen by rank 0), then makes both worlds in the same processes: the torch backend's
(which starts torch's default gloo group from those variables) and the MPI backend's, each
passed as ``group=`` to the collectives. For each collective and size four variants run
on the same float32 NumPy buffers in alternating timed batches (the order rotates; see
``_common.alternate``), each batch timed on the slowest rank:

* ``torch``: raw ``torch.distributed`` on tensors over the buffers (``torch.from_numpy``,
  no copies) in the torch backend's own default group: the floor of the torch backend.
* ``ax-torch``: ``ad.all_reduce(buf, group=torch_world)`` etc.
* ``ax-mpi``: the same call with ``group=mpi_world``.
* ``mpi4py``: raw mpi4py on ``COMM_WORLD`` (``Allreduce(IN_PLACE)``, ``Allgather``,
  ``Reduce_scatter_block``, ``Bcast``): the floor of the MPI backend.

Collectives: ``all_reduce`` (SUM, in place), ``all_gather`` (with ``sizes``, into a
preallocated ``out``), ``reduce_scatter`` (SUM, into a preallocated block) and
``broadcast`` (from rank 0), ``all_reduce_max`` (MAX, in place), ``all_to_all`` (equal
blocks, the sizes known: the backends' own call, as ``ad.all_to_all`` makes it after its
exchange of sizes; mpi4py's ``Alltoall``), and ``send_recv``: a round trip of the buffer
between ranks 0 and 1 (``ad.send`` and ``ad.recv(out=)``: its shape and dtype, then its
bytes; the other ranks wait). Sizes are each rank's input buffer. The tables give the
median microseconds per call and paired ratios (batch k of one variant over batch k of
the other) as median [q1-q3] over the batches; the JSON has every spread.
``ax-torch/torch`` is the torch backend's overhead (target: at most 1.3 at 1 MiB and 1.15
from 16 MiB; judged on the median); ``ax-torch/ax-mpi`` says how much slower the gloo path is than
the MPI backend (no target). The header says whether the cross-rank checks were on
(both backends read ``AXONDIST_CHECKS``; run once with ``AXONDIST_CHECKS=0`` to time the
calls without them).

Without torch, mpi4py or an MPI launch of two or more ranks the benchmark prints why it
is skipped and exits with status 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    alternate,
    batch_for,
    format_figure,
    format_size,
    format_spread,
    format_table,
    free_port,
    ratio_spread,
    spread,
    write_json,
)

import axondist as ad  # noqa: E402
from axondist._environment import launched_by_mpi  # noqa: E402

# How benchmarks/run.py launches this file (skipped there without torch or mpiexec).
RUNNER = {"ranks": 2, "quick_args": ["--quick"], "timeout": 600, "needs": ["torch"]}

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
QUICK_SIZES = [4 << 10, 1 << 20]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "all_reduce_max",
       "all_to_all")
VARIANTS = ("torch", "ax-torch", "ax-mpi", "mpi4py")
#: The ratios every table shows: the torch backend's overhead, gloo vs MPI through
#: axondist, and the two floors' own ratio.
RATIOS = [("ax-torch", "torch"), ("ax-torch", "ax-mpi"), ("ax-mpi", "mpi4py"),
          ("torch", "mpi4py")]
#: The largest ``ax-torch/torch`` allowed from each size in bytes up (none below the first).
TARGETS = ((1 << 20, 1.3), (16 << 20, 1.15))


def target_for(nbytes: int) -> float | None:
    """The largest ``ax-torch/torch`` allowed for a call of ``nbytes`` (None: no target)."""
    limits = [limit for start, limit in TARGETS if nbytes >= start]
    return limits[-1] if limits else None


def why_skipped() -> str | None:
    """Why this benchmark cannot run here (torch or mpi4py missing, not under mpiexec),
    or None."""
    for module, install in (("torch", "pip install '.[torch]'"),
                            ("mpi4py", "pip install '.[mpi]'")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({install})"
    launch = "launch it with mpiexec -n 2 python benchmarks/bench_torch_backend.py"
    if not launched_by_mpi():
        return f"it needs several ranks and an MPI launcher: {launch}"
    from mpi4py import MPI

    if MPI.COMM_WORLD.size < 2:
        return f"one rank has nothing to exchange: {launch}"
    return None


def make_worlds(comm: Any) -> tuple[ad.World, ad.World]:
    """(torch world, MPI world) over the ranks of ``comm`` (collectives, every rank)."""
    from axondist.backends import mpi
    from axondist.backends import torch as torch_backend

    mpi_world = ad.World(mpi.create_world_backend())
    os.environ.update({"RANK": str(comm.rank), "WORLD_SIZE": str(comm.size),
                       "LOCAL_RANK": str(comm.rank), "LOCAL_WORLD_SIZE": str(comm.size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port(comm))})
    torch_world = ad.World(torch_backend.create_world_backend())
    import torch

    torch.set_num_threads(1)  # one thread per rank, as start_gloo gives the other benchmarks
    return torch_world, mpi_world


def _variants(op: str, nbytes: int, comm: Any, mpi: Any, worlds: tuple[ad.World, ad.World],
              ) -> dict[str, Callable[[], Any]]:
    import torch
    import torch.distributed as dist

    n = comm.size
    tw, mw = worlds
    buf = np.zeros(max(n, nbytes // 4 // n * n), np.float32)  # zeros: sums stay finite
    t = torch.from_numpy(buf)  # shares buf's memory
    if op == "all_reduce":
        return {"torch": lambda: dist.all_reduce(t),
                "ax-torch": lambda: ad.all_reduce(buf, group=tw),
                "ax-mpi": lambda: ad.all_reduce(buf, group=mw),
                "mpi4py": lambda: comm.Allreduce(mpi.IN_PLACE, buf, mpi.SUM)}
    if op == "all_gather":
        out = np.zeros(buf.size * n, np.float32)
        tout, sizes = torch.from_numpy(out), [buf.size] * n
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return {"torch": lambda: gather(tout, t),
                "ax-torch": lambda: ad.all_gather(buf, group=tw, sizes=sizes, out=out),
                "ax-mpi": lambda: ad.all_gather(buf, group=mw, sizes=sizes, out=out),
                "mpi4py": lambda: comm.Allgather(buf, out)}
    if op == "reduce_scatter":
        mine = np.zeros(buf.size // n, np.float32)
        tmine = torch.from_numpy(mine)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return {"torch": lambda: scatter(tmine, t),
                "ax-torch": lambda: ad.reduce_scatter(buf, group=tw, out=mine),
                "ax-mpi": lambda: ad.reduce_scatter(buf, group=mw, out=mine),
                "mpi4py": lambda: comm.Reduce_scatter_block(buf, mine, mpi.SUM)}
    if op == "all_reduce_max":
        return {"torch": lambda: dist.all_reduce(t, dist.ReduceOp.MAX),
                "ax-torch": lambda: ad.all_reduce(buf, "max", group=tw),
                "ax-mpi": lambda: ad.all_reduce(buf, "max", group=mw),
                "mpi4py": lambda: comm.Allreduce(mpi.IN_PLACE, buf, mpi.MAX)}
    if op == "all_to_all":
        out = np.zeros_like(buf)
        tout, counts = torch.from_numpy(out), [buf.size // n] * n
        return {"torch": lambda: dist.all_to_all_single(tout, t),
                "ax-torch": lambda: tw.backend.all_to_all(buf, out, counts, counts).wait(),
                "ax-mpi": lambda: mw.backend.all_to_all(buf, out, counts, counts).wait(),
                "mpi4py": lambda: comm.Alltoall(buf, out)}
    if op == "send_recv":
        return _round_trips(comm, mpi, buf, t, worlds)
    return {"torch": lambda: dist.broadcast(t, 0),
            "ax-torch": lambda: ad.broadcast(buf, group=tw, src=0),
            "ax-mpi": lambda: ad.broadcast(buf, group=mw, src=0),
            "mpi4py": lambda: comm.Bcast(buf, 0)}


def _round_trips(comm: Any, mpi: Any, buf: np.ndarray, t: Any,
                 worlds: tuple[ad.World, ad.World]) -> dict[str, Callable[[], Any]]:
    """Rank 0 sends ``buf`` to rank 1, which sends it back; the other ranks do nothing."""
    import torch.distributed as dist

    tw, mw = worlds
    if comm.rank > 1:
        return {k: lambda: None for k in VARIANTS}
    peer = 1 - comm.rank

    def both(send: Callable[[], Any], recv: Callable[[], Any]) -> Callable[[], None]:
        def trip() -> None:
            if comm.rank == 0:
                send()
                recv()
            else:
                recv()
                send()
        return trip

    return {"torch": both(lambda: dist.send(t, peer), lambda: dist.recv(t, peer)),
            "ax-torch": both(lambda: ad.send(buf, peer, group=tw),
                             lambda: ad.recv(peer, group=tw, out=buf)),
            "ax-mpi": both(lambda: ad.send(buf, peer, group=mw),
                           lambda: ad.recv(peer, group=mw, out=buf)),
            "mpi4py": both(lambda: comm.Send(buf, peer), lambda: comm.Recv(buf, peer))}


def run(sizes: list[int], repeats: int, ops: tuple[str, ...] = OPS) -> dict[str, Any]:
    """Time every op and size; returns the results (the same on every rank's call)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    worlds = make_worlds(comm)
    checks: Any = worlds[0].backend_for("bench").options["checks"]
    results: dict[str, Any] = {"world_size": comm.size, "repeats": repeats,
                               "checks": bool(checks), "ops": {}}
    for op in ops:
        rows = results["ops"][op] = []
        for nbytes in sizes:
            fns = _variants(op, nbytes, comm, MPI, worlds)
            times = alternate(fns, batch=batch_for(nbytes, 32 << 20, hi=500), repeats=repeats,
                              comm=comm)  # each batch: the slowest rank's time
            row: dict[str, Any] = {"bytes": nbytes}
            row.update({f"{k}_us": spread(times[k], 1e6) for k in VARIANTS})
            row.update({f"{a}/{b}": ratio_spread(times[a], times[b]) for a, b in RATIOS})
            limit = target_for(nbytes) if op != "send_recv" else None
            if limit is not None:
                row["meets_target"] = bool(row["ax-torch/torch"]["median"] <= limit)
            rows.append(row)
    return results


def report(results: dict[str, Any]) -> str:
    """The tables as text."""
    out = [f"world size {results['world_size']}, checks {'on' if results['checks'] else 'off'}; "
           f"us per call: median over {results['repeats']} timed batches (the slowest rank's); "
           "ratios paired by batch: median [q1-q3]; target ax-torch/torch <= "
           + ", ".join(f"{limit:g} from {format_size(start)}" for start, limit in TARGETS)]
    ratios = [f"{a}/{b}" for a, b in RATIOS]
    header = ["size", *VARIANTS, *ratios, "target"]
    for op, rows in results["ops"].items():
        table = [[format_size(r["bytes"]),
                  *(format_figure(r[f"{k}_us"]["median"]) for k in VARIANTS),
                  *(format_spread(r[k], quartiles=True) for k in ratios),
                  ("met" if r["meets_target"] else "MISSED") if "meets_target" in r else "-"]
                 for r in rows]
        out += ["", op, format_table(header, table)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results as JSON to this path (rank 0)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="buffer sizes in bytes (default: 4 KiB, 64 KiB, 1 MiB, 16 MiB)")
    parser.add_argument("--repeats", type=int, default=12,
                        help="timed batches per variant (a multiple of 8 balances the order "
                             "of the four variants)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS),
                        help="collectives to time")
    parser.add_argument("--quick", action="store_true",
                        help="a fast pass: 3 repeats, 4 KiB and 1 MiB (unless given)")
    args = parser.parse_args(argv)
    why = why_skipped()
    if why is not None:
        print(f"bench_torch_backend: skipped: {why}", flush=True)
        return None
    repeats = 3 if args.quick else args.repeats
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    results = run(sizes, repeats, tuple(args.ops))
    from mpi4py import MPI

    if MPI.COMM_WORLD.rank == 0:
        print(report(results), flush=True)
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
