"""A torch group's own sockets: one TCP connection between every two members, which carry
each call's check words and the data of the calls the algorithm table puts on them
(:mod:`.choose`: the collectives of host memory).

gloo's all-reduce of the check's 16 bytes costs 0.5-0.7 ms on two ranks of one host (its
socket loop thread hands every message over), a round trip of 16 bytes on a plain
connection about 20 us. The check moves no data, so it needs no collective algorithm:
every member sends its words to every other and takes the largest of what arrives, which
is the MAX all-reduce the check is (:mod:`~axondist.backends.checks`). A connection that
closes raises what gloo raises when a peer's process ends ("Connection closed by peer"),
and one silent for the group's timeout what torch raises when it times out, so the
backend words both as it words gloo's.

A broadcast of host memory follows its check on the same connections, the root writing
the bytes on each member's (:meth:`GroupWires.broadcast`): gloo's broadcast costs 0.24-0.29
ms at 4 KiB and 0.64-0.81 ms at 1 MiB on two ranks here, for the same reason. Other calls
send every member its own bytes at once (:meth:`GroupWires.exchange`). Calls reach the
wires in the group's call order on every member, so the bytes a member reads next are
always the ones it expects.

The members meet through torch.distributed's store: each one listens on the address its
watchdog serves on (``AXONDIST_DIAGNOSTICS``, ports from ``AXONDIST_DIAGNOSTICS_PORTS``)
and leaves it there under the group's unique name; a member connects to each member
before it and accepts each one after it, whose first bytes are the world's token and its
rank.
"""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..watchdog.diagnostics import listen

_RANK = struct.Struct("!q")


@dataclass(frozen=True)
class Wiring:
    """How a world's groups make their sockets: the address and ports this rank
    listens on while a group's members connect, the world's token, and the seconds a
    receive waits (torch's timeout of the world's groups)."""

    address: str
    ports: range | None
    token: bytes
    limit: float

    def connect(self, store: Any, name: str, rank: int, size: int) -> GroupWires:
        """:meth:`GroupWires.connect` of group rank ``rank`` of ``size``, the group named
        ``name`` in ``store``."""
        return GroupWires.connect(store, name, rank, size, self.address, self.ports,
                                  self.token, self.limit)

    def connect_peers(self, store: Any, name: str, rank: int, size: int
                      ) -> dict[int, socket.socket]:
        """:func:`connect_peers` of rank ``rank`` of ``size``, under ``name`` in ``store``."""
        return connect_peers(store, name, rank, size, self.address, self.ports, self.token,
                             self.limit)


class GroupWires:
    """The connections of one member of a group to each other member (by group rank).

    Args:
        peers: the connected sockets by the peer's group rank.
        limit: seconds a receive waits before it counts as timed out.
        rank: this member's group rank.
    """

    def __init__(self, peers: dict[int, socket.socket], limit: float, rank: int) -> None:
        self._peers = dict(sorted(peers.items()))
        self._limit = limit
        self.rank = rank
        self._got = np.empty(2, np.int64)

    @classmethod
    def connect(cls, store: Any, name: str, rank: int, size: int, address: str,
                ports: range | None, token: bytes, limit: float) -> GroupWires:
        """Connect group rank ``rank`` of ``size`` to every other member; each member calls
        this with the same ``name`` (unique to the group in the world's store), ``token``
        and ``limit``."""
        return cls(connect_peers(store, name, rank, size, address, ports, token, limit), limit,
                   rank)

    def largest(self, words: np.ndarray) -> None:
        """Replace ``words`` (two int64) by their element-wise maximum over the group.

        Raises:
            RuntimeError: a peer's connection closed ("Connection closed by peer"), or
                nothing came from a peer within the limit ("timed out").
        """
        sent = words.tobytes()
        for peer, conn in self._peers.items():
            self._talk(peer, conn.sendall, sent)
        for peer, conn in self._peers.items():
            self._got[...] = np.frombuffer(self._talk(peer, _receive, conn, len(sent)),
                                           np.int64)
            np.maximum(words, self._got, out=words)

    def broadcast(self, data: np.ndarray, root: int) -> None:
        """Replace ``data`` (a C-contiguous host array) on every member by the root's: group
        rank ``root`` writes its bytes on each member's connection, the others read them.

        Raises:
            RuntimeError: as :meth:`largest`.
        """
        if not data.nbytes:
            return
        view = memoryview(data.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        if self.rank == root:
            for peer, conn in self._peers.items():
                self._talk(peer, conn.sendall, view)
        else:
            self._talk(root, _receive_into, self._peers[root], view)

    def pair_reduce(self, data: np.ndarray, combine: Callable[[np.ndarray, np.ndarray], None]
                    ) -> None:
        """In a group of two, replace ``data`` (a C-contiguous host array of the same size
        on both) on both members by ``combine(own, other)``: each member owns one half
        (group rank 0 the first ``ceil(n / 2)`` elements), sends the other half to its
        owner while it receives the other's values of its own, combines them in place,
        and sends the result back while it receives the other's.

        Raises:
            RuntimeError: as :meth:`largest`.
        """
        flat = data.reshape(-1)
        first = (flat.size + 1) // 2
        halves = (flat[:first], flat[first:])
        mine, theirs = halves[self.rank], halves[1 - self.rank]
        other = np.empty_like(mine)
        self.pair_swap(theirs, other)
        combine(mine, other)
        self.pair_swap(mine, theirs)

    def pair_swap(self, sent: np.ndarray, into: np.ndarray) -> None:
        """In a group of two, send the bytes of ``sent`` to the other member while its
        bytes are received into ``into``: :meth:`exchange` with the one peer.

        Raises:
            RuntimeError: as :meth:`largest`.
        """
        peer = 1 - self.rank
        self.exchange({peer: sent}, {peer: into})

    def exchange(self, sends: dict[int, np.ndarray], receives: dict[int, np.ndarray]) -> None:
        """Send ``sends[p]`` to each member ``p`` while ``receives[p]`` fills with what
        ``p`` sends (C-contiguous host arrays by group rank; what this member receives from
        ``p`` as long as what ``p`` sends it; a member left out moves nothing). Every
        member writes at once and a socket's buffer holds less than a large array, so this
        thread writes what each socket takes and reads what has come, in turn, until all
        are done: no order of the members' calls can deadlock. The limit counts from the
        last bytes moved on any connection.

        Raises:
            RuntimeError: as :meth:`largest`, naming the first member still waited for.
        """
        pending: dict[int, _Transfer] = {}
        for peer, conn in self._peers.items():
            out = _bytes(sends[peer]) if peer in sends else _NOTHING
            into = _bytes(receives[peer]) if peer in receives else _NOTHING
            if len(out) or len(into):
                pending[conn.fileno()] = _Transfer(peer, conn, out, into)
        poller = select.poll()
        for fd, transfer in pending.items():
            poller.register(fd, transfer.events())
        while pending:
            ready = poller.poll(self._limit * 1000)
            if not ready:
                waited = min(t.peer for t in pending.values())
                raise self._failure(waited, TimeoutError("timed out"))
            for fd, happened in ready:
                transfer = pending[fd]
                try:
                    transfer.step(happened)
                except OSError as exc:
                    raise self._failure(transfer.peer, exc) from exc
                if transfer.done():
                    poller.unregister(fd)
                    del pending[fd]
                else:
                    poller.modify(fd, transfer.events())

    def _talk(self, peer: int, act: Callable[..., Any], *args: Any) -> Any:
        """``act(*args)`` on ``peer``'s connection, its failures worded as gloo's."""
        try:
            return act(*args)
        except OSError as exc:
            raise self._failure(peer, exc) from exc

    def _failure(self, peer: int, exc: OSError) -> RuntimeError:
        """The error of ``peer``'s connection failing with ``exc``, worded as gloo's."""
        if isinstance(exc, TimeoutError):
            return RuntimeError(f"the connection to group rank {peer} timed out after "
                                f"{self._limit:g} s")
        # reset, broken pipe: the peer's process ended
        return RuntimeError(f"Connection closed by peer (group rank {peer}: {exc})")

    def close(self) -> None:
        """Close every connection (idempotent)."""
        peers, self._peers = self._peers, {}
        for conn in peers.values():
            conn.close()


def connect_peers(store: Any, name: str, rank: int, size: int, address: str,
                  ports: range | None, token: bytes, limit: float) -> dict[int, socket.socket]:
    """A TCP connection from rank ``rank`` of ``size`` to every other, by the peer's rank:
    each one listens on ``address`` (a port of ``ports``) and leaves it in ``store`` under
    ``name``, connects to each rank before it and accepts each one after it, whose first
    bytes are ``token`` and its rank. The sockets wait ``limit`` seconds at most."""
    peers: dict[int, socket.socket] = {}
    listener = listen(address, ports) if rank < size - 1 else None
    try:
        if listener is not None:
            host, port = listener.getsockname()[:2]
            store.set(f"{name}/{rank}", f"{host}:{port}")
        for peer in range(rank):
            host, port = store.get(f"{name}/{peer}").decode().rsplit(":", 1)
            conn = socket.create_connection((host, int(port)), timeout=limit)
            peers[peer] = conn
            conn.sendall(token + _RANK.pack(rank))
        if listener is not None:
            listener.settimeout(limit)
            while len(peers) < size - 1:
                conn, _ = listener.accept()
                conn.settimeout(limit)
                try:
                    hello = _receive(conn, len(token) + _RANK.size)
                except OSError:  # closed or silent: not a member
                    hello = b""
                peer = _RANK.unpack(hello[len(token):])[0] if hello else -1
                if hello[:len(token)] != token or not rank < peer < size or peer in peers:
                    conn.close()  # not a member of this group: nothing of this job
                    continue
                peers[peer] = conn
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise
    finally:
        if listener is not None:
            listener.close()
    for conn in peers.values():
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(limit)
    return peers


def _bytes(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a memoryview over its memory."""
    return memoryview(array.view(np.uint8))  # type: ignore[arg-type]


#: What a member neither sends to nor receives from moves.
_NOTHING = memoryview(b"")


class _Transfer:
    """One connection's part of :meth:`GroupWires.exchange`: the bytes still to write on
    it and to read from it."""

    __slots__ = ("peer", "conn", "out", "into", "sent", "got")

    def __init__(self, peer: int, conn: socket.socket, out: memoryview, into: memoryview
                 ) -> None:
        self.peer, self.conn, self.out, self.into = peer, conn, out, into
        self.sent = self.got = 0

    def events(self) -> int:
        """What to wait for on the connection next."""
        return (select.POLLOUT if self.sent < len(self.out) else 0) | (
            select.POLLIN if self.got < len(self.into) else 0)

    def done(self) -> bool:
        return self.sent == len(self.out) and self.got == len(self.into)

    def step(self, happened: int) -> None:
        """Read what has come and write what the socket takes, as ``happened`` (poll's
        events) allows; a closed connection raises ``ConnectionResetError``."""
        conn = self.conn
        try:
            if happened & (select.POLLIN | select.POLLHUP | select.POLLERR) \
                    and self.got < len(self.into):
                n = conn.recv_into(self.into[self.got:], 0, socket.MSG_DONTWAIT)
                if not n:
                    raise ConnectionResetError("the peer closed the connection")
                self.got += n
            elif happened & (select.POLLHUP | select.POLLERR):
                raise ConnectionResetError("the peer closed the connection")
            if happened & select.POLLOUT and self.sent < len(self.out):
                self.sent += conn.send(self.out[self.sent:], socket.MSG_DONTWAIT)
        except BlockingIOError:  # nothing after all: poll again
            pass


def _receive_into(conn: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``conn``; a closed connection raises ``ConnectionResetError``."""
    at = 0
    while at < len(view):
        got = conn.recv_into(view[at:])
        if not got:
            raise ConnectionResetError("the peer closed the connection")
        at += got


def _receive(conn: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``conn``; a closed connection raises ``ConnectionResetError``."""
    data = conn.recv(n)
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionResetError("the peer closed the connection")
        data += more
    return data


__all__ = ["GroupWires", "Wiring", "connect_peers"]
