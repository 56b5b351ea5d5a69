"""The cross-rank check's own sockets: one TCP connection between every two members of a
torch group, which carry each call's check words.

gloo's all-reduce of the check's 16 bytes costs 0.5-0.7 ms on two ranks of one host (its
socket loop thread hands every message over), a round trip of 16 bytes on a plain
connection about 20 us. The check moves no data, so it needs no collective algorithm:
every member sends its words to every other and takes the largest of what arrives, which
is the MAX all-reduce the check is (:mod:`~axondist.backends.checks`). A connection that
closes raises what gloo raises when a peer's process ends ("Connection closed by peer"),
and one silent for the group's timeout what torch raises when it times out, so the
backend words both as it words gloo's.

The members meet through torch.distributed's store: each one listens on the address its
watchdog serves on (``AXONDIST_DIAGNOSTICS``, ports from ``AXONDIST_DIAGNOSTICS_PORTS``)
and leaves it there under the group's unique name; a member connects to each member
before it and accepts each one after it, whose first bytes are the world's token and its
rank.
"""

from __future__ import annotations

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
    """How a world's groups make their check sockets: the address and ports this rank
    listens on while a group's members connect, the world's token, and the seconds a
    receive waits (torch's timeout of the world's groups)."""

    address: str
    ports: range | None
    token: bytes
    limit: float

    def connect(self, store: Any, name: str, rank: int, size: int) -> CheckWires:
        """:meth:`CheckWires.connect` of group rank ``rank`` of ``size``, the group named
        ``name`` in ``store``."""
        return CheckWires.connect(store, name, rank, size, self.address, self.ports,
                                  self.token, self.limit)


class CheckWires:
    """The connections of one member of a group to each other member (by group rank).

    Args:
        peers: the connected sockets by the peer's group rank.
        limit: seconds a receive waits before it counts as timed out.
    """

    def __init__(self, peers: dict[int, socket.socket], limit: float) -> None:
        self._peers = dict(sorted(peers.items()))
        self._limit = limit
        self._got = np.empty(2, np.int64)

    @classmethod
    def connect(cls, store: Any, name: str, rank: int, size: int, address: str,
                ports: range | None, token: bytes, limit: float) -> CheckWires:
        """Connect group rank ``rank`` of ``size`` to every other member; each member calls
        this with the same ``name`` (unique to the group in the world's store), ``token``
        and ``limit``."""
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
        return cls(peers, limit)

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

    def _talk(self, peer: int, act: Callable[..., Any], *args: Any) -> Any:
        """``act(*args)`` on ``peer``'s connection, its failures worded as gloo's."""
        try:
            return act(*args)
        except TimeoutError as exc:
            raise RuntimeError(f"the check's connection to group rank {peer} timed out after "
                               f"{self._limit:g} s") from exc
        except OSError as exc:  # reset, broken pipe: the peer's process ended
            raise RuntimeError(f"Connection closed by peer (group rank {peer}: {exc})") from exc

    def close(self) -> None:
        """Close every connection (idempotent)."""
        peers, self._peers = self._peers, {}
        for conn in peers.values():
            conn.close()


def _receive(conn: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``conn``; a closed connection raises ``ConnectionResetError``."""
    data = conn.recv(n)
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionResetError("the peer closed the connection")
        data += more
    return data


__all__ = ["CheckWires", "Wiring"]
