"""The NCCL backend's prepared calls on CuPy arrays: all-reduces and broadcasts (in place),
reduces (an all-reduce of a copy, kept on the root), all-gathers and reduce-scatters,
gathers, scatters and all-to-alls (NCCL sends and receives in one group), with everything
that does not change between calls of one key resolved once (the NCCL dtype, operation
and byte or element counts, the record key and the cross-rank check's device buffer). A
call then checks its arrays' GPU, and the communicator numbers, records, checks and
enqueues it (:meth:`~.communicator.Communicator.collective`).

A plan uses the communicator's public surface only: ``device``, ``rank``, ``world_size``,
``version``, ``stream``, ``nccl``, ``nccl_comm``, ``state.debug``, ``check_buffer``,
``require_on_device``, ``mean_post`` and ``collective``.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import TYPE_CHECKING, Any, cast

from ... import _array
from ...ops import ReduceOp
from ..checks import Key
from ..plan import CallKey, Plan, checked_out, element_counts, output_shape
from ..work import ThenWork
from .basics import NCCL_BYTE, ReducePlan, host_array_error, not_contiguous_error, reduce_plan

if TYPE_CHECKING:
    from .communicator import Communicator
    from .runtime import NcclWork


class NcclPlan(Plan):
    """What every NCCL plan keeps: its communicator, the call's record key (what the
    flight recorder shows and the check hashes), the fields the debug check compares by name,
    and the check's device buffer."""

    __slots__ = ("_comm", "_op", "_record", "_fields", "_pair")

    def __init__(self, comm: Communicator, key: CallKey, record: tuple[Any, ...],
                 fields: Key | None = None) -> None:
        super().__init__(key)
        self._comm = comm
        self._op = key.collective
        self._record = record
        self._fields = ((key.signature() if fields is None else fields)
                        if comm.state.debug else ())
        self._pair = comm.check_buffer(self._op, record)

    def start(self, send: Any, recv: Any = None) -> NcclWork:
        """Issue the call; its Work (a blocking call's completed, except inside
        ``NcclBackend.grouped()``, whose end completes it)."""
        raise NotImplementedError

    def run(self, send: Any, recv: Any = None) -> Any:
        work = self.start(send, recv)
        # blocking: complete already, but inside grouped() wait() says to pass async_op=True
        return work if self.key.async_op else work.wait()


class InPlacePlan(NcclPlan):
    """An all-reduce or broadcast of CuPy arrays of :attr:`key`'s dtype and shape:
    ``run(x)`` returns ``x`` once done, or with ``key.async_op`` the call's
    :class:`~axondist.backends.nccl.NcclWork` (whose ``wait()`` returns ``x``). An
    AVERAGE on an NCCL without ``ncclAvg`` is a SUM, then a division on the stream."""

    __slots__ = ("_args", "_how")

    def __init__(self, comm: Communicator, key: CallKey,
                 fields: Key | None = None) -> None:
        self._how: ReducePlan | None = None
        if key.collective == "all_reduce":
            op = cast(ReduceOp, key.op)
            how = self._how = reduce_plan(key.dtype, op, comm.version, "all_reduce")
            #: what follows the pointers in ncclAllReduce(send, recv, ...)
            self._args: tuple[int, ...] = (prod(key.shape) * how.count_factor, how.nccl_dtype,
                                           how.nccl_op)
            record: tuple[Any, ...] = (key.dtype, key.shape, op.name, key.async_op)
        else:
            root = int(key.root or 0)
            self._args = (prod(key.shape) * key.dtype.itemsize, NCCL_BYTE, root)
            record = (key.dtype, key.shape, root, key.async_op)
        super().__init__(comm, key, record, fields)

    def start(self, send: Any, recv: Any = None) -> NcclWork:
        c = self._comm
        memory = send.data
        if memory.device_id != c.device:
            c.require_on_device(send, self._op, writable=True)  # raises, naming both GPUs
        ptr, stream, comm = memory.ptr, c.stream.ptr, c.nccl_comm
        count, *rest = self._args
        if self._op == "all_reduce":
            def issue() -> None:
                if count:
                    comm.allReduce(ptr, ptr, count, rest[0], rest[1], stream)
        else:
            def issue() -> None:
                if count:
                    comm.broadcast(ptr, ptr, count, rest[0], rest[1], stream)
        post = None if self._how is None else c.mean_post(send, self._how)
        work = c.collective(self._op, self._record, self._fields, issue, result=send,
                            keep=(send,), async_op=self.key.async_op, post=post,
                            pair=self._pair)
        return work


class RootReducePlan(Plan):
    """A reduce: the all-reduce of a copy (recorded and checked as that all-reduce), the
    result kept on the root."""

    __slots__ = ("_all_reduce", "_root", "_xp")

    def __init__(self, comm: Communicator, key: CallKey) -> None:
        super().__init__(key)
        whole = key._replace(collective="all_reduce", root=None)
        self._all_reduce = InPlacePlan(comm, whole, key.signature() + (("root", key.root),))
        self._root = comm.rank == key.root
        self._xp = _array.module_named(key.library)

    def run(self, send: Any, recv: Any = None) -> Any:
        copy = self._xp.array(send, copy=True)
        result = self._all_reduce.run(copy)

        def keep(_: Any = None) -> Any:
            if self._root:
                send[...] = copy
            return send

        return ThenWork(result, keep) if self.key.async_op else keep()


class BlocksPlan(NcclPlan):
    """An all-gather or reduce-scatter of CuPy arrays: ``run(send, recv=None)`` returns
    ``recv`` (allocated when None) once done, or with ``key.async_op`` the call's
    :class:`~axondist.backends.nccl.NcclWork`. Equal blocks are one ``ncclAllGather`` or
    ``ncclReduceScatter``; uneven ones one ``ncclBroadcast`` or ``ncclReduce`` per rank
    inside an NCCL group."""

    __slots__ = ("_counts", "_how", "_out_shape", "_xp")

    def __init__(self, comm: Communicator, key: CallKey) -> None:
        counts = self._counts = element_counts(key, comm.world_size)
        self._how: ReducePlan | None = None
        if key.collective == "all_gather":
            record: tuple[Any, ...] = (key.dtype, tuple(counts), key.async_op)
        else:
            op = cast(ReduceOp, key.op)
            self._how = reduce_plan(key.dtype, op, comm.version, "reduce_scatter")
            record = (key.dtype, tuple(counts), op.name, key.async_op)
        super().__init__(comm, key, record)
        self._out_shape = output_shape(key, comm.rank, comm.world_size)
        self._xp = _array.module_named(key.library)

    def start(self, send: Any, recv: Any = None) -> NcclWork:
        c, key = self._comm, self.key
        if recv is None:
            recv = self._xp.empty(self._out_shape, dtype=key.dtype)  # on the current GPU
        else:
            checked_out(recv, key, self._out_shape, self._op)
        if send.data.device_id != c.device or recv.data.device_id != c.device:
            c.require_on_device(send, self._op)  # raises, naming both GPUs
            c.require_on_device(recv, self._op, writable=True)
        if self._how is None:
            issue = self._gather(send.data.ptr, recv.data.ptr)
            post = None
        else:
            issue = self._scatter(send.data.ptr, recv.data.ptr, self._how)
            post = c.mean_post(recv, self._how)
        work = c.collective(self._op, self._record, self._fields, issue, result=recv,
                            keep=(send, recv), async_op=key.async_op, post=post,
                            pair=self._pair)
        return work

    def _gather(self, src: int, dst: int) -> Any:
        c, counts, size = self._comm, self._counts, self.key.dtype.itemsize
        comm, nccl, stream, rank = c.nccl_comm, c.nccl, c.stream.ptr, c.rank
        if len(set(counts)) == 1:
            def issue() -> None:
                if counts[0]:
                    comm.allGather(src, dst, counts[0] * size, NCCL_BYTE, stream)
            return issue

        def issue_uneven() -> None:  # one broadcast per rank, in one NCCL group
            nccl.groupStart()
            try:
                offset = 0
                for k, n in enumerate(counts):
                    at = dst + offset * size
                    if n:
                        comm.broadcast(src if k == rank else at, at, n * size, NCCL_BYTE, k,
                                       stream)
                    offset += n
            finally:
                nccl.groupEnd()
        return issue_uneven

    def _scatter(self, src: int, dst: int, how: ReducePlan) -> Any:
        c, counts, size = self._comm, self._counts, self.key.dtype.itemsize
        comm, nccl, stream, rank = c.nccl_comm, c.nccl, c.stream.ptr, c.rank
        f, dtype, op = how.count_factor, how.nccl_dtype, how.nccl_op
        if len(set(counts)) == 1:
            def issue() -> None:
                if counts[0]:
                    comm.reduceScatter(src, dst, counts[0] * f, dtype, op, stream)
            return issue

        def issue_uneven() -> None:  # one reduce per rank, in one NCCL group
            nccl.groupStart()
            try:
                offset = 0
                for k, n in enumerate(counts):
                    block = src + offset * size
                    if n:  # off the root the receive buffer is unused
                        comm.reduce(block, dst if k == rank else block, n * f, dtype, op, k,
                                    stream)
                    offset += n
            finally:
                nccl.groupEnd()
        return issue_uneven


class RootedPlan(NcclPlan):
    """A gather (every rank's block into the root's result, None elsewhere) or a scatter
    (block r of the root's ``send``, None elsewhere, into rank r's result)."""

    __slots__ = ("_counts", "_out_shape", "_xp", "_to_root")

    def __init__(self, comm: Communicator, key: CallKey) -> None:
        counts = self._counts = element_counts(key, comm.world_size)
        super().__init__(comm, key, (key.dtype, tuple(counts), int(key.root or 0),
                                     key.async_op))
        self._to_root = key.collective == "gather"
        self._out_shape = output_shape(key, comm.rank, comm.world_size)
        self._xp = _array.module_named(key.library)

    def start(self, send: Any, recv: Any = None) -> NcclWork:
        c, key = self._comm, self.key
        is_root = c.rank == key.root
        out = None
        if is_root or not self._to_root:
            out = self._xp.empty(self._out_shape, dtype=key.dtype) if recv is None else \
                checked_out(recv, key, self._out_shape, self._op)
        mine, whole = (send, out) if self._to_root else (out, send)
        for buf in (mine, whole):
            if buf is not None and buf.data.device_id != c.device:
                c.require_on_device(buf, self._op)  # raises, naming both GPUs
        issue = _rooted_issue(c, mine, whole, self._counts, int(key.root or 0),
                              to_root=self._to_root)
        work = c.collective(self._op, self._record, self._fields, issue, result=out,
                            keep=(send, out), async_op=key.async_op, pair=self._pair)
        return work


class AllToAllPlan(NcclPlan):
    """Rank s's block for rank d goes straight to d: every rank's sends and receives in one
    NCCL group, its own block copied on the stream."""

    __slots__ = ("_sent", "_came", "_out_shape", "_xp")

    def __init__(self, comm: Communicator, key: CallKey) -> None:
        n, me, row = comm.world_size, comm.rank, prod(key.shape[1:])
        counts = list(key.counts or ())  # this rank's rows to each rank, then from each
        self._sent = [c * row for c in counts[:n]]
        self._came = [c * row for c in counts[n:]]
        # the ranks agree on dtype and trailing shape; their counts are their own
        super().__init__(comm, key, (key.dtype, tuple(key.shape[1:]), key.async_op))
        self._out_shape = output_shape(key, me, n)
        self._xp = _array.module_named(key.library)

    def start(self, send: Any, recv: Any = None) -> NcclWork:
        c, key = self._comm, self.key
        out = self._xp.empty(self._out_shape, dtype=key.dtype) if recv is None else \
            checked_out(recv, key, self._out_shape, self._op)
        if send.data.device_id != c.device or out.data.device_id != c.device:
            c.require_on_device(send, self._op)  # raises, naming both GPUs
            c.require_on_device(out, self._op, writable=True)
        size, me, stream = key.dtype.itemsize, c.rank, c.stream.ptr
        comm, nccl, sent, came = c.nccl_comm, c.nccl, self._sent, self._came
        src, dst = send.data.ptr, out.data.ptr

        def issue() -> None:
            nccl.groupStart()
            try:
                at_send = at_recv = 0
                for peer in range(c.world_size):
                    if peer != me and sent[peer]:
                        comm.send(src + at_send * size, sent[peer] * size, NCCL_BYTE, peer,
                                  stream)
                    if peer != me and came[peer]:
                        comm.recv(dst + at_recv * size, came[peer] * size, NCCL_BYTE, peer,
                                  stream)
                    at_send += sent[peer]
                    at_recv += came[peer]
            finally:
                nccl.groupEnd()
            if sent[me]:
                lo, at = sum(sent[:me]), sum(came[:me])
                with c.stream:
                    out.reshape(-1)[at:at + came[me]] = send.reshape(-1)[lo:lo + sent[me]]

        work = c.collective(self._op, self._record, self._fields, issue, result=out,
                            keep=(send, out), async_op=key.async_op, pair=self._pair)
        return work


def _rooted_issue(c: Communicator, mine: Any, whole: Any, counts: list[int], root: int, *,
                  to_root: bool) -> Callable[[], None]:
    """The ``issue`` of a gather (``to_root``: each rank's ``mine`` lands in the root's
    ``whole`` at its offset) or a scatter (the root's ``whole`` is cut into the ranks'
    ``mine``): NCCL sends and receives in one group, then the root copies its own part on
    the stream."""
    size, stream, is_root, rank = mine.itemsize, c.stream.ptr, c.rank == root, c.rank
    comm, nccl = c.nccl_comm, c.nccl

    def issue() -> None:
        nccl.groupStart()
        try:
            if not is_root:
                if counts[rank]:
                    move = comm.send if to_root else comm.recv
                    move(mine.data.ptr, mine.nbytes, NCCL_BYTE, root, stream)
                return
            move = comm.recv if to_root else comm.send
            offset = 0
            for k, n in enumerate(counts):
                if n and k != root:
                    move(whole.data.ptr + offset * size, n * size, NCCL_BYTE, k, stream)
                offset += n
        finally:
            nccl.groupEnd()
        if is_root and counts[root]:
            lo = sum(counts[:root])
            part = whole.reshape(-1)[lo:lo + counts[root]]
            with c.stream:
                if to_root:
                    part[...] = mine.reshape(-1)
                else:
                    mine.reshape(-1)[...] = part

    return issue


#: The plan class of each collective on CuPy arrays.
PLANS: dict[str, Callable[[Communicator, CallKey], Plan]] = {
    "all_reduce": InPlacePlan,
    "broadcast": InPlacePlan,
    "reduce": RootReducePlan,
    "all_gather": BlocksPlan,
    "reduce_scatter": BlocksPlan,
    "gather": RootedPlan,
    "scatter": RootedPlan,
    "all_to_all": AllToAllPlan,
}


def plan_for(comm: Communicator, key: CallKey) -> Plan | None:
    """The NCCL plan of a validated ``key``, or None where a generic plan serves it and
    comes back for NCCL's (a float16 or bfloat16 mean, widened to float32; an all-gather
    whose row counts are exchanged first).

    Raises:
        NotOnDeviceError: the call's arrays are NumPy arrays.
        InvalidBufferError: its send buffer is not C-contiguous.
    """
    what = key.collective
    if key.library != "cupy":
        raise host_array_error(what, f"{key.dtype}{list(key.shape)} ({key.library})")
    if key.layout != "ok":
        raise not_contiguous_error(what, key.shape, writable=False)
    if key.op is ReduceOp.AVERAGE and key.dtype.itemsize == 2 and key.dtype.kind != "i":
        return None
    if what == "all_gather" and key.counts is None:
        return None
    return PLANS[what](comm, key)


__all__ = ["PLANS", "AllToAllPlan", "BlocksPlan", "InPlacePlan", "NcclPlan", "RootReducePlan",
           "RootedPlan", "plan_for"]
