"""A big blocking all-reduce as the MPI collective over consecutive pieces.

On one node MPICH moves big messages through shared-memory buffers it maps per call; in
pieces of a few MiB the same memory is reused while it is still mapped and in cache. Each
piece is the MPI library's own collective on its slice, so every element is combined as
MPI combines it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...plan import CallKey
from ..choose import NODE_CHUNK_BYTES
from ..plans import AllReducePlan
from ..transport import piece_bounds

if TYPE_CHECKING:
    from ..backend import MPIBackend


def _bounds(backend: MPIBackend, key: CallKey) -> list[tuple[int, int]]:
    """The pieces of a call of ``key``: at most the backend's chunk size each (the one-node
    default where the layout has none, for a plan made outside the table's choice)."""
    numel = 1
    for d in key.shape:
        numel *= d
    return piece_bounds(numel, key.dtype.itemsize, backend.layout.chunk or NODE_CHUNK_BYTES)


class AllReducePiecesPlan(AllReducePlan):
    """``Allreduce`` piece by piece, then AVERAGE's division over the whole."""

    __slots__ = ("_pieces",)

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._pieces = _bounds(backend, key)

    def _move(self, send: Any, recv: Any) -> Any:
        wire, in_place = self._wire(send).reshape(-1), self._mpi.IN_PLACE
        for lo, hi in self._pieces:
            self._comm.Allreduce(in_place, [wire[lo:hi], self._mtype], self._mop)
        self._finish(send)
        return send


__all__ = ["AllReducePiecesPlan"]
