"""A simulated cluster on one Linux machine: each host a network namespace with its own name.

``SimCluster(hosts=2)`` builds one switch namespace holding a bridge and, per host, a
namespace ``<prefix>h<i>`` whose ``eth0`` (a veth pair, the other end on the bridge) has
the address ``10.99.0.<i+1>``; the host is called ``node<i>`` (its own UTS namespace,
and an ``/etc/netns/<ns>/hosts`` file that ``ip netns exec`` mounts over ``/etc/hosts``,
so every host resolves every name, its own to its 10.x address). Nothing is added to the
machine's own network namespace. :meth:`SimCluster.mpiexec` runs hydra's ``mpiexec`` on
``node0`` with ``-launcher ssh -launcher-exec <script>``: the script, standing in for
ssh, starts the remote ``hydra_pmi_proxy`` inside the right host's namespaces. With
``links=SlowLinks(delay_ms=5, rate_mbit=1000)`` the hosts' cables are slow: each ``eth0``
is then a tap device of a relay process in the switch namespace (``relay.py``) that
delays and paces every frame, instead of a veth on the bridge.
:meth:`SimCluster.close` kills whatever still runs in the namespaces and removes
everything the cluster made; :func:`why_no_cluster` says why none can be made here.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from world.launched_job import Launch

REPO = Path(__file__).resolve().parents[2]
RELAY = Path(__file__).resolve().parent / "relay.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
SUBNET = "10.99.0"
ETC_NETNS = Path("/etc/netns")
_SERIAL = itertools.count()

# Waiting MPICH ranks yield their core: the simulated hosts share the machine's few cores.
GENTLE_POLLING = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
                  "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1"}
# UCX (and libfabric's shm provider) notice that the "hosts" share one machine and talk
# through shared memory; TCP only makes traffic between hosts cross their links. Ranks of
# one host still use MPICH's own shared memory.
OVER_THE_LINKS = {"UCX_TLS": "tcp,self", "FI_PROVIDER": "tcp"}

# Hydra calls the launcher as ``SCRIPT -x HOST "COMMAND ..."`` (ssh's arguments). The
# command is one string for a remote shell, so the script hands it to ``sh -c``.
_LAUNCHER = """#!/bin/sh
# ssh stand-in: run the command on a simulated host (a network + UTS namespace).
[ "$1" = "-x" ] && shift
host=$1
shift
case "$host" in
{cases}
  *) echo "no simulated host named $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $host && exec $*"
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def why_no_cluster() -> str | None:
    """Why a simulated cluster cannot be built here (None when it can)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "building network namespaces needs root (run the tests as root, as CI does)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing (install iproute2 / util-linux)"
    if not MPIEXEC.exists():
        return f"no mpiexec next to the Python interpreter ({MPIEXEC}); pip install '.[mpi]'"
    probe = f"axprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' was refused: {made.stderr.strip()}"
    try:
        uts = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"],
                             capture_output=True, text=True, timeout=30)
        if uts.returncode != 0:
            return f"'unshare --uts' was refused: {uts.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class SlowLinks:
    """Cables through the relay (``relay.py``): each carries ``rate_mbit`` Mbit/s each way
    (0: no limit) and delays every frame by ``delay_ms`` one way; ``mtu`` is the hosts'
    (large, so one Python process keeps up with a Gbit/s); a frame that would queue more
    than ``backlog_ms`` is dropped."""

    delay_ms: float = 0.0
    rate_mbit: float = 0.0
    mtu: int = 65000
    backlog_ms: float = 100.0
    start_delayed: bool = True


@dataclass
class SimCluster:
    """``hosts`` simulated hosts ``node0 ..`` on one bridge (see the module docstring).

    Use it as a context manager, or call :meth:`close`; it is built on construction.
    """

    hosts: int = 2
    prefix: str = field(default_factory=lambda: f"ax{os.getpid()}n{next(_SERIAL)}")
    links: SlowLinks | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 8:
            raise ValueError(f"SimCluster: hosts={self.hosts} must be 1..8")
        self.relay: subprocess.Popen[str] | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.switch = f"{self.prefix}sw"
        self.namespaces = [f"{self.prefix}h{i}" for i in range(self.hosts)]
        self.names = [f"node{i}" for i in range(self.hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(self.hosts)]
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # --- building and removing ----------------------------------------------------------
    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        taps = self._start_relay() if self.links is not None else []
        for i, ns in enumerate(self.namespaces):
            etc = ETC_NETNS / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            _ip("netns", "add", ns)
            if self.links is not None:  # the relay's tap becomes the host's eth0
                _ip("-n", self.switch, "link", "set", taps[i], "netns", ns)
                _ip("-n", ns, "link", "set", taps[i], "name", "eth0", "mtu",
                    str(self.links.mtu))
            else:
                _ip("-n", self.switch, "link", "add", f"h{i}", "type", "veth", "peer", "name",
                    "eth0", "netns", ns)
                _ip("-n", self.switch, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        cases = "".join(f"  {n}) ns={ns} ;;\n" for n, ns in zip(self.names, self.namespaces))
        self.launcher_script = self.workdir / "ssh-to-namespace.sh"
        self.launcher_script.write_text(_LAUNCHER.format(cases=cases.rstrip("\n")))
        self.launcher_script.chmod(0o755)

    def _start_relay(self) -> list[str]:
        """Start the relay in the switch namespace; the names of its taps, one per host."""
        links = self.links
        assert links is not None
        argv = ["ip", "netns", "exec", self.switch, sys.executable, str(RELAY),
                "--ports", str(self.hosts), "--prefix", "tap", "--rate-mbit",
                str(links.rate_mbit), "--delay-ms", str(links.delay_ms), "--backlog-ms",
                str(links.backlog_ms), "--stats", str(self.workdir / "relay-stats.json")]
        if not links.start_delayed:
            argv.append("--delay-off")
        self.relay = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
        assert self.relay.stdout is not None
        ready, _, _ = select.select([self.relay.stdout], [], [], 30)
        line = self.relay.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            try:  # the rest of what it printed, once it has ended; read through the same
                # text stream (communicate() reads the pipe beneath it and would miss what
                # readline already buffered)
                self.relay.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait()
            rest = self.relay.stdout.read()
            raise RuntimeError(f"SimCluster: the relay did not start (exit "
                               f"{self.relay.returncode}); it printed:\n{(line + rest)[-2000:]}")
        return line.split()[1:]

    def set_delay(self, on: bool) -> None:
        """Switch the relay's delay on (the ``delay_ms`` asked for) or off (no delay), and
        wait until the relay says it has."""
        if self.relay is None or self.relay.stdout is None:
            raise ValueError("SimCluster.set_delay: this cluster has no relay; build it with "
                             "links=SlowLinks(delay_ms=...)")
        self.relay.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)
        ready, _, _ = select.select([self.relay.stdout], [], [], 10)
        line = self.relay.stdout.readline() if ready else ""
        if not line.startswith("DELAY "):
            raise RuntimeError(f"SimCluster.set_delay: the relay did not answer (got {line!r})")

    def relay_stats(self) -> dict[str, object]:
        """Stop the relay and return what it forwarded: ``frames`` and ``bytes`` per
        ``"src->dst"`` host pair, ``dropped`` (queue full) and ``lost`` (refused by a
        tap), ``by_delay_ms`` and ``least_hold_s`` (frames, and the shortest time one
        spent in the relay, per delay given), ``cpu_s`` and ``wall_s``. The links are
        dead afterwards."""
        if self.relay is None:
            raise ValueError("SimCluster.relay_stats: this cluster has no relay")
        self.relay.terminate()
        self.relay.communicate(timeout=30)
        stats: dict[str, object] = json.loads((self.workdir / "relay-stats.json").read_text())
        return stats

    def pids(self, host: int | None = None) -> list[int]:
        """Every process still running on host ``host`` (None: on any host)."""
        found: list[int] = []
        for ns in self.namespaces if host is None else [self.namespaces[host]]:
            out = _ip("netns", "pids", ns, check=False).stdout
            found += [int(p) for p in out.split()]
        return found

    def kill_all(self) -> None:
        """SIGKILL every process in the cluster's namespaces, and wait until none is left."""
        deadline = time.monotonic() + 10
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def close(self) -> None:
        """Kill what runs on the hosts and remove the namespaces, links and files."""
        self.kill_all()
        if getattr(self, "relay", None) is not None:  # its taps go with it
            assert self.relay is not None
            self.relay.kill()
            self.relay.wait()
            if self.relay.stdout is not None:
                self.relay.stdout.close()
        for ns in [*getattr(self, "namespaces", []), getattr(self, "switch", "")]:
            if ns:
                _ip("netns", "del", ns, check=False)  # its veth ends go with it
                shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        shutil.rmtree(getattr(self, "workdir", ""), ignore_errors=True)

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- looking at and breaking links -------------------------------------------------
    def link_bytes(self, host: int) -> tuple[int, int]:
        """(bytes received, bytes sent) so far by host ``host``'s ``eth0``."""
        out = _ip("-n", self.namespaces[host], "-s", "-j", "link", "show", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def set_link(self, host: int, up: bool) -> None:
        """Unplug (or plug back) host ``host``'s cable: its port on the bridge goes down."""
        if self.links is not None:
            raise ValueError("SimCluster.set_link: a cluster with slow links has no bridge "
                             "ports to unplug; build it with links=None")
        _ip("-n", self.switch, "link", "set", f"h{host}", "up" if up else "down")

    def refuse_logins(self, host: int) -> None:
        """From now on, starting anything on host ``host`` fails as ssh does when a
        machine is down (exit status 255, "No route to host"). The message goes out a
        moment before the exit: hydra ends at the first of its pipes to close, and
        dropped the message when both closed at once."""
        name = self.names[host]
        script = self.launcher_script.read_text().replace(
            "case \"$host\" in\n",
            f"case \"$host\" in\n  {name}) echo \"ssh: connect to host {name} port 22: No route "
            f"to host\" >&2; sleep 0.5; exit 255 ;;\n", 1)
        self.launcher_script.write_text(script)

    def on_host(self, host: int, argv: list[str], **kwargs: object
                ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on host ``host`` (its network and host name) and wait for it."""
        cmd = ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "/bin/sh",
               "-c", f'hostname {self.names[host]} && exec "$@"', "sh", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore

    # --- running jobs -------------------------------------------------------------------
    def mpiexec_argv(self, slots: list[int], args: list[str], out: Path) -> list[str]:
        """The command that starts ``sum(slots)`` ranks, ``slots[i]`` on host i in turn,
        from node0; each rank's output goes to ``out/rank<r>.txt``."""
        hosts = ",".join(f"{self.names[i]}:{k}" for i, k in enumerate(slots) if k)
        pattern = str(out / "rank%r.txt")
        mpiexec = [str(MPIEXEC), "-launcher", "ssh", "-launcher-exec", str(self.launcher_script),
                   "-hosts", hosts, "-outfile-pattern", pattern, "-errfile-pattern", pattern,
                   "-n", str(sum(slots)), sys.executable, *args]
        return ["ip", "netns", "exec", self.namespaces[0], "unshare", "--uts", "/bin/sh", "-c",
                f'hostname {self.names[0]} && exec "$@"', "sh", *mpiexec]

    def start(self, slots: list[int], args: list[str], env: dict[str, str] | None = None,
              n: int | None = None) -> tuple[subprocess.Popen[str], Path]:
        """Start ``mpiexec`` (see :meth:`mpiexec_argv`); ``n`` ranks placed round-robin over
        the slots when given (``slots=[1, 1], n=4``: ranks 0, 2 on node0, 1, 3 on node1)."""
        out = Path(tempfile.mkdtemp(prefix="job-", dir=self.workdir))
        argv = self.mpiexec_argv(slots, args, out)
        if n is not None:
            argv[argv.index("-n") + 1] = str(n)
        full_env = {**GENTLE_POLLING, **OVER_THE_LINKS, **os.environ, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
                    **(env or {})}
        full_env.pop("AXONDIST_BACKEND", None)
        proc = subprocess.Popen(argv, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        return proc, out

    def finish(self, proc: subprocess.Popen[str], out: Path, ranks: int, timeout: float,
               started: float) -> Launch:
        """Wait for a job from :meth:`start`; past ``timeout`` kill it and everything on
        the hosts (the result then says ``timed_out``)."""
        try:
            launcher, _ = proc.communicate(timeout=max(0.1, timeout - (time.monotonic() - started)))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            self.kill_all()
            launcher, _ = proc.communicate()
            timed_out = True
        files = [out / f"rank{r}.txt" for r in range(ranks)]
        texts = [f.read_text(errors="replace") if f.exists() else "" for f in files]
        return Launch(proc.returncode, time.monotonic() - started, texts, launcher or "",
                      "mpiexec", timed_out)

    def run(self, slots: list[int], args: list[str], env: dict[str, str] | None = None,
            timeout: float = 120, n: int | None = None) -> Launch:
        """Run ``python ARGS`` on the cluster (see :meth:`start`) and wait for it."""
        started = time.monotonic()
        proc, out = self.start(slots, args, env, n)
        return self.finish(proc, out, sum(slots) if n is None else n, timeout, started)
