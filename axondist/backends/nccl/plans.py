"""The NCCL backend's prepared calls: an in-place all-reduce or broadcast of CuPy arrays
with everything that does not change between calls of one key resolved once (the
NCCL dtype, operation and element count, the communicator and stream, the record key
and the cross-rank check's device buffer). A call then checks the array's GPU, numbers,
records and checks the call and enqueues it (:meth:`NcclBackendBase._collective`).
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any, cast

from ...ops import ReduceOp
from ..plan import CallKey, Plan
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


def prepared(backend: NcclBackendBase, key: CallKey) -> Plan | None:
    """The prepared call of ``key`` when this module has one, else None (the backend's
    general methods serve it): in-place all-reduces and broadcasts of CuPy arrays, except
    AVERAGEs that NCCL cannot do in one call (old NCCL) or that the generic plan widens
    (float16, bfloat16)."""
    if key.library != "cupy" or key.collective not in ("all_reduce", "broadcast"):
        return None
    if key.collective == "all_reduce" and key.op is ReduceOp.AVERAGE:
        if key.dtype.itemsize == 2 and key.dtype.kind != "i":
            return None
        if reduce_plan(key.dtype, ReduceOp.AVERAGE, backend._version,
                       "all_reduce").divide_by_size:
            return None
    return InPlacePlan(backend, key)


__all__ = ["InPlacePlan", "prepared"]
