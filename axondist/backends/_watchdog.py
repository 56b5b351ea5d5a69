"""The watchdog of a multi-process job: stall warnings, departures, deadlocks, the deadline.

Each rank runs two daemon threads. A diagnostics server answers peers'
questions over TCP (what this rank's flight recorder says; "I am leaving")
whatever the rank's main thread is doing, since blocking MPI calls release
the GIL. A monitor looks at this rank's running calls every ``tick``: when a
peer the call needs has announced that it left, or when the peers it asks
show a wait cycle through this rank, it ends the job at once; otherwise it
warns after ``stall`` seconds (and every ``stall`` seconds after) naming the
missing ranks and what each was last doing, and ends the job at ``timeout``.
Requests carry a per-job token, so nothing outside the job can end it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .recorder import FlightRecorder, describe_call, describe_status, format_entries

log = logging.getLogger("axondist.watchdog")

_QUERY_TIMEOUT = 3.0
_GONE_FOR = 3.0  # seconds a peer's port must refuse before the peer counts as gone
_MAX_LINE = 1 << 20
GONE = "gone"
NO_ANSWER = "no answer"
_GONE_TEXT = "its diagnostics port refuses connections: its process ended"
_NO_ANSWER_TEXT = ("its diagnostics port did not reply: its host is cut off, or it is stuck in "
                   "code that holds the GIL")


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


def _request(address: tuple[list[str], int, str], message: dict[str, Any], host: str,
             timeout: float, want_reply: bool) -> Any:
    """Send one JSON line to a peer's server; its JSON reply, or GONE / NO_ANSWER."""
    addresses, port, peer_host = address
    order = (["127.0.0.1"] if peer_host == host else []) + [a for a in addresses
                                                            if a != "127.0.0.1"]
    refused = 0
    for addr in order or addresses:
        try:
            with socket.create_connection((addr, port), timeout=timeout) as conn:
                conn.settimeout(timeout)
                conn.sendall(json.dumps(message).encode() + b"\n")
                if not want_reply:
                    return None
                reply = conn.makefile("rb").readline(_MAX_LINE)
                return json.loads(reply) if reply else NO_ANSWER
        except ConnectionRefusedError:
            refused += 1
        except (OSError, ValueError):
            continue
    return GONE if refused else NO_ANSWER


_RUNNING: list[Watchdog] = []


def silence_all() -> None:
    """Stop this process's watchdogs without announcing a departure: the process is ending
    the job itself (an uncaught exception, an abort), and its peers must not be told it
    merely left."""
    for dog in _RUNNING:
        dog.stop()


class Watchdog:
    """The watchdog and diagnostics server of one rank (see the module docstring).

    Args:
        recorder: this rank's flight recorder.
        timeout: seconds a call may wait before the job ends.
        stall: seconds before the first stall warning.
        abort: ends the whole job after printing its message (never returns).
        token: the job's secret, identical on every rank.
    """

    def __init__(self, recorder: FlightRecorder, *, timeout: float, stall: float,
                 abort: Callable[[str], None], token: str) -> None:
        self.recorder = recorder
        self.timeout = timeout
        self.stall = stall
        self._abort = abort
        self._token = token
        self._tick = max(0.05, min(0.5, stall / 4))
        self._probe_after = min(2.0, stall)
        self.peers: dict[int, tuple[list[str], int, str]] = {}
        self.left: dict[int, dict[str, Any]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._state: dict[tuple[Any, ...], float] = {}  # call -> when it is next looked at
        self._gone_since: dict[int, float] = {}
        #: peer rank -> when (time.monotonic) it last asked for this rank's status.
        self.asked: dict[int, float] = {}
        self._server = socket.create_server(("", 0), backlog=64)
        recorder.query_peers = self.query
        self.port = self._server.getsockname()[1]

    @property
    def address(self) -> tuple[list[str], int, str]:
        """What peers need to reach this rank: (addresses, port, host name)."""
        return host_addresses(), self.port, self.recorder.host

    def start(self, peers: Sequence[tuple[list[str], int, str]]) -> None:
        """Begin serving and watching; ``peers[r]`` is rank r's :attr:`address`."""
        self.peers = {r: tuple(p) for r, p in enumerate(peers)  # type: ignore[misc]
                      if r != self.recorder.rank}
        for target, name in ((self._serve, "server"), (self._monitor, "monitor")):
            threading.Thread(target=target, name=f"axondist-watchdog-{name}", daemon=True).start()
        atexit.register(self.announce_left)
        _RUNNING.append(self)

    def stop(self) -> None:
        """Stop watching (the server keeps answering until the process ends)."""
        self._stopped = True
        self._wake.set()

    def close(self) -> None:
        """Stop watching and serving, and forget this watchdog: for a world that ends while
        its process goes on (in-process worlds), so no thread or socket outlives it. Its
        peers then see it as gone."""
        self.stop()
        atexit.unregister(self.announce_left)
        if self in _RUNNING:
            _RUNNING.remove(self)
        self._server.close()  # the server thread's accept() fails, and it returns

    # --- the server -----------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            try:
                with conn:
                    conn.settimeout(_QUERY_TIMEOUT)
                    line = conn.makefile("rb").readline(_MAX_LINE)
                    request = json.loads(line) if line else {}
                    if request.get("token") != self._token:
                        continue
                    reply = self._handle(request)
                    if reply is not None:
                        conn.sendall(json.dumps(reply).encode() + b"\n")
            except (OSError, ValueError):
                continue

    def _handle(self, request: dict[str, Any]) -> dict[str, Any] | None:
        kind = request.get("kind")
        if kind == "status":
            self.asked[int(request.get("rank", -1))] = time.monotonic()
            return self.recorder.status()
        if kind == "left":
            self.left[int(request["rank"])] = request
            self._wake.set()
        return None

    def announce_left(self) -> None:
        """Tell every peer this rank is leaving and which calls it completed (at exit)."""
        if self._stopped:
            return
        self._stopped = True
        message = {"kind": "left", "token": self._token, "rank": self.recorder.rank,
                   "host": self.recorder.host, "pid": self.recorder.pid,
                   "completed": dict(self.recorder.completed),
                   "last": self.recorder.last_completed()}
        for address in self.peers.values():
            _request(address, message, self.recorder.host, 0.5, want_reply=False)

    # --- asking peers -----------------------------------------------------------------------
    def query(self, ranks: Sequence[int]) -> dict[int, Any]:
        """Each rank's recorder status, or GONE (its port refuses: the process ended) or
        NO_ANSWER (it did not reply in time: stuck in code that holds the GIL, or stopped)."""
        message = {"kind": "status", "token": self._token, "rank": self.recorder.rank}
        targets = [r for r in ranks if r in self.peers]
        if not targets:
            return {}
        with concurrent.futures.ThreadPoolExecutor(min(16, len(targets))) as pool:
            replies = pool.map(lambda r: _request(self.peers[r], message, self.recorder.host,
                                                  _QUERY_TIMEOUT, True), targets)
            return dict(zip(targets, replies))

    def wait_asked(self, ranks: Sequence[int], since: float, timeout: float) -> None:
        """Return once each of ``ranks`` asked for this rank's status after ``since``
        (``time.monotonic``), or after ``timeout`` seconds: a rank reporting a mismatch
        stays to answer its peers' questions about the same call before it leaves."""
        give_up = time.monotonic() + timeout
        while not all(self.asked.get(r, -math.inf) >= since for r in ranks):
            if time.monotonic() >= give_up:
                return
            time.sleep(0.01)

    # --- the monitor --------------------------------------------------------------------------
    def _monitor(self) -> None:
        parent = os.getppid()
        while not self._stopped:
            self._wake.wait(self._tick)
            self._wake.clear()
            if self._stopped:
                return
            if os.getppid() != parent:
                self._orphaned(parent)
                return
            try:
                self._inspect()
            except Exception:  # noqa: BLE001 - the watchdog must never die of a bad reply
                log.debug("watchdog inspection failed", exc_info=True)

    def _orphaned(self, parent: int) -> None:
        """The launcher that started this rank (mpiexec's proxy, pid ``parent``) is gone: the
        job cannot finish and nothing else would end this rank. MPI_Abort needs that
        launcher, so the rank prints and exits by itself."""
        rank, size = self.recorder.rank, self.recorder.world_size
        self._stopped = True
        print_and_flush(f"[axondist rank {rank}/{size}] ",
                        f"rank {rank} of {size} on host {self.recorder.host}: its launcher "
                        f"(pid {parent}, mpiexec's process manager on this host) has died, so "
                        "the job cannot finish; this rank exits\n"
                        f"last calls of rank {rank} (flight recorder, oldest first):\n"
                        + format_entries(self.recorder.entries(8)))
        os._exit(1)

    def _needs(self, call: dict[str, Any]) -> list[int]:
        """World ranks a running call waits for."""
        if "peer" in call:
            return [call["peer"]]
        members = self.recorder.groups.get(call["group"], ())
        return [r for r in members if r != self.recorder.rank]

    def _inspect(self) -> None:
        running = self.recorder.running()
        if not running:
            self._state.clear()
            return
        call = max(running, key=lambda e: e["started_s_ago"])
        waited = call["started_s_ago"]
        needs = self._needs(call)
        departed = self._departed(call, needs)
        if departed:
            self._end(call, waited, departed, None)
            return
        key = (call["group"], call["seq"], call["op"])
        due = self._state.get(key)
        if due is None:
            self._state = {key: self._probe_after}
            due = self._probe_after
        if waited < due and waited < self.timeout:
            return
        statuses = self.query(needs)
        verdict = self._verdict(call, statuses)
        if verdict is not None or waited >= self.timeout:
            self._end(call, waited, verdict, statuses)
            return
        if any(r in self._gone_since for r in statuses):
            self._state[key] = waited + 1.0  # look again soon: is it really gone?
            return
        if waited >= self.stall:
            rank, size = self.recorder.rank, self.recorder.world_size
            warn(self._stall_text(call, waited, statuses), f"[axondist rank {rank}/{size}] ")
            self._state[key] = waited + self.stall
        else:
            self._state[key] = self.stall

    def _departed(self, call: dict[str, Any], needs: Sequence[int]) -> str | None:
        """Text naming the needed ranks that announced they left before this call."""
        gone = []
        for r in needs:
            note = self.left.get(r)
            if note is None:
                continue
            done = int(note.get("completed", {}).get(call["group"], 0))
            if "peer" in call or done < call["seq"]:
                last = note.get("last")
                after = f" after {describe_call(last)}" if last else " before any call"
                gone.append(f"rank {r} (host {note.get('host')}, pid {note.get('pid')}) "
                            f"left{after}: its process exited (its script ended, called "
                            "sys.exit, or failed) and will never join")
        return "; ".join(gone) or None

    def _verdict(self, call: dict[str, Any], statuses: dict[int, Any]) -> str | None:
        """Text of a certain failure the peers' statuses show (a departure or a wait cycle)."""
        now = time.monotonic()
        for r, status in statuses.items():
            if status == GONE:
                self._gone_since.setdefault(r, now)
            else:
                self._gone_since.pop(r, None)
        # Gone for a while, not just now: a job being torn down (another rank's abort)
        # must not be blamed on the ranks mpiexec killed first.
        gone = [r for r, t in self._gone_since.items()
                if r in statuses and now - t >= _GONE_FOR]
        if gone:
            return (f"ranks {gone} are gone: their diagnostics port refuses connections, so "
                    "their processes ended (killed, or exited)")
        differ = self._different_calls(call, statuses)
        if differ:
            return differ
        cycle = []
        for r, status in statuses.items():
            if not isinstance(status, dict) or self._present(call, status):
                continue
            waiting_on_me = [e for e in status.get("running", []) if self._waits_on_me(e)]
            if not waiting_on_me:
                return None  # a missing rank that may still come: no certain deadlock
            cycle.append(f"rank {r} waits in {describe_call(waiting_on_me[0])}, which needs "
                         f"this rank")
        if cycle:
            return ("deadlock: " + "; ".join(cycle) + f"; while this rank waits in "
                    f"{describe_call(call)}, which needs them. Every rank must issue the same "
                    "collectives on the same groups in the same order, and each receive needs "
                    "a matching send")
        return None

    def _different_calls(self, call: dict[str, Any], statuses: dict[int, Any]) -> str | None:
        """Text naming the ranks whose call of the same number differs from this rank's
        (the check cannot see a blocking call meet a non-blocking one: MPI never
        matches them, so both wait), or None."""
        if "peer" in call:
            return None
        group, seq = call["group"], call["seq"]

        def issued(entries: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
            return next((e for e in entries if e["group"] == group and e["seq"] == seq
                         and not e["op"].startswith("wait ")), None)

        mine = issued(self.recorder.entries(32))
        if mine is None:
            return None
        calls = {self.recorder.rank: mine}
        for r, status in statuses.items():
            if isinstance(status, dict):
                theirs = issued(list(status.get("recent", [])) + list(status.get("running", [])))
                if theirs is not None:
                    calls[r] = theirs

        def what(e: dict[str, Any]) -> tuple[Any, ...]:
            return (e["op"], e.get("detail"), bool(e["blocking"]))

        if len({what(e) for e in calls.values()}) < 2:
            return None
        described = "; ".join(f"rank {r}: {e['op']} ({e.get('detail') or 'no arguments'}, "
                              f"{'blocking' if e['blocking'] else 'async_op=True'})"
                              for r, e in sorted(calls.items()))
        return (f"ranks called different collectives as call #{seq} on {group}: {described}. "
                "Every rank must make the same call with the same arguments, and pass the "
                "same async_op: MPI never matches a non-blocking collective with a blocking "
                "one")

    def _present(self, call: dict[str, Any], status: dict[str, Any]) -> bool:
        if "peer" in call:
            return False
        return int(status.get("issued", {}).get(call["group"], 0)) >= call["seq"]

    def _waits_on_me(self, entry: dict[str, Any]) -> bool:
        me = self.recorder.rank
        if "peer" in entry:
            return bool(entry["peer"] == me)
        members = self.recorder.groups.get(entry["group"])
        if members is None or me not in members:
            return False
        return self.recorder.issued.get(entry["group"], 0) < entry["seq"]

    def _stall_text(self, call: dict[str, Any], waited: float, statuses: dict[int, Any]) -> str:
        lines = [f"stall: rank {self.recorder.rank} has waited {waited:.1f} s in "
                 f"{describe_call(call)} (the job ends at AXONDIST_TIMEOUT={self.timeout:g} s)"]
        lines += self._peer_lines(call, statuses)
        return "\n".join(lines)

    def _peer_lines(self, call: dict[str, Any], statuses: dict[int, Any] | None) -> list[str]:
        if statuses is None:
            return []
        missing, lines = [], []
        for r in sorted(statuses):
            status = statuses[r]
            if isinstance(status, dict):
                if self._present(call, status):
                    continue
                missing.append(r)
                lines.append("  " + describe_status(status))
            else:
                missing.append(r)
                host = self.peers[r][2] if r in self.peers else "?"
                why = (_GONE_TEXT if status == GONE else _NO_ANSWER_TEXT)
                lines.append(f"  rank {r} (host {host}): {status} ({why})")
        if missing:
            return [f"  missing ranks: {missing}"] + lines
        # Every rank started the call, yet it does not finish: a non-blocking call's data
        # moves only while its ranks are inside MPI, so name those busy in their own code.
        busy = [r for r in sorted(statuses) if isinstance(statuses[r], dict)
                and not statuses[r].get("running")]
        if not busy:
            return ["  every rank has joined this call"]
        return ([f"  every rank has joined this call, but ranks {busy} are not in any axondist "
                 "call now (busy in their own code: a non-blocking call completes only once "
                 "every rank waits for it or makes other calls)"]
                + ["  " + describe_status(statuses[r]) for r in busy])

    def _end(self, call: dict[str, Any], waited: float, reason: str | None,
             statuses: dict[int, Any] | None) -> None:
        rank, size = self.recorder.rank, self.recorder.world_size
        if reason is None:
            head = (f"{describe_call(call)} timed out on rank {rank} of {size} after "
                    f"{waited:.1f} s (AXONDIST_TIMEOUT={self.timeout:g} s)")
        else:
            head = f"{describe_call(call)} on rank {rank} of {size} cannot complete: {reason}"
        lines = [head] + self._peer_lines(call, statuses)
        lines.append(f"last calls of rank {rank} (flight recorder, oldest first):")
        lines.append(format_entries(self.recorder.entries(8)))
        lines.append("ending the job on every rank")
        self._stopped = True
        self._abort("\n".join(lines))


def warn(text: str, prefix: str) -> None:
    """A stall warning: to the ``axondist.watchdog`` logger when the application set up a
    handler for it, else straight to stderr (a stall must never go unseen)."""
    logger = log
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            log.warning(text)
            return
        if not logger.propagate:
            break
        logger = logger.parent  # type: ignore[assignment]
    print_and_flush(prefix, text)


def print_and_flush(prefix: str, text: str) -> None:
    """Write ``text`` to stderr with ``prefix`` before every line."""
    sys.stderr.write("".join(prefix + line for line in (text + "\n").splitlines(True)))
    sys.stderr.flush()


def exit_soon(code: int, after: float) -> None:
    """End the process with ``code`` after ``after`` seconds unless it ended already."""
    timer = threading.Timer(after, os._exit, (code,))
    timer.daemon = True
    timer.start()


__all__ = ["GONE", "NO_ANSWER", "Watchdog", "exit_soon", "host_addresses", "print_and_flush",
           "silence_all", "warn"]
