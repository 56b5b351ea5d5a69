"""The NCCL backend's prepared calls: all-reduces and broadcasts (in place), and
all-gathers and reduce-scatters of equal blocks, of CuPy arrays, with everything that
does not change between calls of one key resolved once (the NCCL dtype, operation and
element count, the record key and the cross-rank check's device buffer). A call then
checks its arrays' GPU, numbers, records and checks the call and enqueues it
(:meth:`NcclBackendBase._collective`).
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any, cast

from ... import _array
from ...ops import ReduceOp
from ..plan import CallKey, Plan, checked_out, element_counts, output_shape
from .basics import NCCL_BYTE, reduce_plan

if TYPE_CHECKING:
    from .core import NcclBackendBase


class InPlacePlan(Plan):
    """An all-reduce or broadcast of CuPy arrays of :attr:`key`'s dtype and shape on one
    backend: ``run(x)`` returns ``x`` once done, or with ``key.async_op`` the call's
    :class:`~axondist.backends.nccl.NcclWork` (whose ``wait()`` returns ``x``)."""

    __slots__ = ("_backend", "_op", "_record", "_signature", "_args", "_pair")

    def __init__(self, backend: NcclBackendBase, key: CallKey) -> None:
        super().__init__(key)
        self._backend = backend
        self._op = key.collective
        if key.collective == "all_reduce":
            op = cast(ReduceOp, key.op)
            how = reduce_plan(key.dtype, op, backend._version, "all_reduce")
            count = prod(key.shape) * how.count_factor
            #: what follows the pointers in ncclAllReduce(send, recv, ...)
            self._args: tuple[int, ...] = (count, how.nccl_dtype, how.nccl_op)
            self._record: tuple[Any, ...] = (key.dtype, key.shape, op.name, key.async_op)
        else:
            root = int(key.root or 0)
            self._args = (prod(key.shape) * key.dtype.itemsize, NCCL_BYTE, root)
            self._record = (key.dtype, key.shape, root, key.async_op)
        self._signature = key.signature() if backend.needs_signature else ()
        self._pair = backend._prepared_pair(self._op, self._record)

    def run(self, send: Any, recv: Any = None) -> Any:
        b = self._backend
        memory = send.data
        if memory.device_id != b.device:
            b._check(send, self._op, writable=True)  # raises, naming both GPUs
        ptr, stream, comm = memory.ptr, b._stream.ptr, b._comm
        args = self._args
        if self._op == "all_reduce":
            def issue() -> None:
                if args[0]:
                    comm.allReduce(ptr, ptr, args[0], args[1], args[2], stream)
        else:
            def issue() -> None:
                if args[0]:
                    comm.broadcast(ptr, ptr, args[0], args[1], args[2], stream)
        work = b._collective(self._op, self._record, self._signature, issue, result=send,
                             keep=(send,), async_op=self.key.async_op, pair=self._pair)
        # blocking: complete already, but inside grouped() it says to pass async_op=True
        return work if self.key.async_op else work.wait()


class BlocksPlan(Plan):
    """An all-gather or reduce-scatter of CuPy arrays whose ranks' blocks are equal:
    ``run(send, recv=None)`` returns ``recv`` (allocated when None) once done, or with
    ``key.async_op`` the call's :class:`~axondist.backends.nccl.NcclWork`."""

    __slots__ = ("_backend", "_op", "_record", "_signature", "_args", "_pair", "_out_shape",
                 "_xp")

    def __init__(self, backend: NcclBackendBase, key: CallKey, counts: list[int]) -> None:
        super().__init__(key)
        self._backend = backend
        self._op = key.collective
        if key.collective == "all_gather":
            self._args: tuple[int, ...] = (counts[0] * key.dtype.itemsize, NCCL_BYTE)
            self._record: tuple[Any, ...] = (key.dtype, tuple(counts), key.async_op)
        else:
            op = cast(ReduceOp, key.op)
            how = reduce_plan(key.dtype, op, backend._version, "reduce_scatter")
            self._args = (counts[0] * how.count_factor, how.nccl_dtype, how.nccl_op)
            self._record = (key.dtype, tuple(counts), op.name, key.async_op)
        self._signature = key.signature() if backend.needs_signature else ()
        self._pair = backend._prepared_pair(self._op, self._record)
        self._out_shape = output_shape(key, backend.rank, backend.world_size)
        self._xp = _array.module_named(key.library)

    def run(self, send: Any, recv: Any = None) -> Any:
        b, key = self._backend, self.key
        if recv is None:
            recv = self._xp.empty(self._out_shape, dtype=key.dtype)  # on the current GPU
        else:
            checked_out(recv, key, self._out_shape, self._op)
        src, dst = send.data, recv.data
        if src.device_id != b.device or dst.device_id != b.device:
            b._check(send, self._op)  # raises, naming both GPUs
            b._check(recv, self._op, writable=True)
        send_ptr, recv_ptr, stream, comm = src.ptr, dst.ptr, b._stream.ptr, b._comm
        args = self._args
        if self._op == "all_gather":
            def issue() -> None:
                if args[0]:
                    comm.allGather(send_ptr, recv_ptr, args[0], args[1], stream)
        else:
            def issue() -> None:
                if args[0]:
                    comm.reduceScatter(send_ptr, recv_ptr, args[0], args[1], args[2], stream)
        work = b._collective(self._op, self._record, self._signature, issue, result=recv,
                             keep=(send, recv), async_op=key.async_op, pair=self._pair)
        return work if key.async_op else work.wait()


def prepared(backend: NcclBackendBase, key: CallKey) -> Plan | None:
    """The prepared call of ``key`` when this module has one, else None (the backend's
    general methods serve it): all-reduces, broadcasts, and all-gathers and
    reduce-scatters of equal blocks, of C-contiguous CuPy arrays, except AVERAGEs that
    NCCL cannot do in one call (old NCCL) or that the generic plan widens (float16,
    bfloat16)."""
    blocks = key.collective in ("all_gather", "reduce_scatter")
    if key.library != "cupy" or key.layout != "ok" or \
            not (blocks or key.collective in ("all_reduce", "broadcast")):
        return None
    if key.collective == "all_gather" and key.counts is None:
        return None  # the generic plan exchanges the row counts, then asks again
    if key.op is ReduceOp.AVERAGE:
        if key.dtype.itemsize == 2 and key.dtype.kind != "i":
            return None
        if reduce_plan(key.dtype, ReduceOp.AVERAGE, backend._version,
                       key.collective).divide_by_size:
            return None
    if not blocks:
        return InPlacePlan(backend, key)
    counts = element_counts(key, backend.world_size)
    return BlocksPlan(backend, key, counts) if len(set(counts)) == 1 else None


__all__ = ["BlocksPlan", "InPlacePlan", "prepared"]
