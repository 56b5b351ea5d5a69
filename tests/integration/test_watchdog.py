"""The watchdog's logic and protocol without MPI: two ranks' watchdogs in one process,
talking over loopback."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from axondist.backends.recording.recorder import FlightRecorder
from axondist.backends.watchdog import watchdog as _watchdog
from axondist.backends.watchdog.watchdog import GONE, Watchdog


def _pair(timeout: float = 30.0, stall: float = 20.0) -> tuple[list[Watchdog], list[str]]:
    """Rank 0's and rank 1's watchdogs of a 2-rank job; their abort messages land in a list."""
    ended: list[str] = []
    dogs = []
    for rank in range(2):
        rec = FlightRecorder(rank, 2, f"host{rank}")
        rec.groups["world"] = (0, 1)
        dogs.append(Watchdog(rec, timeout=timeout, stall=stall, abort=ended.append, token="t"))
    addresses = [d.address for d in dogs]
    for d in dogs:
        d.start(addresses)
    return dogs, ended


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_peer_answers_with_its_flight_recorder():
    dogs, _ = _pair()
    try:
        rec1 = dogs[1].recorder
        rec1.end(rec1.begin("world", 1, "all_reduce", None))
        status = dogs[0].query([1])[1]
        assert status["rank"] == 1 and status["host"] == "host1"
        assert status["completed"] == {"world": 1} and status["running"] == []
    finally:
        for d in dogs:
            d.close()


def test_a_wrong_token_gets_no_answer_and_cannot_end_the_job():
    dogs, ended = _pair()
    try:
        dogs[0]._token = "other"
        assert dogs[0].query([1])[1] != GONE and not isinstance(dogs[0].query([1])[1], dict)
    finally:
        for d in dogs:
            d.close()
    assert ended == []


def test_a_rank_that_left_before_the_call_ends_the_job_at_once():
    dogs, ended = _pair()
    try:
        dogs[0].recorder.begin("world", 1, "all_reduce", None)  # rank 0 waits in call #1
        dogs[1].announce_left()                                 # rank 1 leaves after none
        _wait_for(lambda: ended)
        assert "all_reduce #1 on world on rank 0 of 2 cannot complete: rank 1 (host host1" in \
            ended[0] and "left before any call" in ended[0]
    finally:
        for d in dogs:
            d.close()


def test_departures_name_how_a_rank_left_once_it_said_so_and_nothing_before():
    """What a call whose peer's socket closed says (the torch backend asks): the departure in
    the watchdog's own words once the leaving rank's announcement is read, waiting for it at
    most the given seconds; nothing for a rank that left without a word (SIGKILL)."""
    dogs, _ = _pair()
    try:
        rec1 = dogs[1].recorder
        rec1.end(rec1.begin("world", 1, "barrier", None))
        started = time.monotonic()
        assert dogs[0].departures([1], within=0.3) is None  # no word from rank 1 yet
        assert time.monotonic() - started >= 0.3
        threading.Timer(0.2, dogs[1].announce_left, ("os._exit(1)",)).start()
        text = dogs[0].departures([1], within=10.0)  # the word arrives while it waits
        assert text is not None and re.fullmatch(
            r"rank 1 \(host host1, pid \d+\) left after barrier #1 on world: its process "
            r"exited \(it called os\._exit\(1\)\) and will never join", text), text
    finally:
        for d in dogs:
            d.close()


def test_a_rank_that_left_after_the_call_is_no_failure():
    dogs, ended = _pair()
    try:
        rec0, rec1 = dogs[0].recorder, dogs[1].recorder
        rec1.end(rec1.begin("world", 1, "all_reduce", None))   # rank 1 finished call #1
        rec0.begin("world", 1, "all_reduce", None)             # rank 0 still in it
        dogs[1].announce_left()
        _wait_for(lambda: 1 in dogs[0].left)
        time.sleep(0.6)  # a few monitor ticks
        assert ended == []
    finally:
        for d in dogs:
            d.close()


def test_a_wait_cycle_through_this_rank_is_a_deadlock():
    dogs, ended = _pair()
    try:
        dogs[0].recorder.groups["world.0"] = (0, 1)
        dogs[1].recorder.groups["world.0"] = (0, 1)
        dogs[0].recorder.begin("world.0", 1, "all_reduce", None)  # rank 0 on a sub-group
        dogs[1].recorder.begin("world", 1, "barrier", None)       # rank 1 on the world
        _wait_for(lambda: ended, 15)  # either side may see the cycle first
        assert ("deadlock: rank 1 waits in barrier #1 on world, which needs this rank" in ended[0]
                or "deadlock: rank 0 waits in all_reduce #1 on world.0, which needs this rank"
                in ended[0]), ended[0]
    finally:
        for d in dogs:
            d.close()


@pytest.mark.parametrize("stall", [0.5])
def test_a_stalled_call_warns_then_times_out_naming_the_missing_rank(stall, capsys, caplog):
    dogs, ended = _pair(timeout=2.0, stall=stall)
    try:
        dogs[0].recorder.begin("world", 1, "all_reduce", None)  # rank 1 never comes
        _wait_for(lambda: ended, 15)
        assert "timed out on rank 0 of 2" in ended[0]
        assert "missing ranks: [1]" in ended[0]
        assert "rank 1 (host host1" in ended[0] and "not in any axondist call" in ended[0]
        # to stderr, or to the logging handler pytest installs
        assert "stall: rank 0 has waited" in capsys.readouterr().err + caplog.text
    finally:
        for d in dogs:
            d.close()


def test_a_closed_watchdog_leaves_no_thread_or_port_and_peers_see_it_gone():
    dogs, ended = _pair()
    try:
        before = {t.ident for t in threading.enumerate() if t.name.startswith("axondist-watchdog")}
        dogs[1].close()
        assert dogs[1] not in _watchdog._RUNNING
        _wait_for(lambda: dogs[0].query([1])[1] == GONE)
        _wait_for(lambda: len({t.ident for t in threading.enumerate()
                               if t.name.startswith("axondist-watchdog")}) == len(before) - 2)
        dogs[1].close()  # idempotent
    finally:
        for d in dogs:
            d.close()
    assert ended == []


def test_a_joined_call_that_does_not_finish_names_the_ranks_busy_in_their_own_code():
    dogs, _ = _pair()
    try:
        rec0, rec1 = dogs[0].recorder, dogs[1].recorder
        for rec in (rec0, rec1):  # both issued non-blocking call #1
            rec.end(rec.begin("world", 1, "all_reduce", None, False))
        rec0.begin("world", 1, "wait all_reduce", None)  # rank 0 waits; rank 1 computes
        call = rec0.running()[0]
        lines = dogs[0]._peer_lines(call, dogs[0].query([1]))
        assert "every rank has joined this call, but ranks [1] are not in any axondist" in lines[0]
        assert "rank 1 (host host1" in lines[1] and "busy in its own code" in lines[1]
        rec1.begin("world", 2, "barrier", None)  # now rank 1 waits in a call too
        lines = dogs[0]._peer_lines(call, dogs[0].query([1]))
        assert lines == ["  every rank has joined this call"]
    finally:
        for d in dogs:
            d.close()


def _ring(n: int, hosts: list[str] | None = None, **settings: str) -> tuple[list[Watchdog],
                                                                           list[str]]:
    """n ranks' watchdogs (rank r on ``hosts[r]``); their abort messages land in a list."""
    ended: list[str] = []
    dogs = []
    for rank in range(n):
        rec = FlightRecorder(rank, n, (hosts or [f"host{r}" for r in range(n)])[rank])
        rec.groups["world"] = tuple(range(n))
        rec.groups["world:p2p"] = tuple(range(n))
        dogs.append(Watchdog(rec, timeout=30.0, stall=20.0, abort=ended.append, token="t",
                             environ={"AXONDIST_DIAGNOSTICS": "127.0.0.1", **settings}))
    addresses = [d.address for d in dogs]
    for d in dogs:
        d.start(addresses)
    return dogs, ended


def test_a_receive_cycle_through_three_ranks_is_a_deadlock_at_once():
    dogs, ended = _ring(3)
    try:
        for r, d in enumerate(dogs):  # 0 <- 1 <- 2 <- 0
            d.recorder.begin("world:p2p", 1, "recv", (("peer", (r + 1) % 3), ("tag", 0)))
        _wait_for(lambda: ended, 15)
        assert "cannot complete: deadlock: rank" in ended[0], ended[0]
        ring = re.search(r"\(wait cycle ((rank \d -> )+rank \d)\)", ended[0])
        assert ring and sorted(set(ring[1].split(" -> "))) == ["rank 0", "rank 1", "rank 2"]
    finally:
        for d in dogs:
            d.close()


def test_a_send_meeting_its_receive_is_no_cycle():
    dogs, ended = _ring(2)
    try:  # a big message still moving: both calls run, and they match
        dogs[0].recorder.begin("world:p2p", 1, "send", (("peer", 1), ("tag", 0)))
        dogs[1].recorder.begin("world:p2p", 1, "recv", (("peer", 0), ("tag", 0)))
        assert dogs[0]._wait_cycle(dogs[0].query([1])) is None
        assert dogs[1]._wait_cycle(dogs[1].query([0])) is None
    finally:
        for d in dogs:
            d.close()
    assert ended == []


def test_a_refused_port_is_no_proof_that_a_peer_ended():
    dogs, ended = _ring(2, ["same", "same"])
    try:
        dogs[1].close()  # its port refuses, but its process (this one) still runs
        _wait_for(lambda: dogs[0].query([1])[1] == GONE)
        dogs[0]._gone(dogs[0].query([1]))
        _watchdog_gone_for(dogs[0], 1)
        assert dogs[0]._gone(dogs[0].query([1])) is None
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        dogs[0].peers[1] = (*dogs[0].peers[1][:3], dead.pid)  # now no process has its pid
        dogs[0]._gone(dogs[0].query([1]))
        _watchdog_gone_for(dogs[0], 1)
        text = dogs[0]._gone(dogs[0].query([1]))
        assert text and f"ranks [1] are gone: no process has their pid on this host same " \
            f"any more (rank 1: pid {dead.pid})" in text
    finally:
        for d in dogs:
            d.close()
    assert ended == []


def _watchdog_gone_for(dog: Watchdog, rank: int) -> None:
    """Pretend ``rank`` was first seen refusing long ago."""
    for r in list(dog._gone_since):
        dog._gone_since[r] -= 10.0


def test_a_host_that_stops_answering_is_cut_off_after_the_setting(monkeypatch):
    monkeypatch.setattr(_watchdog, "_QUERY_TIMEOUT", 0.5)  # a silent peer costs 0.5 s a look
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never replies
    try:
        dogs, ended = _ring(3, ["a", "b", "b"], AXONDIST_CUT_OFF_TIMEOUT="1.5")
        try:
            _wait_for(lambda: "b" in dogs[0]._answered_hosts)  # the first look is over
            dogs[2].close()
            for r in (1, 2):
                dogs[0].peers[r] = (["127.0.0.1"], silent.getsockname()[1], "b", os.getpid())
            dogs[0].recorder.begin("world", 1, "all_reduce", None)
            _wait_for(lambda: ended, 30)
            assert re.search(r"all_reduce #1 on world on rank 0 of 3 cannot complete: host b "
                             r"\(ranks \[1, 2\]\) is cut off: none of its ranks has answered "
                             r"this rank \(host a\) for \d+\.\d s, counted from their last sign "
                             r"of life \(AXONDIST_CUT_OFF_TIMEOUT=1.5 s\)", ended[0]), ended[0]
            assert "its last sign of life was" in ended[0]
        finally:
            for d in dogs:
                d.close()
    finally:
        silent.close()


def test_the_server_binds_where_the_ranks_reach_each_other():
    one_host = {"MPI_LOCALNRANKS": "2", "PMI_SIZE": "2"}
    assert _watchdog.diagnostics_address(one_host) == "127.0.0.1"
    assert _watchdog.diagnostics_address({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}) \
        == "127.0.0.1"
    assert _watchdog.diagnostics_address({"MPI_LOCALNRANKS": "2", "PMI_SIZE": "4"}) \
        == _watchdog.host_addresses()[0]
    assert _watchdog.diagnostics_address({**one_host, "AXONDIST_DIAGNOSTICS": "off"}) is None
    assert _watchdog.diagnostics_address({"AXONDIST_DIAGNOSTICS": "10.1.2.3"}) == "10.1.2.3"
    rec = FlightRecorder(0, 2, "h")
    dog = Watchdog(rec, timeout=5, stall=2, abort=print, token="t", environ=one_host)
    try:
        assert dog.address[0] == ["127.0.0.1"]
        assert dog._server is not None and dog._server.getsockname()[0] == "127.0.0.1"
    finally:
        dog.close()


def test_a_port_range_is_kept_and_checked():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    rec = FlightRecorder(0, 2, "h")
    dog = Watchdog(rec, timeout=5, stall=2, abort=print, token="t",
                   environ={"AXONDIST_DIAGNOSTICS": "127.0.0.1",
                            "AXONDIST_DIAGNOSTICS_PORTS": f"{port}-{port}"})
    try:
        assert dog.port == port
        with pytest.raises(ValueError, match="no free port in AXONDIST_DIAGNOSTICS_PORTS"):
            Watchdog(rec, timeout=5, stall=2, abort=print, token="t",
                     environ={"AXONDIST_DIAGNOSTICS": "127.0.0.1",
                              "AXONDIST_DIAGNOSTICS_PORTS": f"{port}-{port}"})
    finally:
        dog.close()
    for bad in ("x", "9-3", "0-5", "70000"):
        with pytest.raises(ValueError, match="must be a port range LO-HI"):
            _watchdog.diagnostics_ports({"AXONDIST_DIAGNOSTICS_PORTS": bad})
    with pytest.raises(ValueError, match="AXONDIST_CUT_OFF_TIMEOUT='0' must be a number"):
        _watchdog.cut_off_timeout({"AXONDIST_CUT_OFF_TIMEOUT": "0"})


def test_a_host_never_reached_is_left_to_the_timeout(monkeypatch):
    monkeypatch.setattr(_watchdog, "_QUERY_TIMEOUT", 0.5)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never replies
    try:
        dogs, ended = _ring(2, ["a", "b"], AXONDIST_CUT_OFF_TIMEOUT="0.5")
        try:
            _wait_for(lambda: "b" in dogs[0]._answered_hosts)  # the first look is over
            dogs[0].peers[1] = (["127.0.0.1"], silent.getsockname()[1], "b", os.getpid())
            dogs[0]._answered_hosts.clear()  # as if host b's address was wrong from the start
            dogs[0].recorder.begin("world", 1, "all_reduce", None)
            call = dogs[0].recorder.running()[0]
            statuses = dogs[0].query([1])
            assert statuses == {1: _watchdog.NO_ANSWER}
            time.sleep(0.6)
            assert dogs[0]._verdict(call, statuses) is None
            lines = "\n".join(dogs[0]._peer_lines(call, statuses))
            assert "no rank of host b has ever answered this rank" in lines, lines
        finally:
            for d in dogs:
                d.close()
    finally:
        silent.close()
    assert ended == []


def test_without_a_server_a_peer_is_left_to_the_timeout():
    dogs, ended = _ring(2, AXONDIST_DIAGNOSTICS="off")
    try:
        assert dogs[0].address[1] == 0 and dogs[0].query([1]) == {1: _watchdog.NO_SERVER}
        dogs[1].announce_left()  # nobody hears it
        dogs[0].recorder.begin("world", 1, "all_reduce", None)
        time.sleep(0.6)
        assert ended == [] and dogs[0]._verdict(dogs[0].recorder.running()[0],
                                                dogs[0].query([1])) is None
    finally:
        for d in dogs:
            d.close()


def test_os_exit_tells_the_peers_how_the_rank_left():
    code = textwrap.dedent("""
        import os, sys
        from axondist.backends.watchdog.watchdog import Watchdog
        from axondist.backends.recording.recorder import FlightRecorder
        rec = FlightRecorder(1, 2, "host1")
        dog = Watchdog(rec, timeout=30, stall=20, abort=print, token="t",
                       environ={"AXONDIST_DIAGNOSTICS": "127.0.0.1"})
        dog.start([(["127.0.0.1"], int(sys.argv[1]), "host0", 1), dog.address])
        os._exit(7)
    """)
    dogs, ended = _ring(1)
    try:
        dogs[0].recorder.world_size = 2
        dogs[0].recorder.groups["world"] = (0, 1)
        proc = subprocess.run([sys.executable, "-c", code, str(dogs[0].port)], timeout=60)
        assert proc.returncode == 7
        _wait_for(lambda: 1 in dogs[0].left)
        assert dogs[0].left[1]["how"] == "os._exit(7)"
        dogs[0].recorder.begin("world", 1, "all_reduce", None)
        _wait_for(lambda: ended)
        assert "rank 1 (host host1" in ended[0] and "(it called os._exit(7))" in ended[0]
    finally:
        for d in dogs:
            d.close()


def test_a_busy_rank_on_another_host_keeps_the_timeout():
    dogs, ended = _ring(2, ["a", "b"], AXONDIST_CUT_OFF_TIMEOUT="0.5")
    try:  # rank 1 computes (in no call); its server answers, so host b is not cut off
        dogs[0].recorder.begin("world", 1, "all_reduce", None)
        time.sleep(1.0)
        call = dogs[0].recorder.running()[0]
        statuses = dogs[0].query([1])
        assert isinstance(statuses[1], dict) and dogs[0]._verdict(call, statuses) is None
        assert ended == []
    finally:
        for d in dogs:
            d.close()


def test_a_call_that_completes_while_a_silent_peer_is_asked_ends_nothing(capsys):
    """The look that would end the job (the timeout passes while rank 1 is asked) finds the
    call completed by then: no end, no warning."""
    dogs, ended = _pair(timeout=1.0, stall=0.5)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never replies
    kept: list[socket.socket] = []
    try:
        rec = dogs[0].recorder
        dogs[0].peers[1] = (["127.0.0.1"], silent.getsockname()[1], "host1", os.getpid())
        slot = rec.begin("world", 1, "all_reduce", None)

        def complete_once_asked() -> None:
            kept.append(silent.accept()[0])
            time.sleep(0.3)  # the look waits on; the call completes meanwhile
            rec.end(slot)

        threading.Thread(target=complete_once_asked, daemon=True).start()
        time.sleep(1.6)  # past the timeout and the look that would have ended the job
        assert ended == [], ended[0]
        assert "stall:" not in capsys.readouterr().err
    finally:
        for d in dogs:
            d.close()
        for conn in kept:
            conn.close()
        silent.close()


def test_a_receive_whose_peer_left_gets_a_moment_for_the_last_message():
    """A send returns before its message lands: the receiver's call may still complete
    after its peer announced its exit, so the job ends only if it is still waiting a
    moment later."""
    dogs, ended = _ring(2)
    try:
        dogs[0].recorder.begin("world:p2p", 1, "recv", (("peer", 1), ("tag", 0)))
        dogs[1].announce_left()
        _wait_for(lambda: 1 in dogs[0].left)
        time.sleep(0.5)
        assert ended == []
        _wait_for(lambda: ended, 10)
        assert "rank 1 (host host1" in ended[0] and "left" in ended[0], ended[0]
    finally:
        for d in dogs:
            d.close()


_WRITE_THEN_WAIT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from axondist.backends.watchdog.watchdog import wait_until_output_is_read
    sys.stderr.write("x" * 4096)
    sys.stderr.flush()
    wait_until_output_is_read(limit=float(sys.argv[2]))
    Path(sys.argv[1]).touch()
""")


def test_an_abort_waits_until_the_launcher_has_read_the_last_lines(tmp_path):
    """MPI_Abort follows a failing rank's last lines; it must come after mpiexec's proxy read
    them from the pipe, or the job ends without them. Nobody reads here until ``waited`` is
    looked at: it must not exist yet, then appear once the pipe is read."""
    waited = tmp_path / "waited"
    child = subprocess.Popen([sys.executable, "-c", _WRITE_THEN_WAIT, str(waited), "60"],
                             stderr=subprocess.PIPE)
    try:
        time.sleep(0.5)
        assert not waited.exists(), "it went on with 4096 bytes unread in its stderr pipe"
        assert child.stderr is not None
        assert child.stderr.read() == b"x" * 4096
        assert child.wait(timeout=60) == 0
        assert waited.exists()
    finally:
        child.kill()
        child.communicate()


def test_an_abort_whose_output_nobody_reads_goes_on_after_the_limit(tmp_path):
    """A launcher that stopped reading must not keep a failing rank from aborting."""
    waited = tmp_path / "waited"
    child = subprocess.Popen([sys.executable, "-c", _WRITE_THEN_WAIT, str(waited), "0.2"],
                             stderr=subprocess.PIPE)
    try:
        _wait_for(waited.exists, 60)
    finally:
        child.kill()
        child.communicate()
