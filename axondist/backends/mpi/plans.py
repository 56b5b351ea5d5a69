"""The MPI backend's prepared calls: one class per collective, each the checked call of the
MPI library's own collective on the caller's buffers.

A plan resolves once what its key decides (the MPI datatype and op, counts and
displacements, the check's hash); :meth:`MPIPlan.run` then numbers the call, records it,
checks it across ranks and moves the data. Blocking calls check first and move after;
non-blocking ones start their check and their data together, and settle the check first
in ``wait()``. :class:`StagedPlan` runs a device array's call on page-locked host copies
where MPI is not CUDA-aware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ... import _array
from ..plan import CallKey, Plan, checked_out, element_counts, output_shape
from ..work import CompletedWork, ThenWork
from .guard import check_words
from .transport import (
    HostStaging,
    MPIWork,
    displacements,
    mean_scaling,
    raise_mpi_error,
    synchronize_device,
    unsupported,
)

if TYPE_CHECKING:
    from .backend import MPIBackend


class MPIPlan(Plan):
    """A checked MPI collective: :meth:`_move` (blocking) or :meth:`_start` (non-blocking)
    is what a subclass adds; the guard's numbering, recording and check are here."""

    __slots__ = ("_b", "_guard", "_mpi", "_comm", "_detail", "_check_key", "_words", "_xp",
                 "_out_shape")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(key)
        self._b = backend
        self._guard = backend.guard
        self._mpi = backend.mpi
        self._comm = backend.comm
        #: The call as the flight recorder shows it, and what every rank must agree on.
        self._detail = key.signature()
        self._check_key = self._detail + (("async_op", key.async_op),)
        self._words = check_words(key.collective, self._check_key)
        self._xp = _array.module_named(key.library)
        self._out_shape = output_shape(key, backend.rank, backend.world_size)

    def _output(self, recv: Any) -> Any:
        if recv is None:
            return self._xp.empty(self._out_shape, dtype=self.key.dtype)
        return checked_out(recv, self.key, self._out_shape, self.key.collective)

    def run(self, send: Any, recv: Any = None) -> Any:
        key, guard = self.key, self._guard
        what = key.collective
        if key.library != "numpy":
            synchronize_device(send, recv)
        if not key.async_op:
            seq, slot = guard.begin(what, self._detail)
            try:
                if guard.checks:
                    guard.agree(what, self._check_key, self._words)
                try:
                    return self._move(send, recv)
                except self._mpi.Exception as exc:
                    raise_mpi_error(self._mpi, exc, what)
            finally:
                guard.rec.end(slot)
        seq, slot = guard.begin(what, self._detail, blocking=False)
        try:
            check = guard.agree_later(what, self._check_key, self._words)
            try:
                requests, finish, result = self._start(send, recv)
            except self._mpi.Exception as exc:
                raise_mpi_error(self._mpi, exc, what)
        finally:
            guard.rec.end(slot)
        return MPIWork(self._mpi, requests, finish, result, what, check,
                       (guard.rec, guard.group, seq))

    def _move(self, send: Any, recv: Any) -> Any:
        """Move the data of a checked blocking call; its result."""
        raise NotImplementedError

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        """Start a non-blocking call: ``(requests, finish or None, result)``."""
        raise NotImplementedError


class _Reduction(MPIPlan):
    """What reductions resolve once: the wire view, datatype and op, and the mean's scaling."""

    __slots__ = ("_view", "_mtype", "_mop", "_average")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        found = backend.types.reduce[key.reduce_op].get(key.dtype)  # type: ignore[index]
        if found is None:
            raise unsupported(key.collective, key.dtype, key.reduce_op)
        self._view, self._mtype, self._mop, average = found
        self._average = mean_scaling(backend.world_size) if average else None

    def _wire(self, buf: Any) -> Any:
        return buf if self._view is None else buf.view(self._view)

    def _finish(self, buf: Any) -> None:
        """Turn the sum in ``buf`` into the mean, in place (after MPI's SUM: its bits)."""
        if self._average is not None:
            how, by = self._average
            getattr(_array.namespace(buf), how)(buf, by, out=buf, casting="unsafe")


class AllReducePlan(_Reduction):
    """``Allreduce`` in place; AVERAGE is MPI's SUM, then a division by the group size."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Any:
        wire = send if self._view is None else send.view(self._view)
        self._comm.Allreduce(self._mpi.IN_PLACE, [wire, self._mtype], self._mop)
        if self._average is not None:
            self._finish(send)
        return send

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        request = self._comm.Iallreduce(self._mpi.IN_PLACE, [self._wire(send), self._mtype],
                                        self._mop)
        finish = None if self._average is None else (lambda: self._finish(send))
        return [request], finish, send


class ReducePlan(_Reduction):
    """``Reduce`` into the root's buffer, in place there; others keep their values."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Any:
        root = self.key.root
        if self._b.rank == root:
            self._comm.Reduce(self._mpi.IN_PLACE, [self._wire(send), self._mtype], self._mop,
                              root)
            self._finish(send)
        else:
            self._comm.Reduce([self._wire(send), self._mtype], None, self._mop, root)
        return send

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        root, mine = self.key.root, self._b.rank == self.key.root
        request = self._comm.Ireduce(self._mpi.IN_PLACE if mine else
                                     [self._wire(send), self._mtype],
                                     [self._wire(send), self._mtype] if mine else None,
                                     self._mop, root)
        finish = (lambda: self._finish(send)) if mine and self._average else None
        return [request], finish, send


class ReduceScatterPlan(_Reduction):
    """``Reduce_scatter_block`` for equal blocks, else ``Reduce_scatter`` by counts."""

    __slots__ = ("_counts",)

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._counts = element_counts(key, backend.world_size)

    def _buffers(self, send: Any, recv: Any) -> tuple[Any, list[Any], list[Any]]:
        out = self._output(recv)
        return out, [self._wire(send), self._mtype], [self._wire(out), self._mtype]

    def _move(self, send: Any, recv: Any) -> Any:
        out, s, r = self._buffers(send, recv)
        if len(set(self._counts)) == 1:
            self._comm.Reduce_scatter_block(s, r, self._mop)
        else:
            self._comm.Reduce_scatter(s, r, self._counts, self._mop)
        self._finish(out)
        return out

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        out, s, r = self._buffers(send, recv)
        if len(set(self._counts)) == 1:
            request = self._comm.Ireduce_scatter_block(s, r, self._mop)
        else:
            request = self._comm.Ireduce_scatter(s, r, self._counts, self._mop)
        finish = None if self._average is None else (lambda: self._finish(out))
        return [request], finish, out


class _Transfer(MPIPlan):
    """What data movements resolve once: the wire view and datatype."""

    __slots__ = ("_view", "_mtype")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._view, self._mtype = backend.types.transfer[key.dtype]

    def _spec(self, buf: Any) -> list[Any]:
        return [buf if self._view is None else buf.view(self._view), self._mtype]


class BroadcastPlan(_Transfer):
    """``Bcast`` of the root's buffer into every rank's."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Any:
        self._comm.Bcast(self._spec(send), self.key.root)
        return send

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        return [self._comm.Ibcast(self._spec(send), self.key.root)], None, send


class AllGatherPlan(_Transfer):
    """``Allgather`` for equal counts, else ``Allgatherv``, into a new or given array."""

    __slots__ = ("_counts", "_displs", "_equal")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._counts = element_counts(key, backend.world_size)
        self._displs = displacements(self._counts)
        self._equal = len(set(self._counts)) == 1

    def _buffers(self, send: Any, recv: Any) -> tuple[Any, list[Any], list[Any]]:
        out = self._output(recv)
        s, r = self._spec(send), self._spec(out)
        return out, s, (r if self._equal else [r[0], self._counts, self._displs, r[1]])

    def _move(self, send: Any, recv: Any) -> Any:
        out, s, r = self._buffers(send, recv)
        (self._comm.Allgather if self._equal else self._comm.Allgatherv)(s, r)
        return out

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        out, s, r = self._buffers(send, recv)
        call = self._comm.Iallgather if self._equal else self._comm.Iallgatherv
        return [call(s, r)], None, out


class UnsizedAllGatherPlan(_Transfer):
    """An all-gather whose row counts no rank knows: the check (of dtype and trailing
    shape), one ``Allgather`` of the ranks' row counts, then the rows' ``Allgatherv``,
    blocking (``async_op`` returns a completed Work)."""

    __slots__ = ("_rows", "_row_size")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._rows = np.empty(backend.world_size, np.int64)
        self._row_size = int(np.prod(key.shape[1:], dtype=np.int64))

    def _move(self, send: Any, recv: Any) -> Any:
        mine = np.array([send.shape[0]], np.int64)
        int64 = self._mpi.INT64_T
        self._comm.Allgather([mine, int64], [self._rows, int64])
        rows = self._rows.tolist()
        shape = (sum(rows),) + tuple(self.key.shape[1:])
        out = (self._xp.empty(shape, dtype=self.key.dtype) if recv is None
               else checked_out(recv, self.key, shape, "all_gather"))
        counts = [r * self._row_size for r in rows]
        s, r = self._spec(send), self._spec(out)
        if len(set(counts)) == 1:  # MPICH's Allgatherv is slower than Allgather for these
            self._comm.Allgather(s, r)
        else:
            self._comm.Allgatherv(s, [r[0], counts, displacements(counts), r[1]])
        return out

    def run(self, send: Any, recv: Any = None) -> Any:
        if self.key.async_op:  # blocking by design: the counts come first
            result = self._b.plan(self.key._replace(async_op=False)).run(send, recv)
            return CompletedWork(result)
        return super().run(send, recv)

    def _start(self, send: Any, recv: Any) -> tuple[list[Any], Any, Any]:
        raise AssertionError("run() makes unsized all-gathers blocking")


class StagedPlan(Plan):
    """A device array's call run on page-locked host copies (MPI is not CUDA-aware, or
    ``host_staging="always"``): the input copied to the host, the host plan of the same
    call, the result copied back (in ``wait()`` when non-blocking). A blocking call's host
    buffers are the plan's, reused call after call; a non-blocking call takes its own."""

    __slots__ = ("_host", "_inputs", "_results", "_out_shape", "_xp")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(key)
        self._host = backend.host_plan(key._replace(library="numpy"))
        # apart: an input and a result of one shape must not share a buffer (MPI refuses)
        self._inputs, self._results = HostStaging(), HostStaging()
        self._out_shape = output_shape(key, backend.rank, backend.world_size)
        self._xp = _array.module_named(key.library)

    def run(self, send: Any, recv: Any = None) -> Any:
        key = self.key
        in_place = key.collective in ("all_reduce", "broadcast", "reduce")
        if in_place:
            out = send
        elif recv is not None or key.counts is not None or key.collective != "all_gather":
            shape = self._out_shape
            out = (self._xp.empty(shape, dtype=key.dtype) if recv is None
                   else checked_out(recv, key, shape, key.collective))
        else:
            out = recv  # an unsized all-gather: its shape comes with the counts
        # A blocking call is done with the plan's buffers when it returns; calls in flight
        # at once need their own (the memory pool hands the same blocks back).
        inputs, results = ((self._inputs, self._results) if not key.async_op
                           else (HostStaging(), HostStaging()))
        host_send = inputs.to_host(send)
        host_recv = None if in_place or out is None else results.buffer(out)
        result = self._host.run(host_send, host_recv)

        def back(value: Any) -> Any:
            target = out
            if target is None:  # the unsized all-gather's new array
                target = self._xp.empty(value.shape, dtype=key.dtype)
            _array.copy_from_host(target, value)
            return target

        return ThenWork(result, back) if key.async_op else back(result)

    def free(self) -> None:
        self._inputs.free()
        self._results.free()


__all__ = ["AllGatherPlan", "AllReducePlan", "BroadcastPlan", "MPIPlan", "ReducePlan",
           "ReduceScatterPlan", "StagedPlan", "UnsizedAllGatherPlan"]
