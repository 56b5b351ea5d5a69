"""The messages of axondist's two-rank plans, sent by plain mpi4py: the floor of a checked call.

A checked two-rank call cannot cost less than the messages its plan exchanges. Here those
messages run with no library code around them, on a communicator of their own: each
rank's 24-byte check header swapped by persistent requests, and the data either riding
in the header's message (``ride``: the table's ``PAIR_RIDE``) or sent ahead of it on
another tag and received after it (``ahead``: ``PAIR_EXCHANGE``), then the same local
work (a reduce-scatter's sum, an all-gather's own block copied into place). The header
is read as the plans read it. ``axondist/protocol`` is then what the library itself adds
to a call: finding the plan, numbering and recording the call, checking its buffers.

Only the calls whose plan is one of these two have a floor here (:func:`floor_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from axondist.backends.mpi.choose import Algorithm, choose
from axondist.backends.mpi.guard import AHEAD_TAG, HEADER, PAIR_TAG
from axondist.backends.plan import CallKey
from axondist.ops import ReduceOp

#: The plans' header in int64 words: the call's hash, a disagreement flag, the size word.
HEADER_WORDS = HEADER // 8


class _Swap:
    """A persistent header swap with the other rank; ``room`` bytes of data may ride."""

    def __init__(self, comm: Any, mpi: Any, room: int) -> None:
        words = HEADER_WORDS + -(-room // 8)
        self.outgoing = np.zeros(words, np.int64)
        self.incoming = np.zeros(words, np.int64)
        self.outgoing[0] = 12345
        peer = 1 - comm.rank
        self._mpi = mpi
        self._requests = [comm.Send_init(self.outgoing, peer, PAIR_TAG),
                          comm.Recv_init(self.incoming, peer, PAIR_TAG)]

    def run(self) -> None:
        self._mpi.Prequest.Startall(self._requests)
        self._mpi.Request.Waitall(self._requests)
        seen = self.incoming
        if seen[1] or seen[0] != 12345:
            raise RuntimeError("the other rank's header differs")

    def riding(self, dtype: np.dtype, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The outgoing and incoming data after the headers, as ``count`` of ``dtype``."""
        def data(words: np.ndarray) -> np.ndarray:
            return words[HEADER_WORDS:].view(np.uint8)[:count * dtype.itemsize].view(dtype)
        return data(self.outgoing), data(self.incoming)

    def free(self) -> None:
        for request in self._requests:
            request.Free()


def floor_of(op: str, key: CallKey, layout: Any, comm: Any, mpi: Any, send: np.ndarray,
             out: np.ndarray | None) -> tuple[Callable[[], None], Callable[[], None]] | None:
    """The protocol of the plan the table chooses for ``key`` on ``layout``, as a callable
    on ``send`` (and ``out``: a reduce-scatter's block, an all-gather's result), and what
    frees its requests; None when that plan is not a two-rank ride or exchange (or
    ``comm``, a communicator of its own, is not two ranks)."""
    found = _protocol(op, algorithm=choose(key, layout), comm=comm, mpi=mpi, send=send,
                      out=out)
    return None if found is None else (found[0], found[1].free)


def _protocol(op: str, algorithm: Algorithm, comm: Any, mpi: Any, send: np.ndarray,
              out: np.ndarray | None) -> tuple[Callable[[], None], _Swap] | None:
    if comm.size != 2:
        return None
    if algorithm not in (Algorithm.PAIR_RIDE, Algorithm.PAIR_EXCHANGE):
        return None
    rank, peer = comm.rank, 1 - comm.rank
    n = send.size
    first = n if op == "all_gather" else (n + 1) // 2
    halves = (slice(0, first), slice(first, 2 * first)) if op == "all_gather" else (
        slice(0, first), slice(first, n))
    mine, theirs = halves if rank == 0 else halves[::-1]
    ride = algorithm is Algorithm.PAIR_RIDE
    if op == "reduce_scatter":
        assert out is not None
        sent = send[theirs]
        swap = _Swap(comm, mpi, sent.nbytes if ride else 0)
        if ride:
            outgoing, incoming = swap.riding(send.dtype, sent.size)

            def reduce_scatter() -> None:
                outgoing[...] = send[theirs]
                swap.run()
                np.add(send[mine], incoming, out=out)
            return reduce_scatter, swap
        def reduce_scatter_ahead() -> None:  # received into the result, as the plan does
            ahead = comm.Isend(send[theirs], peer, AHEAD_TAG)
            swap.run()
            comm.Recv(out, peer, AHEAD_TAG)
            ahead.Wait()
            np.add(send[mine], out, out=out)
        return reduce_scatter_ahead, swap
    if op == "all_gather":
        assert out is not None
        swap = _Swap(comm, mpi, send.nbytes if ride else 0)
        if ride:
            outgoing, incoming = swap.riding(send.dtype, send.size)

            def all_gather() -> None:
                outgoing[...] = send
                swap.run()
                out[theirs] = incoming
                out[mine] = send
            return all_gather, swap

        def all_gather_ahead() -> None:
            ahead = comm.Isend(send, peer, AHEAD_TAG)
            swap.run()
            comm.Recv(out[theirs], peer, AHEAD_TAG)
            out[mine] = send
            ahead.Wait()
        return all_gather_ahead, swap
    swap = _Swap(comm, mpi, 0)  # broadcast: the root's values ahead of the check

    def broadcast() -> None:
        if rank == 0:
            ahead = comm.Isend(send, peer, AHEAD_TAG)
            swap.run()
            ahead.Wait()
        else:
            swap.run()
            comm.Recv(send, 0, AHEAD_TAG)
    return broadcast, swap


def key_of(op: str, send: np.ndarray, rows: int | None = None) -> CallKey:
    """The key of the benchmark's blocking call ``op`` on ``send`` (an all-gather's with
    both ranks' ``rows`` given)."""
    if op == "reduce_scatter":
        return CallKey.of(op, send, reduce_op=ReduceOp.SUM)
    if op == "all_gather":
        return CallKey.of(op, send, counts=(rows, rows))
    return CallKey.of(op, send, root=0)
