"""``axondist run``: launch a script on N processes through ``mpiexec`` or ``torchrun``, tag
each output line with its rank, say in one line which rank failed and how, and relaunch the
whole job after a failure (``--max-restarts``) so a script that resumes from its latest
checkpoint carries on. How each launcher is driven: ``axondist._launch_styles``. Design
notes: docs/launching.md."""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ._launch_styles import STYLES, LaunchStyle
from ._rank_entry import MARK as _MARK
from ._rank_entry import RESTART_COUNT_VAR, RUN_DIR_VAR
from .errors import LaunchError

_POLL_S = 0.05
_KILL_AFTER_S = 5.0  # after asking mpiexec to stop, how long before it is killed outright
_RUN_DIR_PREFIX = "axondist-run-"
_PR_SET_PDEATHSIG = 1
_PYTHON = re.compile(r"^python[0-9.]*$")


# --- what to launch ------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """One ``axondist run`` invocation, validated."""

    nprocs: int
    """Processes (ranks) in the job."""
    target: tuple[str, ...]
    """The script and its arguments, ``("-m", module, args...)``, ``("-c", code, args...)``,
    or (with ``no_python``) the program and its arguments."""
    nproc_per_node: int | None = None
    """Ranks per host (hydra's ``-ppn``); None lets mpiexec decide."""
    hosts: tuple[str, ...] = ()
    """Hosts to run on (``host`` or ``host:slots``); empty for this machine."""
    hostfile: str | None = None
    """A file listing the hosts, one a line (instead of ``hosts``)."""
    max_restarts: int = 0
    """Relaunches of the whole job after a failure."""
    mpiexec: str | None = None
    """The launcher to use; None finds one (see :func:`find_mpiexec`)."""
    tail_lines: int = 10
    """Lines of the failed rank's output quoted in the failure summary."""
    stop_grace: float = 5.0
    """Seconds the other ranks get to end on their own after one fails, before the job is
    stopped."""
    python: str | None = None
    """The interpreter the ranks run (None: the launcher's own, ``sys.executable``)."""
    no_python: bool = False
    """Run ``target`` as a program on every rank, without Python and without the per-rank
    reports (as torchrun's ``--no-python``)."""
    launcher: str = "mpiexec"
    """What starts the ranks: ``"mpiexec"`` (an MPI job, on one host or several) or
    ``"torchrun"`` (``torch.distributed.run --standalone``: this host only; the ranks get
    torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...)."""


@dataclass
class RankFailure:
    """Which rank failed first, and how."""

    rank: int | None
    exit_code: int | None = None
    signal_number: int | None = None
    reason: str = ""
    tail: list[str] = field(default_factory=list)
    before_traceback: bool = False
    """The tail stops where the rank's traceback began (the traceback was shown once, live)."""
    tail_of: str = ""
    """Who printed the tail when it is not the rank's (the launcher, say ``"torchrun"``)."""

    def describe(self) -> str:
        """"exit code 3" or "signal 9 (SIGKILL)", plus the reason when one is known."""
        if self.signal_number is not None:
            how = f"killed by signal {self.signal_number} ({_signal_name(self.signal_number)})"
        else:
            how = f"exit code {self.exit_code}"
        return f"{how}: {self.reason}" if self.reason else how

    @property
    def exit_status(self) -> int:
        """The status the launcher exits with (128 + N for signal N, as a shell reports it)."""
        if self.signal_number is not None:
            return 128 + self.signal_number
        return self.exit_code if self.exit_code else 1


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


# --- finding and driving mpiexec -------------------------------------------------------------


def find_mpiexec(explicit: str | None = None) -> str:
    """The ``mpiexec`` to launch with.

    Args:
        explicit: a path or command name given by the user; used as is when it resolves.

    Returns:
        ``explicit``, else the ``mpiexec`` next to ``sys.executable`` (the MPICH wheel
        installed by ``pip install '.[mpi]'``), else the first ``mpiexec`` on PATH.

    Raises:
        LaunchError: none of those exists; the message names the places looked at.
    """
    if explicit is not None:
        found = shutil.which(explicit)
        if found is None:
            raise LaunchError(f"axondist run: --mpiexec {explicit!r} is not an executable; give "
                              "the path of an mpiexec")
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("mpiexec")
    if on_path is not None:
        return on_path
    raise LaunchError(f"axondist run: no mpiexec next to the Python interpreter ({beside}) and "
                      "none on PATH; install the MPICH wheel with `pip install '.[mpi]'` "
                      "or a system MPI, or pass --mpiexec PATH; without MPI, "
                      "launch through torch with --launcher torchrun")


def mpiexec_flavour(mpiexec: str) -> str:
    """``"hydra"`` (MPICH, Intel MPI), ``"openmpi"`` or ``"unknown"``, from ``--version``."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "HYDRA" in text or "Intel(R) MPI" in text:
        return "hydra"
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi" in text.lower():
        return "openmpi"
    return "unknown"


_RANK_ENTRY = "from axondist._rank_entry import rank_main; rank_main()"


def build_command(cfg: RunConfig, program: str, flavour: str, outdir: str | None,
                  python: str | None = None) -> list[str]:
    """The command line of one launch (a pure function of its arguments).

    Args:
        cfg: what to launch.
        program: the launcher's executable: an mpiexec, or for ``"torchrun"`` the Python
            interpreter that runs ``torch.distributed.run``.
        flavour: the launch style, a key of ``STYLES``: :func:`mpiexec_flavour`'s answer or
            ``"torchrun"``. Under hydra and torchrun each rank's stdout and stderr go to files
            under ``outdir``, which the launcher tails and tags; Open MPI tags lines itself
            (``--tag-output``).
        outdir: the run folder (None: none).
        python: the interpreter the ranks run (overrides ``cfg.python``).

    Every rank runs the target through ``axondist._rank_entry``, which reports how it ended
    (with ``no_python``, the program itself runs).
    """
    rank_argv = (list(cfg.target) if cfg.no_python
                 else [python or cfg.python or sys.executable, "-c", _RANK_ENTRY, *cfg.target])
    return STYLES[flavour].command(cfg, program, outdir, rank_argv)


def _mpiexec_launcher(cfg: RunConfig) -> tuple[str, str]:
    mpiexec = find_mpiexec(cfg.mpiexec)
    return mpiexec, mpiexec_flavour(mpiexec)


def _torchrun_launcher(cfg: RunConfig) -> tuple[str, str]:
    return cfg.python or sys.executable, "torchrun"  # torchrun runs in the ranks' Python


#: What ``--launcher`` may name, and how each finds ``(program, flavour)`` (see
#: :func:`find_launcher`): MPI's launcher, or torch's (the ``torch`` backend then).
LAUNCHERS: dict[str, Callable[[RunConfig], tuple[str, str]]] = {
    "mpiexec": _mpiexec_launcher, "torchrun": _torchrun_launcher}


def find_launcher(cfg: RunConfig) -> tuple[str, str]:
    """``(program, flavour)`` that start ``cfg``'s ranks: its mpiexec and that mpiexec's
    flavour, or for ``cfg.launcher == "torchrun"`` the interpreter that runs torchrun (the
    ranks' own) and ``"torchrun"``.

    Raises:
        ValueError: ``cfg.launcher`` is not a key of :data:`LAUNCHERS`.
        LaunchError: no mpiexec could be found (see :func:`find_mpiexec`).
    """
    find = LAUNCHERS.get(cfg.launcher)
    if find is None:
        raise ValueError(f"axondist run: launcher {cfg.launcher!r} is not one of "
                         f"{', '.join(LAUNCHERS)}")
    return find(cfg)


_FATAL = re.compile(r"^Fatal Python error: (.+?)\s*$")
_FATAL_SIGNALS = {"Segmentation fault": 11, "Floating-point exception": 8,
                  "Floating point exception": 8, "Aborted": 6, "Bus error": 7,
                  "Illegal instruction": 4}


def _die_with_parent() -> None:
    """In mpiexec's process, before it starts: get SIGTERM when the launcher dies, even of
    SIGKILL (Linux), so mpiexec stops the job instead of running on without it."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return
        if os.getppid() == 1:  # the launcher died before the request took effect
            os._exit(1)


class _Job:
    """One launch of the job: tails the ranks' output, notices the first failure."""

    def __init__(self, cfg: RunConfig, cmd: list[str], style: LaunchStyle, outdir: str | None,
                 env: dict[str, str], out: TextIO, err: TextIO) -> None:
        self.cfg, self.style, self.outdir, self.out, self.err = cfg, style, outdir, out, err
        self.lock = threading.Lock()
        self.tails = [collections.deque[str](maxlen=cfg.tail_lines) for _ in range(cfg.nprocs)]
        self.pids: dict[int, tuple[int, str]] = {}  # rank -> (pid, host)
        self.ended: set[int] = set()  # ranks whose script returned normally
        #: rank -> its tail when its last traceback began (the summary quotes these lines)
        self.before_traceback: dict[int, list[str]] = {}
        self.failure: RankFailure | None = None
        #: (rank, how) of a rank whose peers' watchdog saw it leave (when it said nothing).
        self.lost: tuple[int, str] | None = None
        self.banner: dict[str, int | str] = {}  # what the launcher reported of a failure
        #: The launcher's own last lines, when it does not show them (torchrun's logging).
        self.launcher_lines = collections.deque[str](maxlen=max(cfg.tail_lines, 50))
        self.stopping = False
        # A session of its own: a terminal's Ctrl-C reaches this launcher only, which stops
        # the job through mpiexec or torchrun (without their reports of their own internals).
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.readers = [threading.Thread(target=self._read_launcher, args=(s, name),
                                         daemon=True)
                        for s, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for t in self.readers:
            t.start()
        #: (kind, rank) -> the file it is read from, once it exists
        self.paths: dict[tuple[str, int], str] = {}
        self.offsets: dict[tuple[str, int], int] = {}
        self.partial: dict[tuple[str, int], bytes] = {}

    # Output of the launcher itself (and, without per-rank files, of every rank).
    def _read_launcher(self, stream: Any, name: str) -> None:
        style = self.style
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            match = style.tagged_line.match(line) if style.tagged_line else None
            if match:
                self._rank_line(int(match[1]), match[3], match[2] == "stderr")
            elif line.startswith(_MARK):
                self._marker(None, line)
            elif style.quiet:
                style.read_report(line, self.banner)
                self.launcher_lines.append(line)
            elif self.stopping and style.stopping_chatter and style.stopping_chatter.match(line):
                continue
            elif not style.read_report(line, self.banner):
                self._emit(line, name == "err")
        stream.close()

    def _emit(self, line: str, to_err: bool) -> None:
        stream = self.err if to_err else self.out
        with self.lock:
            stream.write(line + "\n")
            stream.flush()

    def _rank_line(self, rank: int, line: str, to_err: bool) -> None:
        if line.startswith(_MARK):
            self._marker(rank, line)
            return
        if 0 <= rank < len(self.tails):
            if line.startswith("Traceback (most recent call last):"):
                self.before_traceback[rank] = list(self.tails[rank])
            self.tails[rank].append(line)
        self._emit(f"[rank {rank}] {line}", to_err)

    def _marker(self, rank: int | None, line: str) -> None:
        fields = line[len(_MARK):].strip().split(" ", 3)
        if len(fields) < 2:
            return
        rank = int(fields[0]) if fields[0].lstrip("-").isdigit() else rank
        if rank is None:
            return
        if fields[1] == "start" and len(fields) >= 4:
            self.pids[rank] = (int(fields[2]), fields[3])
        elif fields[1] == "end":
            self.ended.add(rank)
        elif fields[1] == "lost" and len(fields) >= 3 and fields[2].isdigit() and not self.lost:
            self.lost = (int(fields[2]), fields[3] if len(fields) > 3 else "")
        elif fields[1] == "failed" and len(fields) >= 3 and self.failure is None:
            reason = fields[3] if len(fields) > 3 else ""
            self.failure = RankFailure(rank, exit_code=int(fields[2]), reason=reason)

    def _fault_line(self, rank: int, line: str) -> None:
        """A fatal signal's report (faulthandler's "Fatal Python error: Segmentation fault")."""
        m = _FATAL.match(line)
        if m and self.failure is None:
            number = _FATAL_SIGNALS.get(m[1])
            self.failure = RankFailure(rank, signal_number=number, exit_code=None if number
                                       else 1, reason="" if number else m[1])

    # Per-rank files: output (under hydra and torchrun), reports and crash stacks (always).
    def _rank_file(self, outdir: str, kind: str, rank: int) -> str | None:
        path = self.paths.get((kind, rank))
        if path is None:
            if kind in ("status", "fault"):
                path = os.path.join(outdir, f"{kind}.{rank}")
            elif self.style.rank_output is not None:
                path = self.style.rank_output(outdir, kind, rank)
            if path is not None:
                self.paths[kind, rank] = path
        return path

    def _poll_files(self, kinds: tuple[str, ...] = ("status", "fault", "out", "err")) -> None:
        """Read what the ranks added to their files. Reports first: a rank whose output was
        shown is known (its pid) even when the launcher is interrupted right after."""
        if self.outdir is None:
            return
        for rank in range(self.cfg.nprocs):
            for kind in kinds:
                path = self._rank_file(self.outdir, kind, rank)
                if path is None:
                    continue
                try:
                    with open(path, "rb") as f:
                        f.seek(self.offsets.get((kind, rank), 0))
                        data = f.read()
                except FileNotFoundError:
                    continue
                if not data:
                    continue
                self.offsets[kind, rank] = self.offsets.get((kind, rank), 0) + len(data)
                *lines, rest = (self.partial.pop((kind, rank), b"") + data).split(b"\n")
                if rest:
                    self.partial[kind, rank] = rest
                for raw in lines:
                    line = raw.decode(errors="replace").rstrip("\r")
                    if kind == "fault":
                        self._fault_line(rank, line)
                    self._rank_line(rank, line, kind != "out")

    def _flush_partial(self) -> None:
        for (kind, rank), rest in sorted(self.partial.items()):
            self._rank_line(rank, rest.decode(errors="replace"), kind != "out")
        self.partial.clear()

    def wait(self) -> int:
        """Tail the output until the launcher ends; stop the job when a rank fails and the
        others do not end within ``stop_grace``. Returns the launcher's exit status."""
        stop_at: float | None = None
        stopping_since: float | None = None
        while True:
            self._poll_files()
            code = self.proc.poll()
            if code is not None:
                break
            now = time.monotonic()
            if self.failure is not None and stop_at is None:
                stop_at = now + self.cfg.stop_grace
            if stop_at is not None and now >= stop_at and stopping_since is None:
                stopping_since = now
                self.stopping = True
                self.proc.send_signal(self.style.stop_signal)  # passed on to every rank
            if stopping_since is not None and now - stopping_since > _KILL_AFTER_S:
                self._kill()
            time.sleep(_POLL_S)
        for t in self.readers:
            t.join(timeout=10)
        self._poll_files()
        self._flush_partial()
        return code

    def stop(self) -> None:
        """Interrupt the job (Ctrl-C on the launcher) and wait for the launcher to end."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(self.style.stop_signal)
            try:
                self.proc.wait(timeout=_KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                self._kill()
                self.proc.wait()

    def _kill(self) -> None:
        """Kill the launcher outright, and the ranks on this host that have not ended: a
        launcher killed outright cannot stop them (torchrun starts each rank in a session of
        its own), and a rank that ignores the stop signal would run on."""
        self.proc.kill()
        self._poll_files(("status",))  # the pids of ranks started since the last look
        here = socket.gethostname()
        for rank, (pid, host) in sorted(self.pids.items()):
            if host == here and rank not in self.ended:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def outcome(self, code: int) -> RankFailure | None:
        """The first failure, from the ranks' own report, the launcher's (hydra's banner,
        torchrun's root cause) or the exit status."""
        failure = self.failure
        if failure is None and (self.banner or code != 0):
            failure = self._unreported_failure(code)
        if failure is not None and failure.rank is not None:
            failure.tail = list(self.tails[failure.rank])
            shown = self.before_traceback.get(failure.rank)
            if shown is not None and self.failure is failure and failure.exit_code != 0 \
                    and not failure.reason.startswith("sys.exit("):
                failure.tail, failure.before_traceback = shown, True
        return failure

    def cannot_start(self) -> str | None:
        """The launcher's own line saying it could not start at all (torchrun without torch),
        when no rank started; None otherwise."""
        pattern = self.style.cannot_start
        if pattern is None or self.pids:
            return None
        return next((line.strip() for line in reversed(self.launcher_lines)
                     if pattern.search(line)), None)

    def _unreported_failure(self, code: int) -> RankFailure:
        """A rank died without a word (SIGKILL, the OOM killer, ``os._exit``): the one rank
        that started and did not end; when several did not (the others were killed in the
        clean-up, or ended by their watchdog), the one its peers' watchdog saw leave, else the
        one torchrun saw fail first, else the one hydra's banner names, which is only a best
        guess."""
        sig = self.banner.get("signal")
        number = self.banner.get("code", code)
        signum = int(sig) if sig is not None else (-code if code < 0 else None)
        silent = sorted(set(self.pids) - self.ended)
        pid = self.banner.get("pid")
        named = [r for r in silent if self.pids[r][0] == pid]
        first = self.banner.get("rank")  # torchrun's root cause
        rank = silent[0] if len(silent) == 1 else None
        reason, launcher = "", self.style.name
        if rank is None and self.lost is not None and self.lost[0] in silent:
            rank = self.lost[0]
            reason = (f"its peers saw it leave ({self.lost[1]})" if self.lost[1]
                      else "its peers saw it leave")
            if pid not in (None, self.pids[rank][0]):  # the banner names a rank killed after
                signum, number = None, code
            if m := re.search(r"_exit\((\d+)\)", self.lost[1]):
                signum, number = None, int(m[1])
        elif rank is None and first is not None and 0 <= int(first) < self.cfg.nprocs:
            rank = int(first)
        elif len(silent) > 1:
            guess = (f"{launcher} names rank {named[0]}, the most likely" if named
                     else f"{launcher} did not say which")
            reason = f"one of ranks {', '.join(map(str, silent))}; {guess}"
        elif not silent:
            reason = (f"{launcher} exited with status {code} after every rank ended" if self.pids
                      else f"{launcher} failed before the ranks started")
        failure = RankFailure(rank, exit_code=None if signum else int(number) or code,
                              signal_number=signum, reason=reason)
        if named and rank is None:
            failure.tail = list(self.tails[named[0]])
        elif rank is None and self.launcher_lines and self.cfg.tail_lines:
            failure.tail = list(self.launcher_lines)[-self.cfg.tail_lines:]
            failure.tail_of = launcher
        return failure


def _last_lines(n: int) -> str:
    return "last line" if n == 1 else f"last {n} lines"


def summary(failure: RankFailure, nprocs: int, seconds: float) -> list[str]:
    """The failure summary: one line, then the failed rank's last output lines indented."""
    who = (f"rank {failure.rank} of {nprocs}" if failure.rank is not None
           else f"the job ({nprocs} ranks)")
    whose = failure.tail_of or (f"rank {failure.rank}" if failure.rank is not None
                                else "that rank")
    before = " before its traceback" if failure.before_traceback else ""
    lines = [f"axondist run: {who} failed after {seconds:.1f} s ({failure.describe()})"
             + (f"; {_last_lines(len(failure.tail))} of {whose}{before}:" if failure.tail
                else "")]
    return lines + [f"    | {line}" for line in failure.tail]


def run_job(cfg: RunConfig, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Launch ``cfg`` (with restarts) and return the exit status ``axondist run`` exits with.

    Args:
        cfg: what to launch.
        out, err: where the ranks' tagged stdout and stderr go (the launcher's own streams when
            None); the failure summary and restart notes go to ``err``.

    Returns:
        0 when an attempt succeeded; else the failed rank's exit code (128 + N for signal N),
        or 130 when interrupted.

    Raises:
        LaunchError: no mpiexec could be found, or torchrun could not start (no torch).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    program, flavour = find_launcher(cfg)
    in_main_thread = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGINT, signal.SIGTERM,
             *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))
    previous = {s: signal.signal(s, _interrupt) for s in stops} if in_main_thread else {}
    remove_stale_run_dirs()
    try:
        return _attempts(cfg, program, flavour, out, err)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C (SIGINT, handled even where the launcher was started with it ignored, as
    mpiexec and torchrun handle it), SIGTERM (a scheduler ending the launcher) or SIGHUP
    (its terminal closed) stops the job."""
    raise KeyboardInterrupt


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_run_dirs(root: str | None = None) -> list[str]:
    """Remove the run folders (``axondist-run-PID-*`` under ``root``, the temporary folder
    by default) of launchers that no longer run: a launcher killed outright (SIGKILL) could
    not remove its own. Returns the folders removed."""
    removed = []
    pattern = os.path.join(root or tempfile.gettempdir(), f"{_RUN_DIR_PREFIX}*-*")
    for path in glob.glob(pattern):
        owner = os.path.basename(path)[len(_RUN_DIR_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _attempts(cfg: RunConfig, program: str, flavour: str, out: TextIO, err: TextIO) -> int:
    """Launch until an attempt succeeds or the restarts run out; the exit status."""
    status = 1
    style = STYLES[flavour]
    for attempt in range(cfg.max_restarts + 1):
        env = dict(os.environ)
        env[RESTART_COUNT_VAR] = str(attempt)
        with tempfile.TemporaryDirectory(prefix=f"{_RUN_DIR_PREFIX}{os.getpid()}-") as outdir:
            cmd = build_command(cfg, program, flavour, outdir)
            env[RUN_DIR_VAR] = outdir
            start = time.monotonic()
            job = _Job(cfg, cmd, style, outdir, env, out, err)
            try:
                code = job.wait()
            except KeyboardInterrupt:
                job.stop()
                print("axondist run: interrupted; the job was stopped", file=err)
                return 130
            failure = job.outcome(code)
            if failure is not None and (line := job.cannot_start()) is not None:
                raise LaunchError(style.cannot_start_advice.format(program=program, line=line))
        if failure is None:
            return 0
        status = failure.exit_status
        err.write("\n".join(summary(failure, cfg.nprocs, time.monotonic() - start)) + "\n")
        if attempt < cfg.max_restarts:
            print(f"axondist run: restarting the job (restart {attempt + 1} of "
                  f"{cfg.max_restarts}; the script sees {RESTART_COUNT_VAR}={attempt + 1})",
                  file=err)
        elif cfg.max_restarts:
            print(f"axondist run: giving up after {cfg.max_restarts} restart"
                  f"{'s' if cfg.max_restarts > 1 else ''}", file=err)
        err.flush()
    return status


# --- the command line ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="axondist run",
        description="Run a script on N processes through mpiexec (the MPICH wheel's, else one on "
                    "PATH) or, with --launcher torchrun, through torch's torchrun on this host. "
                    "Each output line is prefixed with its rank; when a rank fails, one "
                    "summary line says which, how, and quotes its last lines. The script reads "
                    f"{RESTART_COUNT_VAR} (0, then 1, 2... after --max-restarts relaunches).",
        usage="axondist run -n N [options] (script.py | -m module | python -c code | "
              "--no-python program) [args ...]")
    parser.add_argument("-n", "--nprocs", type=int, default=None, metavar="N",
                        help="processes in the job (default: --nproc-per-node x hosts)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="K",
                        help="ranks per host")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", default=None, metavar="H1,H2",
                       help="comma-separated hosts (host or host:slots)")
    where.add_argument("--hostfile", default=None, metavar="FILE",
                       help="file listing the hosts, one a line")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="relaunch the whole job up to K times after a failure (default 0)")
    parser.add_argument("--stop-grace", type=float, default=RunConfig.stop_grace,
                        metavar="SECONDS", help="after a rank fails, how long the others may "
                        "run on before the job is stopped (default %(default)s)")
    parser.add_argument("--tail-lines", type=int, default=RunConfig.tail_lines, metavar="L",
                        help="lines of the failed rank's output to quote (default %(default)s)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="mpiexec",
                        help="what starts the ranks: mpiexec (default; ad.init() picks the "
                             "MPI backend) or torchrun (this host only; needs pip install "
                             "'.[torch]'; ad.init() joins through the torch backend). No "
                             "'auto': the launcher decides the backend, so it is named")
    parser.add_argument("--mpiexec", default=None, metavar="PATH",
                        help="the mpiexec to use (default: next to python, else on PATH)")
    parser.add_argument("-m", dest="module", default=None, metavar="MODULE",
                        help="run a module, as python -m does (its arguments follow)")
    parser.add_argument("--no-python", action="store_true",
                        help="run the target as a program on every rank, without Python (no "
                             "per-rank failure reports)")
    parser.add_argument("script", nargs="?", default=None, metavar="script.py",
                        help="the script; its arguments follow")
    return parser


_VALUED = {"-n", "--nprocs", "--nproc-per-node", "--hosts", "--hostfile", "--max-restarts",
           "--stop-grace", "--tail-lines", "--mpiexec", "--launcher"}


def _split_target(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` as (the launcher's options up to the script, the script's own arguments): the
    script (or ``-m MODULE``) ends the launcher's options, as with ``python`` itself."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i] + argv[i + 1:i + 2], argv[i + 2:]
        if arg == "-m":
            return argv[:i + 2], argv[i + 2:]
        if arg.startswith("-m") and not arg.startswith("--"):  # -mpkg.train
            return argv[:i + 1], argv[i + 1:]
        if not arg.startswith("-") or arg == "-":
            return argv[:i + 1], argv[i + 1:]
        i += 2 if arg in _VALUED else 1
    return argv, []


def parse_args(argv: Sequence[str]) -> RunConfig:
    """``axondist run``'s arguments as a :class:`RunConfig`.

    Raises:
        ValueError: a count below its minimum, no script, or a host file that does not exist;
            the message names the option and what to give.
    """
    own, rest = _split_target(list(argv))
    ns = _parser().parse_args(own)
    if ns.module is not None:
        target: tuple[str, ...] = ("-m", ns.module, *rest)
    else:
        target = (ns.script, *rest) if ns.script is not None else ()
    if not target:
        raise ValueError("axondist run: no script given; usage: axondist run -n N script.py "
                         "[args ...] (or -m module)")
    python = None
    if ns.no_python and ns.module is not None:
        raise ValueError("axondist run: --no-python runs a program; -m runs a Python module. "
                         "Give one of them")
    if not ns.no_python and ns.module is None:
        python, target = _python_target(target)
    hosts = tuple(h for h in (ns.hosts or "").split(",") if h.strip())
    if ns.hosts is not None and not hosts:
        raise ValueError(f"axondist run: --hosts {ns.hosts!r} names no host; give h1,h2")
    if ns.hostfile is not None and not os.path.isfile(ns.hostfile):
        raise ValueError(f"axondist run: --hostfile {ns.hostfile!r} does not exist")
    if ns.nproc_per_node is not None and ns.nproc_per_node < 1:
        raise ValueError(f"axondist run: --nproc-per-node must be >= 1, got {ns.nproc_per_node}")
    nprocs = ns.nprocs
    if nprocs is None:
        if ns.nproc_per_node is None or ns.hostfile is not None:
            raise ValueError("axondist run: give the number of processes with -n N")
        nprocs = ns.nproc_per_node * max(1, len(hosts))
    if nprocs < 1:
        raise ValueError(f"axondist run: -n must be >= 1, got {nprocs}")
    if ns.max_restarts < 0:
        raise ValueError(f"axondist run: --max-restarts must be >= 0, got {ns.max_restarts}")
    if ns.tail_lines < 0:
        raise ValueError(f"axondist run: --tail-lines must be >= 0, got {ns.tail_lines}")
    if not ns.stop_grace >= 0:
        raise ValueError(f"axondist run: --stop-grace must be >= 0 seconds, got {ns.stop_grace}")
    if ns.launcher == "torchrun":
        _check_torchrun_args(ns, nprocs)
    return RunConfig(nprocs=nprocs, target=target, nproc_per_node=ns.nproc_per_node,
                     hosts=hosts, hostfile=ns.hostfile, max_restarts=ns.max_restarts,
                     mpiexec=ns.mpiexec, tail_lines=ns.tail_lines, stop_grace=ns.stop_grace,
                     python=python, no_python=ns.no_python, launcher=ns.launcher)


def _check_torchrun_args(ns: argparse.Namespace, nprocs: int) -> None:
    """Refuse what ``--launcher torchrun`` cannot do: other hosts, an mpiexec, two counts.

    Raises:
        ValueError: the message names the option and what to run instead.
    """
    if ns.hosts is not None or ns.hostfile is not None:
        given = "--hosts" if ns.hosts is not None else "--hostfile"
        raise ValueError(
            f"axondist run: --launcher torchrun starts the ranks on this host only, and {given} "
            "names others: torchrun runs once on every host. Run there `torchrun --nnodes H "
            "--nproc-per-node K --rdzv-backend c10d --rdzv-endpoint FIRST_HOST:29400 "
            "script.py` (see docs/launching.md), or launch every host from here with "
            f"--launcher mpiexec {given} ...")
    if ns.mpiexec is not None:
        raise ValueError(f"axondist run: --mpiexec {ns.mpiexec!r} names the MPI launcher, but "
                         "--launcher torchrun was asked for; drop one of them")
    if ns.nproc_per_node is not None and ns.nproc_per_node != nprocs:
        raise ValueError(f"axondist run: --launcher torchrun runs on this host only, so -n "
                         f"{nprocs} and --nproc-per-node {ns.nproc_per_node} must agree; give "
                         "one of them")


def _python_target(target: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """``(interpreter, target)`` for a target that names a Python interpreter first
    (``python -c CODE``, ``python -m MODULE``, ``python script.py``): the ranks run that
    interpreter, with the per-rank reports; ``(None, target)`` for a script.

    Raises:
        ValueError: the target is a program rather than a Python script (give
            ``--no-python``), or the interpreter is followed by options of its own.
    """
    first, args = target[0], list(target[1:])
    program = shutil.which(first) if not first.endswith(".py") else None
    if program is not None and _PYTHON.match(os.path.basename(first)):
        if len(args) >= 2 and args[0] in ("-c", "-m"):
            return program, (args[0], *args[1:])
        if len(args) >= 1 and args[0].startswith("-m") and len(args[0]) > 2:
            return program, ("-m", args[0][2:], *args[1:])
        if args and not args[0].startswith("-"):
            return program, tuple(args)
        given = " ".join([first, *args[:1]])
        raise ValueError(f"axondist run: {given!r}: after the interpreter give a script, -m "
                         "MODULE or -c CODE; for interpreter options, run it as a program with "
                         "--no-python (the ranks then run without per-rank failure reports)")
    if _is_program(first) or (program is not None and not os.path.exists(first)):
        raise ValueError(f"axondist run: {first!r} is a program, not a Python script; give "
                         f"--no-python to run it on every rank as it is (axondist run -n N "
                         f"--no-python {first} ...), or name the script or -m module to run")
    return None, target


def _is_program(path: str) -> bool:
    """Whether the file at ``path`` is a compiled program or a script of another language."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if head.startswith(b"#!"):
        return b"python" not in head.split(b"\n", 1)[0]
    return b"\0" in head


def main(argv: Sequence[str] | None = None) -> int:
    """``axondist run ARGS``: parse, launch, return the exit status (2 for bad arguments)."""
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        return run_job(cfg)
    except (ValueError, LaunchError) as exc:
        print(exc, file=sys.stderr)
        return 2


__all__ = ["LAUNCHERS", "RESTART_COUNT_VAR", "RankFailure", "RunConfig", "build_command",
           "find_launcher", "find_mpiexec", "main", "mpiexec_flavour", "parse_args", "run_job",
           "summary"]
