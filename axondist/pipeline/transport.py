"""How pipeline messages travel: in-memory queues (one process) or send/recv on a group.

Both transports serve :class:`~axondist.pipeline.executor.RankRunner`:
``ready(op)`` says whether a recv can complete now (the single-process
driver uses it to switch ranks; a real recv just blocks), ``send``/``recv``
move one message of the communication plan, ``finish`` ends a step and
``abandon`` ends a failed one.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Sequence
from typing import Any

from axondist import comm
from axondist.pipeline.communication import CommOp
from axondist.process_group import ProcessGroup

__all__ = ["GroupTransport", "InProcessTransport", "Transport"]

# Tags on the wire: CommOp.tag modulo this.  Any tag function is correct
# (every channel's sends and recvs pair up in order, and both MPI and the
# mock world deliver one (source, tag) stream in order); this bound fits the
# smallest tag range MPI allows (32767), halved by the MPI backend.
_TAG_SPACE = 1 << 14


class InProcessTransport:
    """Single-process mode: one FIFO per (src, dst) rank pair; arrays pass by reference."""

    def __init__(self) -> None:
        self._queues: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque)

    def ready(self, op: CommOp) -> bool:
        """True when a message from ``op``'s peer to ``op``'s rank is queued."""
        return bool(self._queues[(op.peer, op.rank)])

    def send(self, op: CommOp, x: Any) -> None:
        """Queue ``x`` itself (no copy) for ``op``'s peer; never blocks."""
        self._queues[(op.rank, op.peer)].append((op.tag, x))

    def recv(self, op: CommOp) -> Any:
        """The oldest queued message from ``op``'s peer (call after :meth:`ready`).

        Raises:
            RuntimeError: its tag is not ``op.tag`` (a bug in the communication plan).
        """
        tag, x = self._queues[(op.peer, op.rank)].popleft()
        if tag != op.tag:
            raise RuntimeError(f"Pipeline: rank {op.rank} expected the {op.describe_message()} "
                               f"(tag {op.tag}) but the next message has tag {tag} (a bug in "
                               "the communication plan: please report)")
        return x

    def finish(self) -> None:
        """Check that every message sent in the step was received.

        Raises:
            RuntimeError: some were not (a bug in the communication plan).
        """
        left = {k: len(q) for k, q in self._queues.items() if q}
        if left:
            raise RuntimeError(f"Pipeline: messages never received: {left} (a bug: please report)")

    def abandon(self) -> None:
        """The step failed: drop every queued message."""
        self._queues.clear()


class GroupTransport:
    """Distributed mode: blocking recv; sends, in order, on a helper thread (buffered).

    Schedules need sends that return before the peer receives: in 1F1B two
    neighbours send to each other at the same moment (an activation one way,
    a gradient the other), and an MPI ``Send`` above the eager limit (16 KiB
    with this MPICH) waits for the matching receive, so both would wait
    forever.  The helper thread makes every backend's send buffered.  The
    thread starts with the first send and lives until :meth:`stop` (the
    Pipeline's ``close``, or its garbage collection): starting a thread per
    step would cost a GIL hand-over each time.  :meth:`finish` waits until
    every queued send has completed and re-raises a send's error on the
    stepping thread.  On a backend whose sends and receives share one queue
    (``Backend.serial_p2p``: NCCL's stream) a receive posted first would hold
    back the helper thread's sends, so there each ``(src, dst)`` pair of
    ``channels`` gets its own two-rank group, on which ``src`` only sends and
    ``dst`` only receives, in order (as the plan's channels pair up).

    Args:
        group: the pipeline's group; every member constructs the transport.
        channels: the ``(src, dst)`` group-rank pairs messages travel between,
            the same on every rank.
    """

    def __init__(self, group: ProcessGroup, channels: Sequence[tuple[int, int]] = ()) -> None:
        self._group = group
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: (src, dst) -> (the pair's group, the peer's rank in it); empty: all on ``group``.
        self._routes: dict[tuple[int, int], tuple[ProcessGroup, int]] = {}
        if group.backend_for("Pipeline").serial_p2p:
            me = group.rank
            for src, dst in sorted(set(channels)):
                members = sorted((src, dst))
                pair = group.new_group(members)  # collective: every rank, same order
                if me in members:
                    peer = dst if me == src else src
                    self._routes[src, dst] = (pair, members.index(peer))

    def ready(self, op: CommOp) -> bool:
        """Always True: :meth:`recv` blocks until the message arrives."""
        return True  # recv blocks until the message is there

    def send(self, op: CommOp, x: Any) -> None:
        """Queue ``x`` for the helper thread to send to ``op``'s peer; returns at once.

        Do not modify ``x`` until :meth:`finish`. Raises the error of an earlier
        send that failed, if any.
        """
        self._raise_send_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                            name=f"axondist-pipeline-send-r{op.rank}")
            self._thread.start()
        group, dst = self._routes[op.rank, op.peer] if self._routes else (self._group, op.peer)
        self._queue.put((x, group, dst, op.tag % _TAG_SPACE))

    def recv(self, op: CommOp) -> Any:
        """Receive the message for ``op`` from its peer, blocking until it arrives.

        When a send of this transport failed, that error is raised instead (it is
        the cause of a receive that can never complete).
        """
        self._raise_send_error()
        try:
            group, src = self._routes[op.peer, op.rank] if self._routes else (self._group, op.peer)
            return comm.recv(src, group, op.tag % _TAG_SPACE)
        except BaseException as exc:
            if self._error is not None:  # the real cause: our send failed
                raise self._error from exc
            raise

    def finish(self) -> None:
        """Wait until every send of the step completed."""
        self._queue.join()
        self._raise_send_error()

    def abandon(self) -> None:
        """The step failed: do not wait for its sends (they may never complete)."""

    def stop(self, wait: bool = False) -> None:
        """End the helper thread once it has sent what is queued; ``wait`` joins it."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if wait:
                thread.join()

    def destroy(self) -> None:
        """Free the pair groups (after :meth:`stop`); every member calls it."""
        routes, self._routes = self._routes, {}
        for pair, _ in routes.values():
            pair.destroy()

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure, only drain
                    x, group, dst, tag = item
                    comm.send(x, dst, group, tag)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the stepping thread
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise_send_error(self) -> None:
        if self._error is not None:
            raise self._error


Transport = InProcessTransport | GroupTransport
