"""Slow links: the relay's timing rules (pure), its switching of frames (socket pairs
standing in for taps, no root needed), and a job across a relayed 2-host cluster."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster import simcluster
from cluster.relay import LinkSchedule, Relay
from cluster.simcluster import SimCluster, SlowLinks

CHECKS = str(Path(__file__).resolve().parent / "slow_link_checks.py")

frames = st.lists(st.tuples(st.floats(0, 0.01), st.integers(0, 2), st.integers(0, 2),
                            st.integers(1, 65000)), max_size=60)


@given(frames=frames, rate=st.sampled_from([0.0, 1e6, 125e6]),
       delay=st.sampled_from([0.0, 0.001, 0.005]), backlog=st.sampled_from([0.001, 0.1]))
def test_schedule_never_early_in_order_and_within_the_rate(
        frames: list[tuple[float, int, int, int]], rate: float, delay: float,
        backlog: float) -> None:
    schedule = LinkSchedule(3, rate, delay, backlog)
    now = 0.0
    held: dict[str, list[tuple[float, float]]] = {}  # cable -> (start, end) of its frames
    last_due = [0.0] * 3
    for step, src, dst, nbytes in frames:
        now += step
        wire = nbytes / rate if rate else 0.0
        due = schedule.admit(now, src, dst, nbytes)
        if due is None:  # dropped only when the cables are booked more than backlog ahead
            assert rate and max(end for _, end in held.get(f"up{src}", []) +
                                held.get(f"down{dst}", [])) - now > backlog
            continue
        assert due >= now + wire + delay - 1e-12, "never before it could have crossed"
        assert due >= last_due[dst] - 1e-12, "frames to one host keep their order"
        last_due[dst] = due
        end = due - delay
        assert end - wire - now <= backlog + 1e-12, "no frame waits more than the backlog"
        for cable in (f"up{src}", f"down{dst}"):
            held.setdefault(cable, []).append((end - wire, end))
    for spans in held.values():  # a cable carries one frame at a time: at most `rate`
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - 1e-12


def test_schedule_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"LinkSchedule: ports=0 must be >= 1, rate=1.0 and "
                                         r"delay=-1.0 >= 0, backlog=0.1 > 0"):
        LinkSchedule(0, 1.0, -1.0)


def _mac(i: int) -> bytes:
    return bytes([2, 0, 0, 0, 0, i])


def _frame(src: int, dst: bytes, payload: bytes) -> bytes:
    return dst + _mac(src) + b"\x08\x00" + payload


def test_relay_learns_floods_delays_and_counts() -> None:
    """Three ports on packet socket pairs: a broadcast reaches the two others, a frame to
    a learnt address only its port, each after the delay, and the counts add up."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    hosts = [a for a, _ in pairs]
    for _, b in pairs:
        b.setblocking(False)
    relay = Relay([b.fileno() for _, b in pairs], LinkSchedule(3, 0.0, 0.02), 0.02)
    serving = threading.Thread(target=relay.serve)
    serving.start()
    try:
        for h in hosts:
            h.settimeout(10)
        hosts[0].send(_frame(0, b"\xff" * 6, b"hello"))  # broadcast: to ports 1 and 2
        assert hosts[1].recv(100) == hosts[2].recv(100) == _frame(0, b"\xff" * 6, b"hello")
        hosts[1].send(_frame(1, _mac(0), b"to zero"))  # node 0's address is learnt
        assert hosts[0].recv(100) == _frame(1, _mac(0), b"to zero")
        hosts[2].settimeout(0.3)
        with pytest.raises(TimeoutError):
            hosts[2].recv(100)  # not flooded to port 2
    finally:
        relay.running = False
        serving.join(10)
    assert relay.stats.frames == {"0->1": 1, "0->2": 1, "1->0": 1}
    assert relay.stats.bytes["1->0"] == len(_frame(1, _mac(0), b"to zero"))
    assert relay.stats.by_delay_ms == {"20": 3}
    assert relay.stats.least_hold_s["20"] >= 0.02, "never before the delay"
    assert relay.stats.dropped == relay.stats.lost == 0
    for a, b in pairs:
        a.close()
        b.close()


def test_jobs_run_over_slow_links_every_byte_through_the_relay_delay_switchable(
        cluster_ready: None) -> None:
    with SimCluster(hosts=2, links=SlowLinks(delay_ms=2, rate_mbit=0)) as slow:
        relay_pid = slow.relay.pid if slow.relay else 0
        run = slow.run([1, 1], ["-m", "mpi4py", CHECKS, "big_all_reduce", "16"], timeout=120)
        assert run.returncode == 0, run.tail()
        assert all("big_all_reduce OK" in text for text in run.ranks), run.tail()
        received, sent = slow.link_bytes(1)
        slow.set_delay(False)
        quick = slow.run([1, 1], ["-m", "mpi4py", CHECKS, "big_all_reduce", "1"], timeout=120)
        assert quick.returncode == 0, quick.tail()
        stats = slow.relay_stats()
        namespaces = [*slow.namespaces, slow.switch]
    for key in ("0->1", "1->0"):  # each host sends its 16 MiB to the other, via the relay
        assert stats["bytes"][key] >= 16 << 20, stats  # type: ignore[index]
    assert received >= 16 << 20 and sent >= 16 << 20, (received, sent)
    assert stats["least_hold_s"]["2"] >= 0.002, stats  # type: ignore[index]
    delays = stats["by_delay_ms"]  # the first job's frames got 2 ms, the second's none
    assert delays["2"] > (16 << 20) // 65000 and delays["0"] > 0, delays  # type: ignore[index]
    assert set(delays) == {"0", "2"}, delays  # type: ignore[arg-type]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not set(namespaces) & set(listed.split()), listed
    with pytest.raises(ProcessLookupError):
        os.kill(relay_pid, 0)


def test_a_relay_that_cannot_start_fails_the_build_and_leaves_nothing(
        cluster_ready: None) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)SimCluster: the relay did not start .*"
                                           r"LinkSchedule: ports=2 must be >= 1, rate=-125000"):
        SimCluster(hosts=2, prefix="axbadrelay", links=SlowLinks(rate_mbit=-1))
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns.startswith("axbadrelay") for ns in listed.split()), listed
    assert not any(p.name.startswith("axbadrelay") for p in simcluster.ETC_NETNS.glob("*"))


def test_relay_only_controls_and_bridge_only_cables_say_so(cluster: SimCluster) -> None:
    with pytest.raises(ValueError, match=r"SimCluster.set_delay: this cluster has no relay; "
                                         r"build it with links=SlowLinks"):
        cluster.set_delay(True)
    with pytest.raises(ValueError, match="SimCluster.relay_stats: this cluster has no relay"):
        cluster.relay_stats()
    unplugged = SimCluster.__new__(SimCluster)  # only set_link's check runs: nothing built
    unplugged.links = SlowLinks()
    with pytest.raises(ValueError, match="SimCluster.set_link: a cluster with slow links has "
                                         "no bridge ports to unplug"):
        unplugged.set_link(0, False)
