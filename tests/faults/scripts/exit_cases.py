"""Correct torch jobs that end by reaching the end of their script, as per-rank programs:
``torchrun --nproc-per-node N exit_cases.py CASE torch`` (see ``fault_cases.main``). Each
rank prints ``CASE OK`` last; the process must then exit with status 0, whatever threads
torch and axondist still hold.

``one_all_reduce``: ``init`` and one all-reduce. ``threads_and_groups``: also a
non-blocking all-reduce (a thread issues it), a small send and its receive (a thread sends
it), a group left undestroyed and a destroyed one.

``torchrun ... exit_cases.py rounds torch R DIR`` runs R such jobs one after another, the
cases in turn, while importing torch once per rank: each round but the last is a process
forked from the rank (before any torch.distributed state exists) that joins a world of its
own on a port rank 0 writes to ``DIR/round-K.port``, runs its case and exits through the
interpreter's own finalization; the last round is the torchrun rank itself. A round's exit
status is checked by its rank, which prints ``round K (CASE) of rank R: ...`` for every
round that did not exit with status 0, then ``rounds OK rank R`` when all did.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402


def one_all_reduce(world: ad.World) -> None:
    x = np.ones(4)
    ad.all_reduce(x)
    assert x[0] == world.world_size, x
    print(f"one_all_reduce OK rank {world.rank}", flush=True)


def threads_and_groups(world: ad.World) -> None:
    n, rank = world.world_size, world.rank
    kept = world.new_group(list(range(n)))  # never destroyed: the exit frees it
    with world.new_group(list(range(n))) as group:
        ad.all_reduce(np.ones(2), group=group)
    x = np.ones(8)
    ad.all_reduce(x, group=kept, async_op=True).wait()
    ad.send(np.full(3, float(rank)), dst=(rank + 1) % n)
    got = ad.recv(src=(rank - 1) % n)
    assert x[0] == n and got[0] == (rank - 1) % n, (x, got)
    print(f"threads_and_groups OK rank {rank}", flush=True)


CASES = {fn.__name__: fn for fn in (one_all_reduce, threads_and_groups)}
ROUND_LIMIT = 60.0  # seconds one round may take before its rank gives up on the run


def _round_port(folder: Path, k: int, rank: int) -> str:
    """The port of round ``k``'s world: rank 0 finds a free one and writes it down, the
    others wait for the file (written whole: a rename)."""
    path = folder / f"round-{k}.port"
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = str(probe.getsockname()[1])
        path.with_suffix(".tmp").write_text(port)
        path.with_suffix(".tmp").rename(path)
        return port
    give_up = time.monotonic() + ROUND_LIMIT
    while not path.exists():
        if time.monotonic() > give_up:
            raise SystemExit(f"rank {rank}: rank 0 never wrote {path}")
        time.sleep(0.01)
    return path.read_text()


def _join_and_run(case: str) -> None:
    CASES[case](ad.init("torch"))


def rounds(count: int, folder: Path) -> None:
    """Run ``count`` rounds (see the module docstring); exit 1 when a forked round did not
    exit with status 0."""
    import torch  # noqa: F401  # once, in the rank: every forked round has it already

    rank = int(os.environ["RANK"])
    failed = []
    for k in range(count):
        case = tuple(CASES)[k % len(CASES)]
        os.environ.update(MASTER_PORT=_round_port(folder, k, rank),
                          TORCHELASTIC_USE_AGENT_STORE="False")
        if k == count - 1:  # the last round: the torchrun rank's own exit
            if failed:
                print("\n".join(failed), flush=True)
                sys.exit(1)
            print(f"rounds OK rank {rank}", flush=True)
            gc.unfreeze()  # as in any torchrun rank
            _join_and_run(case)
            return
        gc.freeze()  # the round's exit collects only what it made (see torch_cases.main)
        pid = os.fork()
        if pid == 0:
            _join_and_run(case)
            sys.exit(0)  # unwinds to the interpreter's own exit, as a script's end does
        _, status = os.waitpid(pid, 0)
        if status != 0:
            failed.append(f"round {k} ({case}) of rank {rank}: exit status "
                          f"{os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    if sys.argv[1] == "rounds":
        rounds(int(sys.argv[3]), Path(sys.argv[4]))
    else:
        main(CASES)
