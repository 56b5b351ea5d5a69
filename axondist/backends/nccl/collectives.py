"""The NCCL backend's collectives: all-reduce, broadcast, all-gather, reduce-scatter,
gather, scatter and barrier, each recorded, checked and launched through
:class:`~axondist.backends.nccl.core.NcclBackendBase`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...errors import (
    InvalidBufferError,
)
from ...ops import ReduceOp
from ..base import (
    Signature,
    Work,
)
from .basics import (
    NCCL_BYTE,
    NCCL_DTYPES,
    NCCL_OPS,
)
from .core import NcclBackendBase
from .runtime import (
    NcclWork,
    require_no_group,
)


class CollectivesMixin(NcclBackendBase):
    """The collectives of :class:`~axondist.backends.nccl.NcclBackend`."""

    def all_reduce(self, buf: Any, op: ReduceOp, *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """``ncclAllReduce`` in place on this backend's stream.

        Ordered after the caller's current stream. AVERAGE is a SUM followed by a
        division on the stream; dtypes NCCL lacks are refused (see ``reduce_plan``).
        Inside :func:`group_calls` the call only joins the group.
        """
        self._check(buf, "all_reduce", writable=True)
        plan = self._plan(buf, op, "all_reduce")
        count = buf.size * plan.count_factor

        def issue() -> None:
            if count:
                p = buf.data.ptr
                self._comm.allReduce(p, p, count, plan.nccl_dtype, plan.nccl_op, self._stream.ptr)

        return self._collective("all_reduce", (buf.dtype, buf.shape, op.name, async_op),
                                signature, issue, result=buf, keep=(buf,), async_op=async_op,
                                post=self._divide_post(buf, plan))

    def broadcast(self, buf: Any, root: int, *, signature: Signature = (),
                  async_op: bool = False) -> Work:
        """``ncclBroadcast`` of ``root``'s ``buf`` (as bytes) into every rank's ``buf``."""
        self._check(buf, "broadcast", writable=True)
        self._check_root(root, "broadcast", "root")
        return self._broadcast(buf, root, async_op, (buf.dtype, buf.shape, int(root), async_op),
                               signature)

    def _broadcast(self, buf: Any, root: int, async_op: bool, key: tuple[Any, ...] | None = None,
                   signature: Signature = ()) -> NcclWork:
        """``ncclBroadcast`` of ``buf``'s bytes; recorded and checked when ``key`` is given."""
        def issue() -> None:
            if buf.nbytes:
                p = buf.data.ptr
                self._comm.broadcast(p, p, buf.nbytes, NCCL_BYTE, root, self._stream.ptr)

        if key is None:
            return self._launch("broadcast", issue, result=buf, keep=(buf,), async_op=async_op)
        return self._collective("broadcast", key, signature, issue, result=buf, keep=(buf,),
                                async_op=async_op)

    def _check_counts(self, what: str, counts: Sequence[int], local: Any, total: Any,
                      local_name: str, total_name: str) -> list[int]:
        counts = [int(c) for c in counts]
        if len(counts) != self.world_size or any(c < 0 for c in counts):
            raise ValueError(f"{what}: counts={counts} must list {self.world_size} sizes >= 0")
        if local is not None and local.size != counts[self.rank]:
            raise InvalidBufferError(f"{what}: {local_name} has {local.size} elements, counts say "
                                     f"{counts[self.rank]} for rank {self.rank}")
        if total is not None and total.size != sum(counts):
            raise InvalidBufferError(f"{what}: {total_name} has {total.size} elements, counts add "
                                     f"up to {sum(counts)}")
        if local is not None and total is not None and local.dtype != total.dtype:
            raise InvalidBufferError(f"{what}: {local_name} is {local.dtype} but {total_name} is "
                                     f"{total.dtype}")
        return counts

    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   signature: Signature = (), async_op: bool = False) -> Work:
        """``ncclAllGather`` of ``send`` into ``recv`` (rank order).

        Uneven ``counts`` become one broadcast per rank inside an NCCL group.
        """
        self._check(send, "all_gather")
        self._check(recv, "all_gather", writable=True)
        counts = self._check_counts("all_gather", counts, send, recv, "send", "recv")
        return self._all_gather(send, recv, counts, async_op,
                                (send.dtype, tuple(counts), async_op), signature)

    def _all_gather(self, send: Any, recv: Any, counts: list[int], async_op: bool,
                    key: tuple[Any, ...] | None = None, signature: Signature = ()) -> NcclWork:
        """The all-gather; recorded and checked when ``key`` is given."""
        size = recv.itemsize
        stream = self._stream.ptr

        def issue() -> None:
            if len(set(counts)) == 1:
                if counts[0]:
                    self._comm.allGather(send.data.ptr, recv.data.ptr, counts[0] * size,
                                         NCCL_BYTE, stream)
                return
            self._nccl.groupStart()  # one broadcast per rank: all-gather with uneven counts
            try:
                offset = 0
                for k, c in enumerate(counts):
                    dst = recv.data.ptr + offset * size
                    if c:
                        src = send.data.ptr if k == self.rank else dst
                        self._comm.broadcast(src, dst, c * size, NCCL_BYTE, k, stream)
                    offset += c
            finally:
                self._nccl.groupEnd()

        if key is None:
            return self._launch("all_gather", issue, result=recv, keep=(send, recv),
                                async_op=async_op)
        return self._collective("all_gather", key, signature, issue, result=recv,
                                keep=(send, recv), async_op=async_op)

    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       signature: Signature = (), async_op: bool = False) -> Work:
        """``ncclReduceScatter``: this rank's block of the reduced ``send`` lands in ``recv``.

        Uneven ``counts`` become one ``ncclReduce`` per rank inside an NCCL group.
        """
        self._check(send, "reduce_scatter")
        self._check(recv, "reduce_scatter", writable=True)
        counts = self._check_counts("reduce_scatter", counts, recv, send, "recv", "send")
        plan = self._plan(send, op, "reduce_scatter")
        f, size, stream = plan.count_factor, send.itemsize, self._stream.ptr

        def issue() -> None:
            if len(set(counts)) == 1:
                if counts[0]:
                    self._comm.reduceScatter(send.data.ptr, recv.data.ptr, counts[0] * f,
                                             plan.nccl_dtype, plan.nccl_op, stream)
                return
            self._nccl.groupStart()  # one reduce per rank: reduce-scatter with uneven counts
            try:
                offset = 0
                for k, c in enumerate(counts):
                    src = send.data.ptr + offset * size
                    if c:
                        dst = recv.data.ptr if k == self.rank else src  # unused off the root
                        self._comm.reduce(src, dst, c * f, plan.nccl_dtype, plan.nccl_op, k,
                                          stream)
                    offset += c
            finally:
                self._nccl.groupEnd()

        return self._collective("reduce_scatter", (send.dtype, tuple(counts), op.name, async_op),
                                signature, issue, result=recv, keep=(send, recv),
                                async_op=async_op, post=self._divide_post(recv, plan))

    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               signature: Signature = (), async_op: bool = False) -> Work:
        """Sends to ``root`` and receives there, in one NCCL group; None off the root."""
        self._check_root(root, "gather", "root")
        self._check(send, "gather")
        is_root = self.rank == root
        if is_root:
            self._check(recv, "gather", writable=True)
        counts = self._check_counts("gather", counts, send, recv if is_root else None,
                                    "send", "recv")
        issue = self._rooted_issue(send, recv, counts, root, to_root=True)
        return self._collective("gather", (send.dtype, tuple(counts), int(root), async_op),
                                signature, issue, result=recv if is_root else None,
                                keep=(send, recv), async_op=async_op)

    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                signature: Signature = (), async_op: bool = False) -> Work:
        """Sends from ``root`` to every rank's ``recv``, in one NCCL group."""
        self._check_root(root, "scatter", "root")
        self._check(recv, "scatter", writable=True)
        is_root = self.rank == root
        if is_root:
            self._check(send, "scatter")
        counts = self._check_counts("scatter", counts, recv, send if is_root else None,
                                    "recv", "send")
        issue = self._rooted_issue(recv, send, counts, root, to_root=False)
        return self._collective("scatter", (recv.dtype, tuple(counts), int(root), async_op),
                                signature, issue, result=recv, keep=(send, recv),
                                async_op=async_op)

    def _rooted_issue(self, mine: Any, whole: Any, counts: list[int], root: int, *,
                      to_root: bool) -> Callable[[], None]:
        """The ``issue`` of a gather (``to_root``: each rank's ``mine`` lands in the root's
        ``whole`` at its offset) or a scatter (the root's ``whole`` is cut into the ranks'
        ``mine``): NCCL sends and receives in one group, then the root copies its own
        part on the stream."""
        size, stream, is_root = mine.itemsize, self._stream.ptr, self.rank == root

        def issue() -> None:
            self._nccl.groupStart()
            try:
                if not is_root:
                    if counts[self.rank]:
                        move = self._comm.send if to_root else self._comm.recv
                        move(mine.data.ptr, mine.nbytes, NCCL_BYTE, root, stream)
                    return
                move = self._comm.recv if to_root else self._comm.send
                offset = 0
                for k, c in enumerate(counts):
                    if c and k != root:
                        move(whole.data.ptr + offset * size, c * size, NCCL_BYTE, k, stream)
                    offset += c
            finally:
                self._nccl.groupEnd()
            if is_root and counts[root]:
                lo = sum(counts[:root])
                part = whole.reshape(-1)[lo:lo + counts[root]]
                with self._stream:
                    if to_root:
                        part[...] = mine.reshape(-1)
                    else:
                        mine.reshape(-1)[...] = part

        return issue

    def barrier(self) -> None:
        """An all-reduce of one number, waited for on the host."""
        require_no_group("barrier")
        buf = self._barrier_buf
        self._collective("barrier", (), (), lambda: self._comm.allReduce(
            buf.data.ptr, buf.data.ptr, 1, NCCL_DTYPES["int32"], NCCL_OPS["sum"],
            self._stream.ptr), result=None, keep=(), async_op=False)

    def metadata_buffer(self, values: Any) -> Any:
        """A copy of the host array ``values`` on this backend's GPU (NCCL reads device
        memory only), made on the caller's stream, which the collectives follow."""
        with self._cupy.cuda.Device(self.device):
            return self._cupy.asarray(values)


__all__ = ["CollectivesMixin"]
