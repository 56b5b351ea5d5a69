"""The MPI backend's all-gathers: the sized one (blocking, checked, its data carried with
the check in a two-rank group up to ``RIDE_MAX_BYTES`` or moved point to point past it;
non-blocking, checked in ``wait()``) and the unsized one, whose row counts travel with
its check.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

import numpy as np

from .. import _array
from ..errors import CollectiveMismatchError, InvalidBufferError
from ._mpi_carriers import PairMove, RowCarrier
from ._mpi_common import (
    MPIWork,
    copy_back,
    displacements,
    raise_mpi_error,
    unsupported,
)
from ._mpi_core import MPIBackendBase, bind_mpi
from ._mpi_guard import UNPLANNED
from ._rows import row_fingerprint, rows_mismatch
from .base import (
    CompletedWork,
    Signature,
    Work,
)

# Bound when mpi4py loads (_mpi_core.bind_mpi): module globals keep the hot path to plain
# lookups.
MPI: Any = None
_IN_PLACE: Any = None
bind_mpi(globals())


_NDARRAY = np.ndarray

#: The counts an unsized all-gather's check names (what a rank with ``sizes=`` differs in).
_ROWS_NOT_GIVEN = "not given"


def _row_size(trailing: tuple[int, ...]) -> int:
    """Elements per row of a trailing shape."""
    return prod(trailing)


def _bad_rows_out(out: Any, send: Any, shape: tuple[int, ...]) -> InvalidBufferError:
    return InvalidBufferError(f"all_gather: out is {_array.describe(out)} but the result is "
                              f"{send.dtype}{list(shape)}; pass an array of that shape and "
                              "dtype, or no out")


class GatherMixin(MPIBackendBase):
    """The all-gathers of :class:`~axondist.backends.mpi.MPIBackend`."""

    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   signature: Signature = (), async_op: bool = False) -> Work:
        """``Allgather`` of ``send`` into ``recv`` (``Allgatherv`` for uneven ``counts``).

        Raises:
            CollectiveMismatchError: ``counts`` does not list one size per rank.
            InvalidBufferError: ``send`` or ``recv`` does not hold what ``counts`` says.
        """
        counts = counts if type(counts) is list else [int(c) for c in counts]
        total = sum(counts)
        if (len(counts) != self.world_size or send.size != counts[self.rank]
                or recv.size != total):
            raise self._bad_counts("all_gather", counts, (("send", send, counts[self.rank]),
                                                          ("recv", recv, total)))
        if ((type(send) is not np.ndarray or type(recv) is not np.ndarray or self._stage_always)
                and self._needs_host(send, recv)):
            return self._via_host(
                lambda s, r: self._host.all_gather(s, r, counts, signature=signature,
                                                   async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("all_gather", signature + (("counts", tuple(counts)),), async_op)
        if not async_op:
            self._checked_all_gather(send, recv, counts)
            return CompletedWork(recv)
        return self._issue("all_gather", (send.dtype, tuple(counts), async_op),
                           self._all_gather_start, send, recv, counts)

    def _all_gather_start(self, send: Any, recv: Any, counts: list[int]) -> Work:
        s, r, mtype = self._gather_buffers(send, recv)
        try:
            if counts.count(counts[0]) == len(counts):
                request = self._comm.Iallgather([s, mtype], [r, mtype])
            else:
                request = self._comm.Iallgatherv([s, mtype],
                                                 [r, counts, displacements(counts), mtype])
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_gather")
        return MPIWork([request], None, recv, "all_gather")

    def _gather_buffers(self, send: Any, recv: Any) -> tuple[Any, Any, Any]:
        """(send view, recv view, MPI datatype) for an all-gather."""
        plan = self._transfer_plans.get(send.dtype)
        rplan = plan if recv.dtype is send.dtype else self._transfer_plans.get(recv.dtype)
        if plan is None or rplan is None:
            raise unsupported("all_gather", send.dtype if plan is None else recv.dtype)
        view, mtype = plan
        return (send if view is None else send.view(view),
                recv if rplan[0] is None else recv.view(rplan[0]), mtype)

    def all_gather_blocking(self, send: Any, recv: Any, counts: list[int]) -> None:
        """The blocking :meth:`all_gather` without a Work object (see
        :meth:`all_reduce_blocking`); ``counts`` is a list of ints the caller checked
        against the group and the buffers."""
        if self._slow:
            self.all_gather(send, recv, counts, signature=(("dtype", send.dtype),))
            return
        self._checked_all_gather(send, recv, counts)

    def _checked_all_gather(self, send: Any, recv: Any, counts: list[int]) -> None:
        """A blocking all-gather, numbered, recorded and checked; in a two-rank group a
        small one's data rides with the check (:meth:`CallGuard.carrier`)."""
        key = (send.dtype, tuple(counts), False)
        guard = self._guard
        group, seq = guard.group, next(guard.seqs)
        rec = guard.rec
        slot = rec.begin(group, seq, "all_gather", key)
        try:
            if guard.checks:
                carrier = guard.carriers.get(("all_gather", key), UNPLANNED)
                if carrier is UNPLANNED:
                    carrier = self._plan_all_gather(key, send, counts)
                if carrier is None:
                    guard.agree("all_gather", key)
                elif carrier.__class__ is PairMove:  # too big to ride: point to point
                    flat = recv if recv.ndim == 1 else recv.reshape(-1)
                    view, mtype = carrier.view, carrier.mtype
                    into = flat[carrier.give]
                    guard.move(carrier, "all_gather", key,
                               [send if view is None else send.view(view), mtype],
                               [into if view is None else into.view(view), mtype])
                    # after the data: MPI moves a message between ranks on one node only
                    # while the receiver is inside an MPI call, which this copy would delay
                    flat[carrier.keep] = send if send.ndim == 1 else send.reshape(-1)
                    return
                elif send.__class__ is recv.__class__ is _NDARRAY or (
                        isinstance(send, np.ndarray) and isinstance(recv, np.ndarray)):
                    flat = send if send.ndim == 1 else send.reshape(-1)
                    carrier.mine[...] = flat
                    guard.carry(carrier, "all_gather", key)
                    rows = recv if recv.ndim == 1 else recv.reshape(-1)
                    rows[carrier.keep] = flat
                    rows[carrier.give] = carrier.theirs
                    return
                else:
                    guard.agree("all_gather", key, riding=False)
            self._all_gather_now(send, recv, counts)
        finally:
            rec.end_blocking(slot, group, seq)

    def _plan_all_gather(self, key: tuple[Any, ...], send: Any, counts: list[int]) -> Any:
        """All-gather ``key``'s :class:`Carrier`, or its :class:`PairMove` where the data is
        too big to ride (``keep`` and ``give`` the slices of the flat result for this
        rank's part and the other's), or None where neither applies; kept by the guard."""
        rank, first = self.rank, counts[0]
        pair = self.world_size == 2  # (the guard gives None in other groups)
        guard = self._guard
        carrier: Any = guard.carrier("all_gather", key, sum(counts) * send.dtype.itemsize,
                                     send.dtype, (counts[rank],),
                                     (counts[1 - rank] if pair else 0,))
        if carrier is None and guard.moves_data(max(counts) * send.dtype.itemsize,
                                                self._chunk):
            plan = self._transfer_plans.get(send.dtype)
            if plan is None:
                raise unsupported("all_gather", send.dtype)
            carrier = guard.pair_move("all_gather", key, *plan)
        if carrier is not None:
            carrier.keep, carrier.give = ((slice(0, first), slice(first, None)) if rank == 0
                                          else (slice(first, None), slice(0, first)))
        return carrier

    def _all_gather_now(self, send: Any, recv: Any, counts: list[int]) -> None:
        plan = self._transfer_plans.get(send.dtype)
        if plan is not None and plan[0] is None and recv.dtype is send.dtype:
            s, r, mtype = send, recv, plan[1]  # a native MPI type: no views
        else:
            s, r, mtype = self._gather_buffers(send, recv)
        try:
            if counts.count(counts[0]) == len(counts):  # the common case needs no displs
                self._comm.Allgather([s, mtype], [r, mtype])
            else:
                self._comm.Allgatherv([s, mtype], [r, counts, displacements(counts), mtype])
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_gather")

    def all_gather_rows_blocking(self, send: Any, out: Any | None) -> Any:
        """All-gather of ``send``'s rows (along axis 0) when no rank knows the others' row
        counts: dtype and trailing shape agree on every rank, the counts need not.

        The counts travel with the call's check: in a two-rank group one swap carries
        both ranks' headers (the call's hash, their rows) and, where they fit in
        ``RIDE_MAX_BYTES``, the rows themselves (:class:`RowCarrier`); rows that did not
        ride follow in one ``Allgatherv``. Otherwise the check goes first, then an
        ``Allgather`` of each rank's count and a fingerprint of its dtype and trailing
        shape (compared even with the checks off), then the rows' ``Allgatherv``: the
        check and the counts cover the data call, which runs unchecked. Arrays other
        than NumPy go through host copies.

        Args:
            send: this rank's rows, at least 1-D, C-contiguous.
            out: where the rows go (every rank's, in rank order), or None for a new array.

        Returns:
            ``out``, or the new array.

        Raises:
            CollectiveMismatchError: ranks differ in dtype or trailing shape, or one of
                them makes another call.
            InvalidBufferError: ``out`` does not have the gathered shape and dtype.
        """
        if send.__class__ is not _NDARRAY or (out is not None and out.__class__ is not _NDARRAY):
            return self._all_gather_rows_staged(send, out)
        dtype, shape = send.dtype, send.shape
        rows, trailing = shape[0], shape[1:]
        key = (dtype, _ROWS_NOT_GIVEN, False, trailing)
        guard = self._guard
        group, seq = guard.group, next(guard.seqs)
        rec = guard.rec
        slot = rec.begin(group, seq, "all_gather", key)
        try:
            carrier = guard.carriers.get(("all_gather", key, rows), UNPLANNED)
            if carrier is UNPLANNED:
                carrier = guard.row_carrier(key, dtype, rows, _row_size(trailing))
            if carrier is None:
                return self._all_gather_rows_now(send, out, key)
            if carrier.fits:
                carrier.mine[...] = send if not trailing else send.reshape(-1)
            theirs = guard.carry_rows(carrier, key)
            total = rows + theirs
            if out is None:
                out = np.empty((total,) + trailing, dtype)
            else:
                got = out.shape
                if got[0] != total or got[1:] != trailing or (out.dtype is not dtype
                                                              and out.dtype != dtype):
                    raise _bad_rows_out(out, send, (total,) + trailing)
            if not carrier.fits or carrier.theirs is None:  # some rows did not ride
                self._rows_exchange(send, out, carrier, theirs)
            elif self.rank == 0:
                out[:rows] = send
                out[rows:] = carrier.theirs
            else:
                out[:theirs] = carrier.theirs
                out[theirs:] = send
            return out
        finally:
            rec.end_blocking(slot, group, seq)

    def _rows_exchange(self, send: Any, out: Any, carrier: RowCarrier, theirs: int) -> None:
        """The rows of a two-rank unsized all-gather that did not ride with its check,
        point to point (:meth:`CallGuard.pair_exchange`); the rows that did, copied."""
        s, r, mtype = self._gather_buffers(send, out)
        rows = carrier.rows
        cut = (rows if self.rank == 0 else theirs) * carrier.row_size
        flat = r.reshape(-1)
        their_part = flat[cut:] if self.rank == 0 else flat[:cut]
        if carrier.theirs is not None:
            (out[rows:] if self.rank == 0 else out[:theirs])[...] = carrier.theirs
        self._guard.pair_exchange(None if carrier.fits else [s, mtype],
                                  None if carrier.theirs is not None else [their_part, mtype],
                                  "all_gather")
        (out[:rows] if self.rank == 0 else out[theirs:])[...] = send

    def _all_gather_rows_now(self, send: Any, out: Any | None, key: tuple[Any, ...]) -> Any:
        """:meth:`all_gather_rows_blocking` without a swap that carries it: the check (or,
        under debug, the exchange of signatures), then every rank's row count and
        fingerprint, then the rows."""
        n, trailing = self.world_size, key[3]
        if self._guard.checks:
            self._guard.agree("all_gather", key)
        elif self._debug:
            self._agree("all_gather", (("dtype", send.dtype), ("counts", _ROWS_NOT_GIVEN),
                                       ("trailing shape", trailing)))
        header = np.array((send.shape[0],) + row_fingerprint(send.dtype, trailing), np.int64)
        table = np.empty(4 * n, np.int64)
        try:
            self._comm.Allgather([header, MPI.INT64_T], [table, MPI.INT64_T])
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_gather")
        values = table.tolist()  # small: Python lists beat NumPy calls here
        if any(values[k:k + 3] != values[1:4] for k in range(5, 4 * n, 4)):
            raise self._rows_mismatch(send, trailing)
        rows = values[0::4]
        total = sum(rows)
        if out is None:
            out = np.empty((total,) + trailing, send.dtype)
        elif out.shape[0] != total or out.shape[1:] != trailing or out.dtype != send.dtype:
            raise _bad_rows_out(out, send, (total,) + trailing)
        if n > 1:
            size = _row_size(trailing)
            self._all_gather_now(send, out, [r * size for r in rows])
        else:
            out[...] = send
        return out

    def _rows_mismatch(self, send: Any, trailing: tuple[int, ...]) -> Exception:
        """The error every rank raises when the fingerprints of an unsized all-gather
        differ (every rank saw them all): the ranks' dtypes and trailing shapes, named."""
        metas = self._comm.allgather((str(send.dtype), list(trailing)))
        return rows_mismatch("all_gather", metas) or CollectiveMismatchError(
            # equal texts, different fingerprints: a bug
            f"all_gather: the ranks' row headers differ although their calls match ({metas}); "
            "report this as a bug")

    def _all_gather_rows_staged(self, send: Any, out: Any | None) -> Any:
        """:meth:`all_gather_rows_blocking` of arrays other than NumPy: through host
        copies (every rank takes the same path, whatever its arrays)."""
        got = self.all_gather_rows_blocking(_array.to_host(send), None)
        if out is None:
            return _array.namespace(send).asarray(got)
        if tuple(out.shape) != got.shape or out.dtype != got.dtype:
            raise _bad_rows_out(out, send, got.shape)
        copy_back(out, got)
        return out
