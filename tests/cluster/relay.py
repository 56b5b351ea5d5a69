"""Slow links for the simulated cluster: a userspace switch that delays and paces frames.

The kernel here has ``tbf`` (a rate limit) but no ``netem``, so it cannot delay packets.
This process stands in for the switch instead: it opens one tap device per host (the
host's ``eth0`` once :class:`~cluster.simcluster.SimCluster` moves it into the host's
namespace), learns which MAC address sits behind which tap, and forwards every frame
``delay`` seconds after the link has carried it at ``rate`` bytes per second. A frame
holds both its sender's cable and its receiver's cable for ``size / rate`` (cut-through:
one serialisation per hop), frames to one host leave in the order they came, and a frame
that would wait more than ``backlog`` seconds for its cables is dropped, as a switch's
full queue drops. The timing rules are :class:`LinkSchedule`, a pure class the tests
check without any network. Run as ``python relay.py --ports N ...``: it prints
``READY <tap names>`` once the taps exist, ``SIGUSR1`` switches the delay on and
``SIGUSR2`` off (the benchmark pairs runs with and without it; it answers ``DELAY <ms>``),
and on ``SIGTERM`` it writes what it forwarded to ``--stats`` as JSON.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass, field

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536 + 64
BROADCAST = b"\xff" * 6


@dataclass
class LinkSchedule:
    """When each frame reaches its receiver, given the cables' rate, delay and queue.

    Args:
        ports: number of hosts (cables).
        rate: bytes per second each cable carries in each direction (0: no limit).
        delay: seconds one way, added after the frame has crossed the cables.
        backlog: at most this many seconds may a frame wait for busy cables; later
            frames are dropped.
    """

    ports: int
    rate: float = 0.0
    delay: float = 0.0
    backlog: float = 0.1
    _up_free: list[float] = field(init=False)
    _down_free: list[float] = field(init=False)

    def __post_init__(self) -> None:
        if self.ports < 1 or self.rate < 0 or self.delay < 0 or self.backlog <= 0:
            raise ValueError(f"LinkSchedule: ports={self.ports} must be >= 1, rate={self.rate} "
                             f"and delay={self.delay} >= 0, backlog={self.backlog} > 0")
        self._up_free = [0.0] * self.ports
        self._down_free = [0.0] * self.ports

    def admit(self, now: float, src: int, dst: int, nbytes: int) -> float | None:
        """The time a frame of ``nbytes`` sent at ``now`` from ``src`` reaches ``dst``,
        or None when it is dropped (its cables are booked more than ``backlog`` ahead)."""
        start = max(now, self._up_free[src], self._down_free[dst])
        if start - now > self.backlog:
            return None
        end = start + (nbytes / self.rate if self.rate else 0.0)
        self._up_free[src] = self._down_free[dst] = end
        return end + self.delay


def open_tap(name: str) -> int:
    """A non-blocking file descriptor of a new tap device ``name`` (frames, no header).

    The device lives as long as the descriptor: it goes when this process ends."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


@dataclass
class Stats:
    """What the relay did: frames and bytes per (sender, receiver), frames dropped and
    lost, frames and least hold per delay given, and its own CPU time against the
    wall-clock time it served."""

    frames: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    dropped: int = 0  # a full queue: the cables were booked more than the backlog ahead
    lost: int = 0  # the receiving tap refused the frame (its eth0 down, not yet up)
    by_delay_ms: dict[str, int] = field(default_factory=dict)  # frames given each delay
    least_hold_s: dict[str, float] = field(default_factory=dict)  # by the delay given
    cpu_s: float = 0.0  # the relay's own CPU time: near wall_s, it was the bottleneck
    wall_s: float = 0.0

    def count(self, src: int, dst: int, nbytes: int) -> None:
        key = f"{src}->{dst}"
        self.frames[key] = self.frames.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + nbytes


class Relay:
    """Forward frames between tap file descriptors by :class:`LinkSchedule`'s timing."""

    def __init__(self, fds: list[int], schedule: LinkSchedule, delay: float) -> None:
        self.fds = fds
        self.schedule = schedule
        self.delay = delay  # what SIGUSR1 switches back on
        self.stats = Stats()
        self.running = True
        self._where: dict[bytes, int] = {}  # MAC address -> port, learnt from senders
        # per receiving port: (due time, arrival time, delay given, frame), due times in order
        self._queues: list[collections.deque[tuple[float, float, str, bytes]]] = [
            collections.deque() for _ in fds]

    def _receive(self, src: int, now: float) -> None:
        for _ in range(64):  # a bounded batch, so one busy host cannot starve the others
            try:
                frame = os.read(self.fds[src], MAX_FRAME)
            except BlockingIOError:
                return
            if len(frame) < 14:
                continue
            self._where[frame[6:12]] = src
            dst = self._where.get(frame[0:6]) if frame[0:6] != BROADCAST else None
            targets = [dst] if dst is not None else [p for p in range(len(self.fds)) if p != src]
            for port in targets:
                if port == src:
                    continue
                due = self.schedule.admit(now, src, port, len(frame))
                if due is None:
                    self.stats.dropped += 1
                    continue
                given = f"{self.schedule.delay * 1e3:g}"
                self._queues[port].append((due, now, given, frame))
                self.stats.count(src, port, len(frame))
                self.stats.by_delay_ms[given] = self.stats.by_delay_ms.get(given, 0) + 1

    def _deliver(self, now: float) -> float | None:
        """Write every frame that is due; the next due time, or None when all are out."""
        soonest = None
        for port, queue in enumerate(self._queues):
            while queue and queue[0][0] <= now:
                _, arrived, given, frame = queue.popleft()
                least = self.stats.least_hold_s
                least[given] = min(least.get(given, now - arrived), now - arrived)
                try:
                    os.write(self.fds[port], frame)
                except OSError:  # the host's eth0 is down or gone: the frame is lost
                    self.stats.lost += 1
            if queue and (soonest is None or queue[0][0] < soonest):
                soonest = queue[0][0]
        return soonest

    def serve(self) -> None:
        """Forward until :attr:`running` goes False (SIGTERM)."""
        poller = select.epoll()
        for fd in self.fds:
            poller.register(fd, select.EPOLLIN)
        ports = {fd: port for port, fd in enumerate(self.fds)}
        started, cpu = time.monotonic(), time.process_time()
        while self.running:
            soonest = self._deliver(time.monotonic())
            # bounded, so a SIGTERM (whose handler only clears `running`) ends the loop
            wait = 0.2 if soonest is None else max(0.0, min(0.2, soonest - time.monotonic()))
            for fd, _ in poller.poll(wait):
                self._receive(ports[fd], time.monotonic())
        self.stats.wall_s = time.monotonic() - started
        self.stats.cpu_s = time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", type=int, required=True, help="number of hosts")
    parser.add_argument("--prefix", default="rl", help="tap names: PREFIX0, PREFIX1, ...")
    parser.add_argument("--rate-mbit", type=float, default=0.0, help="per cable, 0: no limit")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one way")
    parser.add_argument("--backlog-ms", type=float, default=100.0)
    parser.add_argument("--delay-off", action="store_true", help="start with no delay")
    parser.add_argument("--stats", default="", help="write the counts here on SIGTERM")
    args = parser.parse_args()
    names = [f"{args.prefix}{i}" for i in range(args.ports)]
    fds = [open_tap(name) for name in names]
    delay = args.delay_ms / 1e3
    schedule = LinkSchedule(args.ports, args.rate_mbit * 1e6 / 8,
                            0.0 if args.delay_off else delay, args.backlog_ms / 1e3)
    relay = Relay(fds, schedule, delay)

    def stop(*_: object) -> None:
        relay.running = False

    def delay_on(*_: object) -> None:
        schedule.delay = relay.delay
        print(f"DELAY {schedule.delay * 1e3:g} ms", flush=True)  # the acknowledgement

    def delay_off(*_: object) -> None:
        schedule.delay = 0.0
        print("DELAY 0 ms", flush=True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, delay_on)
    signal.signal(signal.SIGUSR2, delay_off)
    print("READY " + " ".join(names), flush=True)
    relay.serve()
    if args.stats:
        with open(args.stats, "w") as f:
            json.dump(vars(relay.stats), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
