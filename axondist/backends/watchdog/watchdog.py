"""The watchdog of a multi-process job: stall warnings, departures, deadlocks, the deadline.

Each rank runs two daemon threads. A diagnostics server answers peers' questions over TCP
(what this rank's flight recorder says; "I am leaving") whatever the rank's main thread is
doing, since blocking MPI calls release the GIL. A monitor looks at this rank's running calls:
when a peer the call needs has announced that it left, its process is gone from this host,
the peers show a wait cycle through this rank, or no rank of a peer's host has answered for
``AXONDIST_CUT_OFF_TIMEOUT`` seconds, it ends the job at once; otherwise it warns after
``stall`` seconds (and every ``stall`` seconds after) naming the missing ranks, and ends the
job at ``timeout``, each on time: a silent peer (stopped, or cut off) is asked once per look,
never past the moment the next warning or the timeout is due. Requests carry a per-job
token, so nothing outside the job can end it. Settings: docs/backends.md ("The watchdog").
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from ..recording.recorder import FlightRecorder, describe_call, describe_status
from .diagnostics import (
    GONE,
    MAX_LINE,
    NO_ANSWER,
    NO_SERVER,
    WHY_SILENT,
    Address,
    Look,
    cut_off_timeout,
    diagnostics_address,
    diagnostics_ports,
    host_addresses,
    listen,
    process_gone,
    send_to_peer,
)
from .launcher_report import report_lost
from .wait_graph import describe_cycle, different_calls, find_cycle, unknown_waited_for

log = logging.getLogger("axondist.watchdog")

_QUERY_TIMEOUT = 3.0  # the longest one look waits for a peer's reply
_LAST_LOOK = 0.5  # how long a look that is due now (a warning, the timeout) may still take
_GONE_FOR = 3.0  # seconds a peer's process must be seen gone before the job ends for it
_IN_FLIGHT = 1.0  # seconds a message a departed peer sent last may still take to land
_EXIT_PAUSE = 0.3  # os._exit waits this long after announcing, so waiting peers can say why
_ORPHAN_GRACE = 5.0  # an orphaned rank waits at most this long for the other hosts' ranks to end
_RUNNING: list[Watchdog] = []
_real_exit = os._exit


def silence_all() -> None:
    """Stop this process's watchdogs without announcing a departure: the process is ending
    the job itself (an uncaught exception, an abort), and its peers must not be told it
    merely left."""
    for dog in _RUNNING:
        dog.stop()


def _exit_announced(status: int) -> NoReturn:
    """``os._exit`` under a watchdog (atexit hooks never run for it): tell the peers and the
    launcher (torchrun may end the peers before they tell it) how this rank leaves; exit."""
    if any([dog.announce_left(f"os._exit({status})") for dog in list(_RUNNING)]):
        report_lost(_RUNNING[0].recorder.rank, _RUNNING[0].recorder.rank,
                    f"it called os._exit({status})")
        time.sleep(_EXIT_PAUSE)  # a launcher kills the job once a rank ends with an error
    _real_exit(status)


class Watchdog:
    """The watchdog and diagnostics server of one rank (see the module docstring).

    Args:
        recorder: this rank's flight recorder.
        timeout: seconds a call may wait before the job ends.
        stall: seconds before the first stall warning.
        abort: ends the whole job after printing its message (never returns).
        token: the job's secret, identical on every rank.
        environ: where the settings are read (``AXONDIST_DIAGNOSTICS``,
            ``AXONDIST_DIAGNOSTICS_PORTS``, ``AXONDIST_CUT_OFF_TIMEOUT``); ``os.environ``
            when None.
    """

    def __init__(self, recorder: FlightRecorder, *, timeout: float, stall: float,
                 abort: Callable[[str], None], token: str,
                 environ: Mapping[str, str] | None = None) -> None:
        self.recorder = recorder
        self.timeout = timeout
        self.stall = stall
        self.cut_off = cut_off_timeout(environ)
        self._abort = abort
        self._token = token
        self._tick = max(0.05, min(0.5, stall / 4))
        self._probe_after = min(2.0, stall)
        self.peers: dict[int, Address] = {}
        self.left: dict[int, dict[str, Any]] = {}
        #: peer rank -> its note that its launcher died.
        self.orphans: dict[int, dict[str, Any]] = {}
        self._wake = threading.Event()
        self._stopped = False
        #: The call watched, and when (time.monotonic) it is next looked at, warned of, woken for.
        self._watched: tuple[Any, ...] | None = None
        self._look_at = self._warn_at = 0.0
        self._wake_at = math.inf
        self._gone_since: dict[int, float] = {}
        #: (rank, how) of the peers a verdict found gone: told to the launcher at the end.
        self._lost: list[tuple[int, str]] = []
        #: peer rank -> when (time.monotonic) it last answered this rank.
        self._heard: dict[int, float] = {}
        self._started = time.monotonic()
        #: peer rank -> when (time.monotonic) it last asked for this rank's status.
        self.asked: dict[int, float] = {}
        bind = diagnostics_address(environ)
        self._server = None if bind is None else listen(bind, diagnostics_ports(environ))
        self._bound = [] if bind is None else [bind]
        #: hosts of which some rank has answered this rank: only their silence counts.
        self._answered_hosts: set[str] = set()
        recorder.query_peers = self.query
        self.port = 0 if self._server is None else self._server.getsockname()[1]

    @property
    def address(self) -> Address:
        """What peers need to reach this rank: (addresses, port, host name, pid); port 0
        when the server is off."""
        return list(self._bound), self.port, self.recorder.host, self.recorder.pid

    def start(self, peers: Sequence[Sequence[Any]]) -> None:
        """Begin serving and watching; ``peers[r]`` is rank r's :attr:`address`."""
        self.peers = {r: (list(p[0]), int(p[1]), str(p[2]), int(p[3]))
                      for r, p in enumerate(peers) if r != self.recorder.rank}
        self._started = time.monotonic()
        threads = [(self._monitor, "monitor")]
        if self._server is not None:
            threads.append((self._serve, "server"))
        for target, name in threads:
            threading.Thread(target=target, name=f"axondist-watchdog-{name}", daemon=True).start()
        atexit.register(self.announce_left)
        _RUNNING.append(self)
        os._exit = _exit_announced

    def stop(self) -> None:
        """Stop watching (the server keeps answering until the process ends)."""
        self._stopped = True
        self._wake.set()

    def close(self) -> None:
        """Stop watching and serving, and forget this watchdog (a world that ends while its
        process goes on): no thread or socket outlives it, and the peers' questions refuse."""
        self.stop()
        atexit.unregister(self.announce_left)
        if self in _RUNNING:
            _RUNNING.remove(self)
        if not _RUNNING:
            os._exit = _real_exit
        if self._server is not None:
            self._server.close()  # the server thread's accept() fails, and it returns

    # --- the server -----------------------------------------------------------------------
    def _serve(self) -> None:
        assert self._server is not None
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            try:
                with conn:
                    conn.settimeout(_QUERY_TIMEOUT)
                    line = conn.makefile("rb").readline(MAX_LINE)
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
        sender = int(request.get("rank", -1))
        self._heard[sender] = time.monotonic()
        if kind == "status":
            self.asked[sender] = time.monotonic()
            return self.recorder.status()
        if kind == "left":
            self.left[sender] = {**request, "heard": time.monotonic()}
            self._wake.set()
        if kind == "orphaned":
            self.orphans[sender] = request
            self._wake.set()
        return None

    def announce_left(self, how: str = "") -> bool:
        """Tell every peer this rank is leaving (``how``: ``os._exit(1)``...) and which
        calls it completed (at exit); False when it was silenced or told them already."""
        if self._stopped:
            return False
        self._stopped = True
        message = {"kind": "left", "token": self._token, "rank": self.recorder.rank,
                   "host": self.recorder.host, "pid": self.recorder.pid, "how": how,
                   "completed": dict(self.recorder.completed),
                   "last": self.recorder.last_completed()}
        for address in self.peers.values():
            send_to_peer(address, message, 0.5, want_reply=False)
        return True

    # --- asking peers -----------------------------------------------------------------------
    def query(self, ranks: Sequence[int], timeout: float | None = None) -> dict[int, Any]:
        """Each rank's recorder status, or what came instead: GONE (its port refuses),
        NO_ANSWER (no reply within ``timeout`` seconds, default 3) or NO_SERVER (it runs
        none)."""
        message = {"kind": "status", "token": self._token, "rank": self.recorder.rank}
        targets = [r for r in ranks if r in self.peers]
        if not targets:
            return {}
        wait = _QUERY_TIMEOUT if timeout is None else timeout
        with concurrent.futures.ThreadPoolExecutor(min(16, len(targets))) as pool:
            replies = dict(zip(targets, pool.map(
                lambda r: send_to_peer(self.peers[r], message, wait, True), targets)))
        now = time.monotonic()
        for r, reply in list(replies.items()):
            if isinstance(reply, dict) and reply.get("rank") != r:
                replies[r] = NO_ANSWER  # another process on that port: not the rank asked
            elif isinstance(reply, dict):
                self._heard[r] = now
                self._answered_hosts.add(self.peers[r][2])
        return replies

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
        first = {}  # one rank of each other host: is the side channel open to it?
        for r, p in sorted(self.peers.items(), reverse=True):
            if p[2] != self.recorder.host:
                first[p[2]] = r
        self.query(sorted(first.values()))
        while not self._stopped:
            self._wake.wait(min(self._tick, max(0.01, self._wake_at - time.monotonic())))
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
        launcher, so the rank tells its peers (whose launchers end the job, with a message,
        before their MPI library meets this rank's closed connections), waits briefly for
        the peers of other hosts to go, and exits by itself."""
        rank, size = self.recorder.rank, self.recorder.world_size
        self._stopped = True
        print_and_flush(f"[axondist rank {rank}/{size}] ",
                        f"rank {rank} of {size} on host {self.recorder.host}: its launcher "
                        f"(pid {parent}, mpiexec's process manager on this host) has died, so "
                        "the job cannot finish; this rank exits\n" + self.recorder.last_calls())
        message = {"kind": "orphaned", "token": self._token, "rank": rank,
                   "host": self.recorder.host, "pid": self.recorder.pid, "launcher": parent}
        for address in self.peers.values():
            send_to_peer(address, message, 0.5, want_reply=False)
        remote = [r for r, p in self.peers.items() if p[2] != self.recorder.host]
        give_up = time.monotonic() + _ORPHAN_GRACE
        while remote and time.monotonic() < give_up:
            answering = [r for r, s in self.query(remote).items() if isinstance(s, dict)]
            if not answering:
                break
            time.sleep(0.2)
        _real_exit(1)

    def _orphans_text(self) -> str | None:
        """Text naming the peers that reported their launcher dead, or None."""
        if not self.orphans:
            return None
        named = "; ".join(f"rank {r} (host {n.get('host')}, pid {n.get('pid')})"
                          for r, n in sorted(self.orphans.items()))
        hosts = sorted({str(n.get("host")) for n in self.orphans.values()})
        return (f"{named} lost the launcher that started them (mpiexec's process manager on "
                f"host {', '.join(hosts)} died, or was killed), so the job cannot finish")

    def _needs(self, call: dict[str, Any]) -> list[int]:
        """World ranks a running call waits for."""
        if "peer" in call:
            return [call["peer"]]
        members = self.recorder.groups.get(call["group"], ())
        return [r for r in members if r != self.recorder.rank]

    def _inspect(self) -> None:
        """Look at the longest-running call (see the module docstring): each time is read on
        one clock after the peers answered, and a call that completed meanwhile is let be."""
        running = self.recorder.running()
        orphans = self._orphans_text()
        if orphans is not None:
            self._lost = [(r, "its launcher died") for r in sorted(self.orphans)]
            self._end(max(running, key=lambda e: e["started_s_ago"]) if running else None,
                      0.0, orphans, None)
            return
        if not running:
            self._watched, self._wake_at = None, math.inf
            return
        call = max(running, key=lambda e: e["started_s_ago"])
        now = time.monotonic()
        started = now - call["started_s_ago"]
        key = (call["group"], call["seq"], call["op"])
        if key != self._watched:
            self._watched = key
            self._look_at = started + self._probe_after
            self._warn_at = started + self.stall
        needs = self._needs(call)
        departed = self._departed(call, needs)
        if departed:
            self._end(call, now - started, departed, None)
            return
        due = min(self._warn_at, started + self.timeout)  # when something must be said
        self._wake_at = min(self._look_at, due)
        if now < self._wake_at:
            return
        look = Look(self.query, max(due, now + _LAST_LOOK), _QUERY_TIMEOUT)
        statuses = look.ask(needs)
        verdict = self._verdict(call, statuses, look)
        if not any((e["group"], e["seq"], e["op"]) == key for e in self.recorder.running()):
            return  # it completed while the peers were asked: nothing to report
        now = time.monotonic()
        waited = now - started
        if verdict is not None or waited >= self.timeout:
            self._end(call, waited, verdict, statuses, now)
            return
        if now >= self._warn_at:
            rank, size = self.recorder.rank, self.recorder.world_size
            warn(self._stall_text(call, waited, statuses, now), f"[axondist rank {rank}/{size}] ")
            self._warn_at = now + self.stall
        silent = any(not isinstance(s, dict) and s != NO_SERVER for s in statuses.values())
        # a silent peer is looked at again soon (is it gone, or cut off?); else at the warning
        self._look_at = now + 1.0 if silent else self._warn_at
        self._wake_at = min(self._look_at, self._warn_at, started + self.timeout)

    def _departed(self, call: dict[str, Any], needs: Sequence[int]) -> str | None:
        """Text naming the needed ranks that announced they left before this call (a
        receive's peer ``_IN_FLIGHT`` seconds ago: a send returns before its message lands)."""
        gone = []
        for r in needs:
            note = self.left.get(r)
            grace = _IN_FLIGHT if "peer" in call else 0.0
            if note is None or time.monotonic() - note["heard"] < grace:
                continue
            done = int(note.get("completed", {}).get(call["group"], 0))
            if "peer" in call or done < call["seq"]:
                self._lost.append((r, _how_it_left(note)))
                gone.append(_departure(r, note))
        return "; ".join(gone) or None

    def departures(self, ranks: Sequence[int], within: float) -> str | None:
        """Text naming those of ``ranks`` (world ranks) that announced they left, as a stalled
        call's verdict names them, after waiting up to ``within`` seconds for the
        announcements: a peer's socket can close before its last words are read here."""
        deadline = time.monotonic() + within
        while not all(r in self.left for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.01)
        return "; ".join(_departure(r, self.left[r]) for r in ranks if r in self.left) or None

    def _verdict(self, call: dict[str, Any], statuses: dict[int, Any],
                 look: Look | None = None) -> str | None:
        """Text of a certain failure the peers' statuses show (a departure, a host cut off,
        different calls, a wait cycle), or None; ``look``: the inspection's questions."""
        look = look or self._new_look(statuses)
        return (self._gone(statuses) or self._cut_off_host(statuses, look)
                or self._different_calls(call, statuses) or self._wait_cycle(statuses, look))

    def _gone(self, statuses: dict[int, Any]) -> str | None:
        """Text naming the peers whose process is gone from this host (their port refuses
        and no process has their pid) for a while, not just now: a job being torn down
        (another rank's abort) must not be blamed on the ranks mpiexec killed first. A
        refused port alone (a firewall's doing, for all it shows) proves nothing."""
        now = time.monotonic()
        for r, status in statuses.items():
            _, _, host, pid = self.peers[r]
            if status == GONE and host == self.recorder.host and process_gone(pid):
                self._gone_since.setdefault(r, now)
            else:
                self._gone_since.pop(r, None)
        gone = sorted(r for r, t in self._gone_since.items()
                      if r in statuses and now - t >= _GONE_FOR)
        if not gone:
            return None
        self._lost = [(r, "its process is gone") for r in gone]
        pids = ", ".join(f"rank {r}: pid {self.peers[r][3]}" for r in gone)
        return (f"ranks {gone} are gone: no process has their pid on this host "
                f"{self.recorder.host} any more ({pids}): killed, or exited without a word "
                "(a signal, the OOM killer)")

    def _last_sign_of_life(self, rank: int, now: float | None = None) -> float:
        """When (time.monotonic) ``rank`` last answered this rank, asked it something, or
        completed a call with it; the start of watching when never. ``now``: when the
        recorder's ages are counted from (the current time when None)."""
        heard = max(self._heard.get(rank, self._started), self._started)
        now = time.monotonic() if now is None else now
        for entry in reversed(self.recorder.entries()):
            members = self.recorder.groups.get(entry["group"], ())
            if entry["state"] == "done" and (entry.get("peer") == rank or (
                    "peer" not in entry and rank in members)):
                return max(heard, now - entry["started_s_ago"] + entry["duration_s"])
        return heard

    def _new_look(self, statuses: dict[int, Any]) -> Look:
        """A look outside an inspection, that knows ``statuses`` already."""
        return Look(self.query, time.monotonic() + _QUERY_TIMEOUT, _QUERY_TIMEOUT, statuses)

    def _cut_off_host(self, statuses: dict[int, Any], look: Look | None = None) -> str | None:
        """Text naming a peer host none of whose ranks has answered for ``cut_off`` seconds
        since its last sign of life (a rank busy in its own code still answers: its server
        is a thread of its own), or None."""
        silent_hosts = {self.peers[r][2] for r, s in statuses.items()
                        if s in (GONE, NO_ANSWER) and self.peers[r][2] != self.recorder.host}
        for host in sorted(silent_hosts & self._answered_hosts):
            ranks = sorted(r for r, p in self.peers.items() if p[2] == host)
            if any(isinstance(statuses.get(r), dict) or statuses.get(r) == NO_SERVER
                   for r in ranks):
                continue
            now = time.monotonic()
            quiet = now - max(self._last_sign_of_life(r, now) for r in ranks)
            if quiet < self.cut_off:
                continue
            others = [r for r in ranks if r not in statuses]
            look = look or self._new_look(statuses)
            if others and any(isinstance(s, dict) or s == NO_SERVER
                              for s in look.ask(others).values()):
                continue
            return (f"host {host} (ranks {ranks}) is cut off: none of its ranks has answered "
                    f"this rank (host {self.recorder.host}) for {quiet:.1f} s, counted from "
                    f"their last sign of life (AXONDIST_CUT_OFF_TIMEOUT={self.cut_off:g} s): "
                    "its network link is down, or the host has stopped")
        return None

    def _wait_cycle(self, statuses: dict[int, Any], look: Look | None = None) -> str | None:
        """Text naming a cycle of waits through this rank, of any length, seen twice (the
        second look rules out ranks caught between calls), or None."""
        look = look or self._new_look(statuses)
        me = self.recorder.rank
        known = {r: s for r, s in statuses.items() if isinstance(s, dict)}
        known[me] = self.recorder.status()
        groups = self.recorder.groups
        for _ in range(self.recorder.world_size):
            wanted = sorted(r for r in unknown_waited_for(known, groups) if r in self.peers)
            found = {r: s for r, s in look.ask(wanted).items() if isinstance(s, dict)}
            if not found:
                break
            known.update(found)
        cycle = find_cycle(me, known, groups)
        if cycle is None:
            return None
        again = look.ask([rank for rank, _, _ in cycle if rank != me], again=True)
        again[me] = self.recorder.status()

        def still_in(rank: int, entry: dict[str, Any]) -> bool:
            status = again.get(rank)
            return isinstance(status, dict) and any(
                (e["group"], e["seq"], e["op"]) == (entry["group"], entry["seq"], entry["op"])
                for e in status.get("running", []))

        if not all(still_in(rank, entry) for rank, entry, _ in cycle):
            return None
        return describe_cycle(me, cycle)

    def _different_calls(self, call: dict[str, Any], statuses: dict[int, Any]) -> str | None:
        """Text naming the ranks whose call of the same number differs from this rank's,
        or None (see :func:`~.wait_graph.different_calls`)."""
        if "peer" in call:
            return None
        return different_calls(self.recorder.rank, call, self.recorder.entries(32), statuses)

    def _stall_text(self, call: dict[str, Any], waited: float, statuses: dict[int, Any],
                    now: float) -> str:
        lines = [f"stall: rank {self.recorder.rank} has waited {waited:.1f} s in "
                 f"{describe_call(call)} (the job ends at AXONDIST_TIMEOUT={self.timeout:g} s)"]
        lines += self._peer_lines(call, statuses, now)
        return "\n".join(lines)

    def _peer_lines(self, call: dict[str, Any], statuses: dict[int, Any] | None,
                    now: float | None = None) -> list[str]:
        """What each peer of ``statuses`` is doing, as lines; ages counted back from ``now``
        (``time.monotonic``; the current time when None)."""
        if statuses is None:
            return []
        now = time.monotonic() if now is None else now
        missing, lines = [], []
        for r in sorted(statuses):
            status = statuses[r]
            if isinstance(status, dict):
                if "peer" not in call and int(status.get("issued", {}).get(
                        call["group"], 0)) >= call["seq"]:  # it has joined the call
                    continue
                missing.append(r)
                lines.append("  " + describe_status(status))
            else:
                missing.append(r)
                host = self.peers[r][2] if r in self.peers else "?"
                quiet = now - self._last_sign_of_life(r, now)
                never = ("" if host in self._answered_hosts or status == NO_SERVER else
                         f"; no rank of host {host} has ever answered this rank: the address "
                         "its server listens on may not be reachable from here (set "
                         "AXONDIST_DIAGNOSTICS), so only the timeout ends this wait")
                lines.append(f"  rank {r} (host {host}): {status} ({WHY_SILENT[status]}); its last "
                             f"sign of life was {quiet:.1f} s ago{never}")
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

    def _end(self, call: dict[str, Any] | None, waited: float, reason: str | None,
             statuses: dict[int, Any] | None, now: float | None = None) -> None:
        rank, size = self.recorder.rank, self.recorder.world_size
        if call is None:
            head = f"rank {rank} of {size} ends the job: {reason}"
        elif reason is None:
            head = (f"{describe_call(call)} timed out on rank {rank} of {size} after "
                    f"{waited:.1f} s (AXONDIST_TIMEOUT={self.timeout:g} s)")
        else:
            head = f"{describe_call(call)} on rank {rank} of {size} cannot complete: {reason}"
        lines = [head] + (self._peer_lines(call, statuses, now) if call is not None else [])
        lines.append(self.recorder.last_calls())
        lines.append("ending the job on every rank")
        self._stopped = True
        for lost, how in self._lost:
            report_lost(rank, lost, how)
        self._abort("\n".join(lines))


def _how_it_left(note: dict[str, Any]) -> str:
    return (f"it called {note['how']}" if note.get("how")
            else "its script ended, called sys.exit, or failed")


def _departure(rank: int, note: dict[str, Any]) -> str:
    """``rank N (host H, pid P) left after CALL: ...`` from the rank's announcement."""
    last = note.get("last")
    after = f" after {describe_call(last)}" if last else " before any call"
    return (f"rank {rank} (host {note.get('host')}, pid {note.get('pid')}) left{after}: its "
            f"process exited ({_how_it_left(note)}) and will never join")


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
    """Write ``text`` to stderr with ``prefix`` before every line; nothing when stderr is
    gone (a launcher that died took the pipe with it: what follows must still run)."""
    try:
        sys.stderr.write("".join(prefix + line for line in (text + "\n").splitlines(True)))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def wait_until_output_is_read(limit: float = 2.0) -> None:
    """Wait, at most ``limit`` seconds, until the reader of this process's stdout and stderr
    pipes (mpiexec's proxy) has taken what was written to them. ``MPI_Abort`` right after a
    failing rank's last lines races the launcher's forwarding of them: under load hydra
    ended jobs whose traceback it never wrote. Terminals and files need no wait."""
    try:
        import fcntl
        import stat
        import termios
    except ImportError:  # not POSIX: nothing to ask
        return
    deadline = time.monotonic() + limit
    unread = bytearray(4)
    for fd in (1, 2):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            while time.monotonic() < deadline:
                fcntl.ioctl(fd, termios.FIONREAD, unread)
                if not any(unread):
                    break
                time.sleep(0.005)
        except OSError:
            continue


def exit_soon(code: int, after: float) -> None:
    """End the process with ``code`` after ``after`` seconds unless it ended already."""
    timer = threading.Timer(after, _real_exit, (code,))
    timer.daemon = True
    timer.start()


__all__ = ["GONE", "NO_ANSWER", "NO_SERVER", "Watchdog", "cut_off_timeout", "diagnostics_address",
           "diagnostics_ports", "exit_soon", "host_addresses", "print_and_flush", "silence_all",
           "wait_until_output_is_read", "warn"]
