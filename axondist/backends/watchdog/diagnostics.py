"""The watchdog's side channel: where each rank's diagnostics server listens, its settings
(``AXONDIST_DIAGNOSTICS``, ``AXONDIST_DIAGNOSTICS_PORTS``, ``AXONDIST_CUT_OFF_TIMEOUT``),
and one request to a peer's server (a JSON line out, a JSON line back). See
docs/backends.md ("The watchdog")."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..._environment import launched_on_one_host
from .. import settings

#: The longest line a server or a client reads.
MAX_LINE = 1 << 20
#: What a query got instead of a status: the port refused, nothing came back in time, or
#: the peer runs no server. None of these alone proves that the peer ended.
GONE = "refused"
NO_ANSWER = "no answer"
NO_SERVER = "no diagnostics server"
#: What each of those means, for messages.
WHY_SILENT = {
    GONE: "its diagnostics port refuses connections: its process ended, or a firewall rejects "
          "the connection",
    NO_ANSWER: "its diagnostics port did not reply: its host is cut off, or it is stuck in code "
               "that holds the GIL",
    NO_SERVER: "it runs with AXONDIST_DIAGNOSTICS=off: only the timeout ends a wait for it"}
#: The least one question of a look that is out of time waits for its reply (seconds).
SHORTEST_ASK = 0.1
_OFF = ("0", "off", "no", "false")
_AUTO = ("", "1", "on", "yes", "true", "auto")


def host_addresses() -> list[str]:
    """Addresses peers may reach this host at (the loopback last: only for the same host)."""
    addresses: list[str] = []
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            address = str(info[4][0])
            if address not in addresses and not address.startswith("127."):
                addresses.append(address)
    except OSError:
        pass
    return addresses + ["127.0.0.1"]


def diagnostics_address(environ: Mapping[str, str] | None = None) -> str | None:
    """The address the diagnostics server binds, from ``AXONDIST_DIAGNOSTICS``: None for
    ``off``; for ``auto`` (the default) the loopback when the launcher puts every rank on
    this host, else the first address this host's name resolves to (the one the ranks
    reach each other on); any other value is the address itself."""
    environ = os.environ if environ is None else environ
    setting = settings.read("AXONDIST_DIAGNOSTICS", environ)
    if setting.lower() in _OFF:
        return None
    if setting.lower() not in _AUTO:
        return setting
    return "127.0.0.1" if launched_on_one_host(environ) else host_addresses()[0]


def diagnostics_ports(environ: Mapping[str, str] | None = None) -> range | None:
    """The ports the server may take, from ``AXONDIST_DIAGNOSTICS_PORTS=LO-HI`` (None: any
    free port the system gives).

    Raises:
        ValueError: a setting that is not ``LO-HI`` with 1 <= LO <= HI <= 65535.
    """
    ports: range | None = settings.read("AXONDIST_DIAGNOSTICS_PORTS", environ)
    return ports


def listen(address: str, ports: range | None) -> socket.socket:
    """A listening socket on ``address``, on a free port of ``ports`` (any when None)."""
    if ports is None:
        return socket.create_server((address, 0), backlog=64)
    offset = os.getpid() % len(ports)  # ranks of one host start at different ports
    for i in range(len(ports)):
        try:
            return socket.create_server((address, ports[(offset + i) % len(ports)]), backlog=64)
        except OSError:
            continue
    raise ValueError(f"watchdog: no free port in AXONDIST_DIAGNOSTICS_PORTS="
                     f"{ports.start}-{ports.stop - 1} on {address}; widen the range (each rank "
                     "of a host takes one port) or set AXONDIST_DIAGNOSTICS=off")


def cut_off_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds no rank of a peer host may answer before that host counts as cut off
    (``AXONDIST_CUT_OFF_TIMEOUT``, default 30).

    Raises:
        ValueError: not a number > 0.
    """
    seconds: float = settings.read("AXONDIST_CUT_OFF_TIMEOUT", environ)
    return seconds


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


Address = tuple[list[str], int, str, int]


def send_to_peer(address: Address, message: dict[str, Any], timeout: float,
             want_reply: bool) -> Any:
    """Send one JSON line to a peer's server; its JSON reply, or GONE / NO_ANSWER /
    NO_SERVER."""
    addresses, port = address[0], address[1]
    if not port:
        return NO_SERVER
    refused = 0
    for addr in addresses:
        try:
            with socket.create_connection((addr, port), timeout=timeout) as conn:
                conn.settimeout(timeout)
                conn.sendall(json.dumps(message).encode() + b"\n")
                if not want_reply:
                    return None
                reply = conn.makefile("rb").readline(MAX_LINE)
                return json.loads(reply) if reply else NO_ANSWER
        except ConnectionRefusedError:
            refused += 1
        except (OSError, ValueError):
            continue
    return GONE if refused else NO_ANSWER


class Look:
    """One inspection's questions to the peers: each peer is asked once however many checks
    want its status (a silent peer, whose port takes the connection and never replies,
    costs the look its wait once), and no question waits past ``until``
    (``time.monotonic``) by more than :data:`SHORTEST_ASK`.

    Args:
        query: asks ranks with a timeout (``Watchdog.query``).
        until: when the look must be over (a warning or the timeout is due).
        longest: the most seconds one question waits.
        known: statuses the look has already.
    """

    def __init__(self, query: Callable[[Sequence[int], float], dict[int, Any]], until: float,
                 longest: float, known: Mapping[int, Any] | None = None) -> None:
        self._query = query
        self.until = until
        self.longest = longest
        self.replies: dict[int, Any] = dict(known or {})

    def ask(self, ranks: Sequence[int], again: bool = False) -> dict[int, Any]:
        """The statuses of ``ranks`` (or what came instead); ``again``: the ranks that
        answered before are asked anew."""
        wanted = [r for r in ranks if r not in self.replies
                  or (again and isinstance(self.replies[r], dict))]
        if wanted:
            left = self.until - time.monotonic()
            self.replies.update(self._query(wanted, min(self.longest, max(SHORTEST_ASK, left))))
        return {r: self.replies[r] for r in ranks if r in self.replies}


__all__ = ["GONE", "MAX_LINE", "NO_ANSWER", "NO_SERVER", "SHORTEST_ASK", "WHY_SILENT", "Address",
           "Look", "cut_off_timeout", "diagnostics_address", "diagnostics_ports",
           "host_addresses", "listen", "process_gone", "send_to_peer"]
