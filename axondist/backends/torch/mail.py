"""The torch backend's point-to-point messages of host memory, on connections of their own:
one TCP connection between every two ranks of the world, shared by its groups.

gloo's ``send``/``recv`` hand each message through its socket loop thread: about 0.9 ms a
message on two ranks of one host, and a message is two of them (its size, then its
bytes), where a plain connection carries a small message in tens of microseconds. A
message here is one frame (its group, tag, size and bytes); a reader thread per
connection files arriving messages by (sender, group, tag), so messages of different tags
and groups may be received in any order, and in order within one, as MPI and gloo match
them. A receive answers with a receipt: a send is done when its receiver took it, as
gloo's is, which the backend's account of unreceived sends at exit relies on.

A closed connection raises what gloo raises when a peer's process ends ("Connection
closed by peer"), and a receive with nothing for the group's timeout what torch raises
when it times out, so the backend words both as it words gloo's. Messages already
arrived from a peer whose connection closed are still received.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from .wires import Wiring

#: A frame's header: kind, message id, tag, bytes, then the group's name's length.
_FRAME = struct.Struct("!BqqQH")
_MESSAGE, _RECEIPT = 0, 1


class Mailbox:
    """This rank's connections to every other rank of the world, for messages.

    Args:
        peers: the connected sockets by the peer's world rank.
        limit: seconds a receive (and a send's wait for its receipt) waits at most.
    """

    def __init__(self, peers: dict[int, socket.socket], limit: float) -> None:
        self.limit = limit
        self._conns = dict(peers)
        self._writing = {peer: threading.Lock() for peer in peers}
        self._arrived = threading.Condition()
        #: (sender, group, tag) -> the messages arrived, as (id, bytes), oldest first
        self._inbox: dict[tuple[int, str, int], collections.deque] = {}
        #: (receiver, message id) -> the future of a send, done once it was received
        self._receipts: dict[tuple[int, int], concurrent.futures.Future] = {}
        #: peer -> why its connection ended
        self._lost: dict[int, str] = {}
        self._ids = itertools.count()
        self._closing = False
        for peer, conn in self._conns.items():
            threading.Thread(target=self._read, args=(peer, conn), daemon=True,
                             name=f"axondist-mail-from-{peer}").start()

    @classmethod
    def connect(cls, wiring: Wiring, store: Any, name: str, rank: int, size: int) -> Mailbox:
        """Every rank of the world calls this with the same ``name`` (unique to the world
        in ``store``)."""
        return cls(wiring.connect_peers(store, name, rank, size), wiring.limit)

    def reaches(self, peer: int) -> bool:
        """Whether messages to and from world rank ``peer`` go through here."""
        return peer in self._conns

    def send(self, dst: int, group: str, tag: int,
             payload: np.ndarray) -> concurrent.futures.Future:
        """Write a message of the bytes ``payload`` to world rank ``dst``; its future, done
        once ``dst`` received it (or failed with gloo's words, its connection gone).

        Raises:
            RuntimeError: the connection is closed, or the write waited past the limit.
        """
        receipt: concurrent.futures.Future = concurrent.futures.Future()
        ident = next(self._ids)
        with self._arrived:
            if dst in self._lost:
                raise RuntimeError(self._lost[dst])
            self._receipts[dst, ident] = receipt
        name = group.encode()
        try:
            self._write(dst, _FRAME.pack(_MESSAGE, ident, tag, payload.nbytes, len(name)) + name,
                        payload)
        except RuntimeError as exc:
            with self._arrived:
                self._receipts.pop((dst, ident), None)
            receipt.set_exception(exc)
            raise
        return receipt

    def wait(self, receipt: concurrent.futures.Future, dst: int) -> None:
        """Wait until a send's ``receipt`` says ``dst`` received it.

        Raises:
            RuntimeError: the connection closed first, or the limit passed.
        """
        try:
            receipt.result(self.limit)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"send to rank {dst}: no receive took the message; timed out "
                               f"after {self.limit:g} s") from None

    def receive(self, src: int, group: str, tag: int) -> np.ndarray:
        """The bytes of the next message from world rank ``src`` in ``group`` with ``tag``.

        Raises:
            RuntimeError: the connection closed with nothing of the kind arrived, or
                nothing came within the limit.
        """
        key = (src, group, tag)
        deadline = time.monotonic() + self.limit
        with self._arrived:
            while not self._inbox.get(key):
                if src in self._lost:
                    raise RuntimeError(self._lost[src])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"recv from rank {src}: nothing arrived; timed out "
                                       f"after {self.limit:g} s")
                self._arrived.wait(left)
            waiting = self._inbox[key]
            ident, data = waiting.popleft()
            if not waiting:
                del self._inbox[key]
        try:
            self._write(src, _FRAME.pack(_RECEIPT, ident, 0, 0, 0))
        except RuntimeError:
            pass  # the sender has gone: nothing waits for the receipt
        return data

    def close(self, settle: float = 1.0) -> None:
        """Close every connection (idempotent), once every message sent was received or
        ``settle`` seconds passed; the reader threads end."""
        deadline = time.monotonic() + settle
        with self._arrived:
            while self._receipts and not self._closing and time.monotonic() < deadline:
                self._arrived.wait(0.01)
        self._closing = True
        conns, self._conns = self._conns, {}
        for conn in conns.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    # --- the wire ---------------------------------------------------------------------------
    def _write(self, peer: int, head: bytes, payload: np.ndarray | None = None) -> None:
        conn = self._conns.get(peer)
        if conn is None:
            raise RuntimeError(f"Connection closed by peer (rank {peer}: the world was closed)")
        try:
            with self._writing[peer]:
                conn.sendall(head)
                if payload is not None and payload.nbytes:
                    conn.sendall(memoryview(payload))  # type: ignore[arg-type]
        except TimeoutError as exc:
            raise RuntimeError(f"the connection to rank {peer} timed out after "
                               f"{self.limit:g} s (its process does not read)") from exc
        except OSError as exc:  # reset, broken pipe: the peer's process ended
            raise RuntimeError(f"Connection closed by peer (rank {peer}: {exc})") from exc

    def _read(self, peer: int, conn: socket.socket) -> None:
        """File every message from ``peer`` and settle the receipts it sends, until its
        connection closes."""
        head = bytearray(_FRAME.size)
        try:
            while True:
                self._fill(conn, memoryview(head))
                kind, ident, tag, size, length = _FRAME.unpack(head)
                if kind == _RECEIPT:
                    with self._arrived:
                        receipt = self._receipts.pop((peer, ident), None)
                    if receipt is not None:
                        receipt.set_result(None)
                    continue
                name = bytearray(length)
                self._fill(conn, memoryview(name))
                data = np.empty(size, np.uint8)
                self._fill(conn, memoryview(data))  # type: ignore[arg-type]
                with self._arrived:
                    self._inbox.setdefault((peer, name.decode(), tag),
                                           collections.deque()).append((ident, data))
                    self._arrived.notify_all()
        except OSError as exc:
            why = f"Connection closed by peer (rank {peer}: {exc})"
            with self._arrived:
                self._lost[peer] = why
                unanswered = [key for key in self._receipts if key[0] == peer]
                failed = [self._receipts.pop(key) for key in unanswered]
                self._arrived.notify_all()
            for receipt in failed:
                receipt.set_exception(RuntimeError(why))

    def _fill(self, conn: socket.socket, view: memoryview) -> None:
        """Fill ``view`` from ``conn``, however long the peer is silent (the socket's timeout
        bounds writes; a reader waits for as long as the world lives)."""
        at = 0
        while at < len(view):
            try:
                got = conn.recv_into(view[at:])
            except TimeoutError:
                if self._closing:
                    raise ConnectionAbortedError("the world was closed") from None
                continue
            if not got:
                raise ConnectionResetError("the peer closed the connection")
            at += got


__all__ = ["Mailbox"]
