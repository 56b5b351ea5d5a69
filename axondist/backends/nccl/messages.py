"""The NCCL backend's messages (:class:`Messages`): point-to-point sends and receives of
device arrays, and Python objects pickled through device buffers (all-gathered, broadcast,
or sent to one rank with a tag checked on arrival), each recorded on the rank's
:class:`~.communicator.Communicator`.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ...errors import (
    CollectiveMismatchError,
    RankError,
)
from .basics import (
    NCCL_BYTE,
)
from .communicator import Communicator
from .runtime import (
    Entry,
    require_no_group,
)


class Messages:
    """Point to point and object exchange over one communicator.

    Args:
        comm: the communicator the messages travel on.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def _check_peer(self, peer: int, what: str, arg: str) -> None:
        self.comm.check_rank(peer, what, arg)
        if peer == self.comm.rank:
            raise RankError(f"{what}: {arg}={peer} is this rank; NCCL cannot send a message to "
                            "the same rank outside a group (copy the array instead)")

    def _p2p(self, what: str, buf: Any, peer: int, sending: bool,
             entry: Entry | None = None) -> None:
        stream, comm = self.comm.stream.ptr, self.comm.nccl_comm

        def issue() -> None:
            if buf.nbytes:
                if sending:
                    comm.send(buf.data.ptr, buf.nbytes, NCCL_BYTE, peer, stream)
                else:
                    comm.recv(buf.data.ptr, buf.nbytes, NCCL_BYTE, peer, stream)

        # Blocking: returns once the message is out (inside a group: once the group ended).
        try:
            self.comm.launch(what, issue, result=None, keep=(buf,), async_op=False, entry=entry)
        except BaseException:
            if entry is not None:
                self.comm.state.finish(entry)
            raise

    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """``ncclSend`` of ``buf``'s bytes; returns once it was received.

        NCCL has no tags: ``tag`` is ignored and messages between two ranks
        match in the order they were sent. Two ranks that send to each other
        must do it inside ``NcclBackend.grouped()`` (NCCL pairs the calls), or one of
        them must receive first.
        """
        self.comm.require_on_device(buf, "send")
        self._check_peer(dst, "send", "dst")
        self._p2p("send", buf, dst, True, self.comm.begin_p2p("send", dst, tag))

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """``ncclRecv`` into ``buf``, whose size must equal the message's (``tag`` is ignored)."""
        self.comm.require_on_device(buf, "recv", writable=True)
        self._check_peer(src, "recv", "src")
        self._p2p("recv", buf, src, False, self.comm.begin_p2p("recv", src, tag))

    # --- Python objects over NCCL ---------------------------------------------------------
    def _send_header(self, what: str, dst: int, tag: int, nbytes: int) -> None:
        header = np.array([tag, nbytes], dtype=np.int64).view(np.uint8)
        dev, _staging = self.comm.device_bytes(header)
        self._p2p(what, dev, dst, True)

    def _recv_header(self, what: str, src: int) -> tuple[int, int]:
        dev, _staging = self.comm.device_bytes(b"", 16)
        self._p2p(what, dev, src, False)
        tag, nbytes = self.comm.host_copy(dev).view(np.int64)
        return int(tag), int(nbytes)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's pickled ``obj``, in rank order, gathered through device buffers.

        Blocking, and refused inside :func:`group_calls`; two all-gathers (the
        lengths, then the padded payloads).
        """
        require_no_group("allgather_object")
        entry = self.comm.begin_call("allgather_object", ())
        try:
            return self.comm.allgather_object_raw(obj)
        finally:
            self.comm.state.finish(entry)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj``, pickled through a device buffer (the root gets ``obj`` itself)."""
        require_no_group("broadcast_object")
        self.comm.check_rank(root, "broadcast_object", "root")
        entry = self.comm.begin_call("broadcast_object", (int(root),))
        try:
            return self.comm.broadcast_object_raw(obj, root)
        finally:
            self.comm.state.finish(entry)

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Pickle ``obj`` and send a (tag, length) header then the payload to ``dst``."""
        require_no_group("send_object")
        self._check_peer(dst, "send_object", "dst")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        entry = self.comm.begin_p2p("send_object", dst, tag)
        try:
            self._send_header("send_object", dst, tag, len(data))
            payload, _h = self.comm.device_bytes(data)
            self._p2p("send_object", payload, dst, True)
        finally:
            self.comm.state.finish(entry)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent.

        Raises:
            CollectiveMismatchError: that object was sent with another ``tag``
                (it is dropped: NCCL delivers a pair's messages in order).
        """
        require_no_group("recv_object")
        self._check_peer(src, "recv_object", "src")
        entry = self.comm.begin_p2p("recv_object", src, tag)
        try:
            got_tag, n = self._recv_header("recv_object", src)
            payload, _h = self.comm.device_bytes(b"", n)
            self._p2p("recv_object", payload, src, False)  # even on a wrong tag: keep in step
        finally:
            self.comm.state.finish(entry)
        if got_tag != tag:
            raise CollectiveMismatchError(
                f"recv_object from rank {src}: the next message has tag {got_tag}, this receive "
                f"expects tag {tag}; NCCL delivers the messages between two ranks in the order "
                "they were sent, so receive them in that order (the message was dropped)")
        return pickle.loads(self.comm.host_copy(payload).tobytes())


__all__ = ["Messages"]
