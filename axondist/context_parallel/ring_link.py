"""A ring's point-to-point link: send to the next rank, receive from the previous one, in
the background while the caller computes.

The backends' ``send``/``recv`` block, so each transfer's send and receive run on
worker threads (NumPy's matmuls and the transports release the GIL, so the block's
compute and the transfer overlap). Every rank posts its receive as it posts its send,
so a ring of blocking sends cannot wait on itself. A backend whose sends and receives
share one queue (``Backend.serial_p2p``: NCCL's stream, where the GPU overlaps them)
pairs the two in one grouped call instead (or, without grouped calls, orders them so that
rank 0 sends first).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from ..backends.base import Backend

#: Tags of the ring's two streams of messages: key/value blocks, and the dK/dV accumulators.
KV_TAG = 7168
GRAD_TAG = 7169


class Transfer:
    """One posted send and receive; :meth:`wait` returns once both are done."""

    def __init__(self, futures: list[concurrent.futures.Future[Any]]) -> None:
        self._futures = futures

    def wait(self) -> None:
        """Block until the block was sent and the next one received; raise their error."""
        for future in self._futures:
            future.result()


class RingLink:
    """Transfers around the ring of ``backend``'s ranks (use as a context manager).

    Args:
        backend: the group's backend.
        streams: how many transfers may be in flight at once.
    """

    def __init__(self, backend: Backend, streams: int = 1) -> None:
        self.backend = backend
        n, r = backend.world_size, backend.rank
        self.next, self.prev = (r + 1) % n, (r - 1) % n
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if n > 1 and not backend.serial_p2p:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=2 * streams, thread_name_prefix=f"axondist-ring-r{r}")

    def start(self, send: Any, recv: Any, tag: int) -> Transfer:
        """Send ``send`` to the next rank and receive the previous rank's into ``recv``
        (contiguous, of the sizes the two agree on); returns at once where it can."""
        b = self.backend
        if self._pool is None:  # one queue per rank (or one rank): in order, here
            grouped = getattr(b, "grouped", None)  # NCCL pairs the two in one launch
            if grouped is not None:
                with grouped():
                    b.send(send, self.next, tag)
                    b.recv(recv, self.prev, tag)
            elif b.rank == 0:  # no grouping: rank 0 sends first, the others receive first,
                b.send(send, self.next, tag)  # so the ring of waits always has an end
                b.recv(recv, self.prev, tag)
            else:
                b.recv(recv, self.prev, tag)
                b.send(send, self.next, tag)
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result(None)
            return Transfer([done])
        return Transfer([self._pool.submit(b.send, send, self.next, tag),
                         self._pool.submit(b.recv, recv, self.prev, tag)])

    def __enter__(self) -> RingLink:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if self._pool is not None:
            # After a failure a receive may wait for a peer that never sends: do not wait
            # for it (the backend's timeout or abort ends it).
            self._pool.shutdown(wait=kind is None, cancel_futures=kind is not None)


__all__ = ["GRAD_TAG", "KV_TAG", "RingLink", "Transfer"]
