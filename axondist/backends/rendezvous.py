"""Bootstrap without MPI: the torchrun-style environment and a tiny TCP key-value store.

A job started by ``torchrun`` (or by hand) tells each process where rank 0
is and who it is through ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``RANK`` and ``LOCAL_RANK`` (:class:`LaunchEnv`). NCCL itself needs one
128-byte token, made by rank 0, on every rank before any GPU can talk; this
module carries it:

* rank 0 generates the value, then serves it from a :class:`KeyValueServer`
  listening on ``MASTER_PORT`` (on every interface);
* every other rank connects (retrying until rank 0 is up, up to the
  timeout), reads the key, and writes ``joined/<rank>``;
* rank 0 waits until every rank has joined and shuts the server down, so
  the port is free again once :func:`exchange_from_rank0` returns.

Only the bootstrap travels this way. Python objects exchanged later
(``allgather_object``...) go over NCCL itself, which works the same for
every bootstrap (MPI, this store, :meth:`NcclBackend.create_world`).

Wire format (all integers big-endian): a request is one command byte
(``S`` set, ``G`` get, ``K`` list keys), a 4-byte key length and the key,
then for ``S`` an 8-byte value length and the value, for ``G`` an 8-byte
float timeout in seconds. A reply is a status byte (0 ok, 1 timed out),
an 8-byte length and the payload. Values are raw bytes, never unpickled.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import CollectiveTimeoutError, RendezvousError

_MAX_VALUE = 1 << 20  # the store carries bootstrap tokens, not data
_OK, _TIMED_OUT = 0, 1


# --- the environment -----------------------------------------------------------------

@dataclass(frozen=True)
class LaunchEnv:
    """Where rank 0 is and who this process is (the torchrun convention).

    Attributes:
        master_addr: host name or address of rank 0 (``MASTER_ADDR``).
        master_port: TCP port rank 0 listens on (``MASTER_PORT``).
        world_size: number of processes (``WORLD_SIZE``).
        rank: this process's rank (``RANK``).
        local_rank: its rank among the processes of its node
            (``LOCAL_RANK``); None when not set.
    """

    master_addr: str
    master_port: int
    world_size: int
    rank: int
    local_rank: int | None = None

    REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")

    @classmethod
    def present(cls, environ: Mapping[str, str]) -> bool:
        """True when any of the variables is set (the user meant this launch style)."""
        return any(k in environ for k in cls.REQUIRED)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], who: str = "nccl bootstrap") -> LaunchEnv:
        """Parse and check the variables (``who`` starts the error messages).

        Raises:
            ValueError: a variable is missing, not an integer or out of range
                (the message names it and what to set).
        """
        missing = [k for k in cls.REQUIRED if not environ.get(k)]
        if missing:
            have = ", ".join(f"{k}={environ[k]}" for k in cls.REQUIRED if environ.get(k)) or "none"
            raise ValueError(
                f"{who}: {', '.join(missing)} not set (set: {have}); launch with "
                "torchrun, set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (and LOCAL_RANK) "
                "on every process, or launch with mpiexec")

        def integer(name: str, lo: int, hi: int | None = None) -> int:
            text = environ[name]
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{who}: {name}={text!r} is not an integer") from None
            if value < lo or (hi is not None and value > hi):
                span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
                raise ValueError(f"{who}: {name}={value} is out of range ({span})")
            return value

        world_size = integer("WORLD_SIZE", 1)
        rank = integer("RANK", 0, world_size - 1)
        local_rank = integer("LOCAL_RANK", 0) if environ.get("LOCAL_RANK") else None
        return cls(environ["MASTER_ADDR"], integer("MASTER_PORT", 1, 65535), world_size, rank,
                   local_rank)

    @property
    def endpoint(self) -> str:
        """``MASTER_ADDR:MASTER_PORT=host:port``, as error messages show it."""
        return f"MASTER_ADDR:MASTER_PORT={self.master_addr}:{self.master_port}"


# --- framing ---------------------------------------------------------------------------

def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _send_reply(sock: socket.socket, status: int, payload: bytes = b"") -> None:
    sock.sendall(struct.pack(">BQ", status, len(payload)) + payload)


# --- the server ------------------------------------------------------------------------

class KeyValueServer:
    """A thread-served key-value store of bytes on one TCP port.

    Args:
        port: the port (0 picks a free one; see :attr:`port`).
        host: the address to bind (all interfaces when "").
        initial: keys present from the start.

    Raises:
        RendezvousError: the port cannot be bound.
    """

    def __init__(self, port: int, host: str = "", initial: Mapping[str, bytes] | None = None):
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise RendezvousError(
                f"nccl rendezvous: rank 0 cannot listen on port {port} ({exc}); choose a free "
                "MASTER_PORT") from exc
        self._sock.settimeout(0.2)  # accept() wakes up to notice close()
        self.port: int = self._sock.getsockname()[1]
        self._data: dict[str, bytes] = dict(initial or {})
        self._cond = threading.Condition()
        self._closed = False
        self._clients: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name="axondist-rendezvous")
        self._accept_thread.start()

    # -- local access (rank 0 uses the store in process) --
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing it) and wake every waiting ``get``."""
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def value(self, key: str) -> bytes:
        """The value stored under ``key`` (KeyError when it was never set)."""
        with self._cond:
            return self._data[key]

    def keys(self) -> list[str]:
        """The keys set so far, in the order they were first set."""
        with self._cond:
            return list(self._data)

    def wait_for(self, ready: Callable[[dict[str, bytes]], bool], timeout: float) -> bool:
        """Wait until ``ready(data)``; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not ready(self._data):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(min(remaining, 0.5))
            return True

    # -- serving --
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # the socket was closed
                return
            conn.settimeout(None)
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._clients.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name="axondist-rendezvous-client")
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    head = conn.recv(1)
                except OSError:
                    return
                if not head:
                    return
                (klen,) = struct.unpack(">I", _recv_exact(conn, 4))
                if klen > 4096:
                    raise RendezvousError(f"nccl rendezvous: key of {klen} bytes")
                key = _recv_exact(conn, klen).decode()
                if head == b"S":
                    (vlen,) = struct.unpack(">Q", _recv_exact(conn, 8))
                    if vlen > _MAX_VALUE:
                        raise RendezvousError(f"nccl rendezvous: value of {vlen} bytes")
                    value = _recv_exact(conn, vlen)
                    # Reply first: a set may be what lets rank 0 close the server, and
                    # the client must not see that close as a failure of its set.
                    _send_reply(conn, _OK)
                    self.set(key, value)
                elif head == b"G":
                    (timeout,) = struct.unpack(">d", _recv_exact(conn, 8))
                    # wait_for calls the predicate before this loop moves on to the next key
                    if self.wait_for(lambda d: key in d, timeout):  # noqa: B023
                        with self._cond:
                            value = self._data[key]
                        _send_reply(conn, _OK, value)
                    else:
                        _send_reply(conn, _TIMED_OUT)
                elif head == b"K":
                    _send_reply(conn, _OK, "\n".join(self.keys()).encode())
                else:
                    raise RendezvousError(f"nccl rendezvous: unknown command {head!r}")
        except (OSError, RendezvousError, struct.error, UnicodeDecodeError):
            return  # a broken client only loses its own connection
        finally:
            conn.close()

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            clients = list(self._clients)
            self._cond.notify_all()
        self._sock.close()
        for c in clients:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._accept_thread.join(timeout=5)
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> KeyValueServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the client ---------------------------------------------------------------------------

class KeyValueClient:
    """A connection to a :class:`KeyValueServer`, retried until ``timeout``.

    Raises:
        CollectiveTimeoutError: rank 0's store was not reachable in time
            (the message names ``MASTER_ADDR:MASTER_PORT``).
    """

    def __init__(self, host: str, port: int, timeout: float, *, who: str = "this rank") -> None:
        self._endpoint = f"MASTER_ADDR:MASTER_PORT={host}:{port}"
        deadline = time.monotonic() + timeout
        delay, last = 0.01, None
        while True:
            try:
                self._sock = socket.create_connection(
                    (host, port), timeout=max(0.05, min(5.0, deadline - time.monotonic())))
                break
            except OSError as exc:
                last = exc
            if time.monotonic() + delay > deadline:
                raise CollectiveTimeoutError(
                    f"nccl rendezvous: {who} could not reach rank 0 at {self._endpoint} within "
                    f"{timeout:g} s (last error: {last}); check that rank 0 is running, that every "
                    "rank has the same MASTER_ADDR and MASTER_PORT, and that the port is open")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        self._sock.settimeout(None)

    def _request(self, payload: bytes, wait: float | None = None) -> tuple[int, bytes]:
        self._sock.settimeout(None if wait is None else wait + 10.0)
        try:
            self._sock.sendall(payload)
            status, length = struct.unpack(">BQ", _recv_exact(self._sock, 9))
            return status, _recv_exact(self._sock, length)
        except (OSError, ConnectionError) as exc:
            raise RendezvousError(f"nccl rendezvous: lost the connection to rank 0 at "
                                  f"{self._endpoint} ({exc})") from exc

    @staticmethod
    def _key(cmd: bytes, key: str) -> bytes:
        k = key.encode()
        return cmd + struct.pack(">I", len(k)) + k

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""
        if len(value) > _MAX_VALUE:
            raise ValueError(f"KeyValueClient.set: {len(value)} bytes exceed {_MAX_VALUE}")
        self._request(self._key(b"S", key) + struct.pack(">Q", len(value)) + bytes(value))

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set."""
        status, value = self._request(self._key(b"G", key) + struct.pack(">d", timeout), timeout)
        if status == _TIMED_OUT:
            raise CollectiveTimeoutError(
                f"nccl rendezvous: key {key!r} was not set at {self._endpoint} within "
                f"{timeout:g} s")
        return value

    def keys(self) -> list[str]:
        """The keys the server holds now (one round trip)."""
        _, value = self._request(self._key(b"K", ""))
        return [k for k in value.decode().split("\n") if k]

    def close(self) -> None:
        """Close the connection to the server (the store itself lives on)."""
        self._sock.close()

    def __enter__(self) -> KeyValueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the exchange ----------------------------------------------------------------------

def exchange_from_rank0(env: LaunchEnv, key: str, make_value: Callable[[], bytes],
                        timeout: float) -> bytes:
    """Rank 0's ``make_value()`` on every rank of ``env`` (called on rank 0 only).

    Every rank must call it with the same ``key``. Returns once this rank
    has the value; on rank 0, once every rank has fetched it (so the server
    can be closed and the port reused).

    Raises:
        CollectiveTimeoutError: rank 0 unreachable, or (on rank 0) some ranks
            never joined; the message names ``MASTER_ADDR:MASTER_PORT`` and
            the missing ranks.
        RendezvousError: rank 0 cannot listen on ``MASTER_PORT``.
    """
    if env.world_size == 1:
        return make_value()
    if env.rank == 0:
        value = make_value()
        joined = [f"{key}/joined/{r}" for r in range(1, env.world_size)]
        with KeyValueServer(env.master_port, "", {key: value}) as server:
            if not server.wait_for(lambda d: all(j in d for j in joined), timeout):
                present = set(server.keys())
                missing = [r for r, j in zip(range(1, env.world_size), joined) if j not in present]
                raise CollectiveTimeoutError(
                    f"nccl rendezvous at {env.endpoint}: ranks {missing} of {env.world_size} did "
                    f"not join within {timeout:g} s; start every rank with the same MASTER_ADDR, "
                    "MASTER_PORT and WORLD_SIZE (and distinct RANK)")
        return value
    deadline = time.monotonic() + timeout
    with KeyValueClient(env.master_addr, env.master_port, timeout,
                        who=f"rank {env.rank}") as client:
        value = client.get(key, max(0.0, deadline - time.monotonic()))
        client.set(f"{key}/joined/{env.rank}", b"1")
    return value


def allgather_over_rendezvous(env: LaunchEnv, key: str, value: bytes,
                              timeout: float) -> list[bytes]:
    """Every rank's ``value`` in rank order, on every rank of ``env``, over rank 0's store.

    Every rank must call it with the same ``key``. Rank 0 serves the store until every
    other rank has read the whole list (so the port is free again when it returns).

    Raises:
        CollectiveTimeoutError: rank 0 unreachable, or a rank's value (or, on rank 0, a
            rank's reading) missing after ``timeout``; the message names the ranks.
        RendezvousError: rank 0 cannot listen on ``MASTER_PORT``.
    """
    n = env.world_size
    if n == 1:
        return [bytes(value)]
    names = [f"{key}/{r}" for r in range(n)]
    if env.rank == 0:
        read = [f"{key}/read/{r}" for r in range(1, n)]
        with KeyValueServer(env.master_port, "", {names[0]: bytes(value)}) as server:
            if not server.wait_for(lambda d: all(k in d for k in names + read), timeout):
                present = set(server.keys())
                missing = [r for r in range(1, n)
                           if names[r] not in present or read[r - 1] not in present]
                raise CollectiveTimeoutError(
                    f"nccl rendezvous at {env.endpoint}: ranks {missing} of {n} did not join "
                    f"within {timeout:g} s; start every rank with the same MASTER_ADDR, "
                    "MASTER_PORT and WORLD_SIZE (and distinct RANK)")
            return [server.value(k) for k in names]
    deadline = time.monotonic() + timeout
    with KeyValueClient(env.master_addr, env.master_port, timeout,
                        who=f"rank {env.rank}") as client:
        client.set(names[env.rank], bytes(value))
        values = [client.get(k, max(0.0, deadline - time.monotonic())) for k in names]
        client.set(f"{key}/read/{env.rank}", b"1")
    return values


__all__ = ["KeyValueClient", "KeyValueServer", "LaunchEnv", "RendezvousError",
           "allgather_over_rendezvous", "exchange_from_rank0"]
