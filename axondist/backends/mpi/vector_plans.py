"""The MPI backend's plans of the calls whose blocks differ by rank: ``Gatherv``,
``Scatterv`` and ``Alltoallv``, checked like every MPI plan (:class:`~.plans.MPIPlan`).

Their keys hold the row counts (a gather's and a scatter's of every rank, an all-to-all's
this rank's rows to and from each), so a plan resolves its counts and displacements once.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any

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


__all__ = ["AllToAllPlan", "GatherPlan", "ScatterPlan"]
