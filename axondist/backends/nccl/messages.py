"""The NCCL backend's messages: point-to-point sends and receives of device arrays, and
Python objects pickled through device buffers (all-gathered, broadcast, or sent to one
rank with a tag checked on arrival).
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
from .collectives import CollectivesMixin
from .runtime import (
    Entry,
    require_no_group,
)


class MessagesMixin(CollectivesMixin):
    """Point to point and object exchange of :class:`~axondist.backends.nccl.NcclBackend`."""

    def _check_peer(self, peer: int, what: str, arg: str) -> None:
        self._check_root(peer, what, arg)
        if peer == self.rank:
            raise RankError(f"{what}: {arg}={peer} is this rank; NCCL cannot send a message to "
                            "the same rank outside a group (copy the array instead)")

    def _begin_p2p(self, what: str, peer: int, tag: int) -> Entry:
        """Number and record a send or receive (apart from the collectives, which every rank
        must count alike)."""
        self._usable(what)
        return self._state.begin(self._p2p_group, next(self._p2p_seqs), what,
                                 (("peer", self._members[peer]), ("tag", tag)), True)

    def _p2p(self, what: str, buf: Any, peer: int, sending: bool,
             entry: Entry | None = None) -> None:
        stream = self._stream.ptr

        def issue() -> None:
            if buf.nbytes:
                if sending:
                    self._comm.send(buf.data.ptr, buf.nbytes, NCCL_BYTE, peer, stream)
                else:
                    self._comm.recv(buf.data.ptr, buf.nbytes, NCCL_BYTE, peer, stream)

        # Blocking: returns once the message is out (inside a group: once the group ended).
        try:
            self._launch(what, issue, result=None, keep=(buf,), async_op=False, entry=entry)
        except BaseException:
            if entry is not None:
                self._state.finish(entry)
            raise

    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """``ncclSend`` of ``buf``'s bytes; returns once it was received.

        NCCL has no tags: ``tag`` is ignored and messages between two ranks
        match in the order they were sent. Two ranks that send to each other
        must do it inside :meth:`grouped` (NCCL pairs the calls), or one of
        them must receive first.
        """
        self._check(buf, "send")
        self._check_peer(dst, "send", "dst")
        self._p2p("send", buf, dst, True, self._begin_p2p("send", dst, tag))

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """``ncclRecv`` into ``buf``, whose size must equal the message's (``tag`` is ignored)."""
        self._check(buf, "recv", writable=True)
        self._check_peer(src, "recv", "src")
        self._p2p("recv", buf, src, False, self._begin_p2p("recv", src, tag))

    # --- Python objects over NCCL ---------------------------------------------------------
    def _send_header(self, what: str, dst: int, tag: int, nbytes: int) -> None:
        dev, _staging = self._device_bytes(np.array([tag, nbytes], dtype=np.int64).view(np.uint8))
        self._p2p(what, dev, dst, True)

    def _recv_header(self, what: str, src: int) -> tuple[int, int]:
        dev, _staging = self._device_bytes(b"", 16)
        self._p2p(what, dev, src, False)
        tag, nbytes = self._host(dev).view(np.int64)
        return int(tag), int(nbytes)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's pickled ``obj``, in rank order, gathered through device buffers.

        Blocking, and refused inside :func:`group_calls`; two all-gathers (the
        lengths, then the padded payloads).
        """
        require_no_group("allgather_object")
        entry = self._begin_call("allgather_object", ())
        try:
            return self._allgather_object_raw(obj)
        finally:
            self._state.finish(entry)

    def _allgather_object_raw(self, obj: Any) -> list[Any]:
        """:meth:`allgather_object` without recording or checking (the check's own exchange)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        lengths, _h = self._device_bytes(np.array([len(data)], dtype=np.int64).view(np.uint8))
        all_lengths, _h2 = self._device_bytes(b"", 8 * self.world_size)
        self._all_gather(lengths, all_lengths, [8] * self.world_size, False)
        sizes = self._host(all_lengths).view(np.int64).tolist()
        width = max(sizes)
        mine, _h3 = self._device_bytes(data, width)
        everything, _h4 = self._device_bytes(b"", width * self.world_size)
        self._all_gather(mine, everything, [width] * self.world_size, False)
        host = self._host(everything)
        return [pickle.loads(host[k * width:k * width + n].tobytes()) for k, n in enumerate(sizes)]

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj``, pickled through a device buffer (the root gets ``obj`` itself)."""
        require_no_group("broadcast_object")
        self._check_root(root, "broadcast_object", "root")
        entry = self._begin_call("broadcast_object", (int(root),))
        try:
            return self._broadcast_object_raw(obj, root)
        finally:
            self._state.finish(entry)

    def _broadcast_object_raw(self, obj: Any, root: int) -> Any:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        length, _h = self._device_bytes(np.array([len(data)], dtype=np.int64).view(np.uint8))
        self._broadcast(length, root, False)
        n = int(self._host(length).view(np.int64)[0])
        payload, _h2 = self._device_bytes(data, n)
        self._broadcast(payload, root, False)
        if self.rank == root:
            return obj
        return pickle.loads(self._host(payload).tobytes())

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Pickle ``obj`` and send a (tag, length) header then the payload to ``dst``."""
        require_no_group("send_object")
        self._check_peer(dst, "send_object", "dst")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        entry = self._begin_p2p("send_object", dst, tag)
        try:
            self._send_header("send_object", dst, tag, len(data))
            payload, _h = self._device_bytes(data)
            self._p2p("send_object", payload, dst, True)
        finally:
            self._state.finish(entry)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent.

        Raises:
            CollectiveMismatchError: that object was sent with another ``tag``
                (it is dropped: NCCL delivers a pair's messages in order).
        """
        require_no_group("recv_object")
        self._check_peer(src, "recv_object", "src")
        entry = self._begin_p2p("recv_object", src, tag)
        try:
            got_tag, n = self._recv_header("recv_object", src)
            payload, _h = self._device_bytes(b"", n)
            self._p2p("recv_object", payload, src, False)  # even on a wrong tag: keep in step
        finally:
            self._state.finish(entry)
        if got_tag != tag:
            raise CollectiveMismatchError(
                f"recv_object from rank {src}: the next message has tag {got_tag}, this receive "
                f"expects tag {tag}; NCCL delivers the messages between two ranks in the order "
                "they were sent, so receive them in that order (the message was dropped)")
        return pickle.loads(self._host(payload).tobytes())


__all__ = ["MessagesMixin"]
