"""The MPI backend's plans of the calls whose blocks differ by rank: ``Gatherv``,
``Scatterv`` and ``Alltoallv`` (or one message to each rank), checked like every MPI plan
(:class:`~.plans.MPIPlan`).

Their keys hold the row counts (a gather's and a scatter's of every rank, an all-to-all's
this rank's rows to and from each), so a plan resolves its counts and displacements once.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any

from ...errors import CollectiveMismatchError
from ..plan import CallKey, split_sizes
from .plans import _Transfer
from .transport import displacements

if TYPE_CHECKING:
    from .backend import MPIBackend


class GatherPlan(_Transfer):
    """``Gatherv`` of every rank's rows into the root's result (None on the others)."""

    __slots__ = ("_counts", "_displs")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        row = prod(key.shape[1:])
        self._counts = [r * row for r in key.counts or ()]
        self._displs = displacements(self._counts)

    def _buffers(self, send: Any, recv: Any) -> tuple[Any, list[Any], list[Any] | None]:
        if self._b.rank != self.key.root:
            return None, self._spec(send), None
        out = self._output(recv)
        view, mtype = self._spec(out)
        return out, self._spec(send), [view, self._counts, self._displs, mtype]

    def _move(self, send: Any, recv: Any) -> Any:
        out, s, r = self._buffers(send, recv)
        self._comm.Gatherv(s, r, self.key.root)
        return out

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        out, s, r = self._buffers(send, recv)
        return [self._comm.Igatherv(s, r, self.key.root)], None, out


class ScatterPlan(_Transfer):
    """``Scatterv`` of the root's rows, block r to rank r."""

    __slots__ = ("_counts", "_displs")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        row = prod(key.shape[1:])
        rows = key.counts if key.counts is not None else split_sizes(key.shape[0],
                                                                     backend.world_size)
        self._counts = [r * row for r in rows]
        self._displs = displacements(self._counts)

    def _buffers(self, send: Any, recv: Any) -> tuple[Any, list[Any] | None, list[Any]]:
        out = self._output(recv)
        whole = None
        if self._b.rank == self.key.root:
            view, mtype = self._spec(send)
            whole = [view, self._counts, self._displs, mtype]
        return out, whole, self._spec(out)

    def _move(self, send: Any, recv: Any) -> Any:
        out, s, r = self._buffers(send, recv)
        self._comm.Scatterv(s, r, self.key.root)
        return out

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        out, s, r = self._buffers(send, recv)
        return [self._comm.Iscatterv(s, r, self.key.root)], None, out


class AllToAllPlan(_Transfer):
    """``Alltoallv``: this rank's block for rank d to d; the result holds the blocks every
    rank sent this one, in rank order."""

    __slots__ = ("_sent", "_came")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        n, row = backend.world_size, prod(key.shape[1:])
        counts = [c * row for c in key.counts or ()]
        sent, came = counts[:n], counts[n:]
        self._sent = (sent, displacements(sent))
        self._came = (came, displacements(came))

    def _buffers(self, send: Any, recv: Any) -> tuple[Any, list[Any], list[Any]]:
        out = self._output(recv)
        (s, stype), (r, rtype) = self._spec(send), self._spec(out)
        return out, [s, *self._sent, stype], [r, *self._came, rtype]

    def _move(self, send: Any, recv: Any) -> Any:
        out, s, r = self._buffers(send, recv)
        self._comm.Alltoallv(s, r)
        return out

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        out, s, r = self._buffers(send, recv)
        return [self._comm.Ialltoallv(s, r)], None, out


#: The tag of a point-to-point all-to-all's messages on the checks' communicator (the
#: two-rank algorithms' tags are 1, 2 and 5).
ALL_TO_ALL_TAG = 6


class PointToPointAllToAllPlan(AllToAllPlan):
    """A blocking all-to-all as one exchange with each other rank, on the checks' own
    communicator after the check: in step ``d`` rank ``r`` sends to ``r + d`` while it
    receives from ``r - d`` (``Sendrecv``, as MPICH's own ``Alltoall`` moves big blocks),
    this rank's own block copied first. Each message lands in its place in the result; a
    message shorter than the block it fills (a rank whose counts disagree with this one's)
    raises on the rank that receives it, after every step, so no message is left behind."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Any:
        out = self._output(recv)
        comm, mpi, me = self._guard.comm, self._mpi, self._b.rank
        assert comm is not None  # the table's rule: the check is on
        n = self._b.world_size
        (sent, sent_at), (came, came_at) = self._sent, self._came
        flat_in, flat_out = send.reshape(-1), out.reshape(-1)
        flat_out[came_at[me]:came_at[me] + came[me]] = flat_in[sent_at[me]:sent_at[me] + sent[me]]
        status, short = mpi.Status(), None
        for d in range(1, n):
            to, source = (me + d) % n, (me - d) % n
            comm.Sendrecv(self._spec(flat_in[sent_at[to]:sent_at[to] + sent[to]]), to,
                          ALL_TO_ALL_TAG,
                          self._spec(flat_out[came_at[source]:came_at[source] + came[source]]),
                          source, ALL_TO_ALL_TAG, status)
            got = status.Get_count(self._mtype)
            if got != came[source] and short is None:
                short = (source, got)
        if short is not None:
            source, got = short
            raise CollectiveMismatchError(
                f"all_to_all: rank {source} sent this rank {got} elements where this rank's "
                f"counts expect {came[source]}; every rank's send counts must be the receive "
                "counts of the rank it sends to (axondist.all_to_all exchanges them)")
        return out


__all__ = ["ALL_TO_ALL_TAG", "AllToAllPlan", "GatherPlan", "PointToPointAllToAllPlan",
           "ScatterPlan"]
