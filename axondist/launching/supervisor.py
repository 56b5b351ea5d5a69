"""``axondist run``: launch a script on N processes through ``mpiexec`` or ``torchrun``, tag
each output line with its rank, say in one line which rank failed and how, and relaunch the
whole job after a failure (``--max-restarts``) so a script that resumes from its latest
checkpoint carries on. Its command line: :mod:`axondist.launching.command_line`; how each
launcher is driven: :mod:`axondist.launching.styles`; how a failure is told:
:mod:`axondist.launching.failure`. Design notes: docs/launching.md."""

from __future__ import annotations

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
from pathlib import Path
from typing import Any, TextIO

from ..errors import LaunchError
from .command_line import RunConfig, parse_args
from .failure import CAUSED_BY_A_PEER, RankFailure, seen_leaving, summary
from .in_rank import MARK as _MARK
from .in_rank import RESTART_COUNT_VAR, RUN_DIR_VAR
from .styles import STYLES, LaunchStyle

_POLL_S = 0.05
_KILL_AFTER_S = 5.0  # after asking mpiexec to stop, how long before it is killed outright
_RUN_DIR_PREFIX = "axondist-run-"
_PR_SET_PDEATHSIG = 1


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


_RANK_ENTRY = "from axondist.launching.in_rank import rank_main; rank_main()"


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

    Every rank runs the target through ``axondist.launching.in_rank``, which reports how it ended
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
        self.reported: set[int] = set()  # ranks that reported their own failure
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
        elif fields[1] == "failed" and len(fields) >= 3:
            self.reported.add(rank)
            if self.failure is None:
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
            if _STOP_REQUESTED.is_set():  # a stop signal came (here, not where it landed)
                raise KeyboardInterrupt
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
            _STOP_REQUESTED.wait(_POLL_S)
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
        if (failure is not None and self.lost is not None and self.lost[0] != failure.rank
                and self.lost[0] not in self.reported
                and failure.reason.startswith(CAUSED_BY_A_PEER)):
            # the first report is a peer's error about a rank that left without a word
            # (os._exit, a signal): that rank is the failure, as its peers' watchdog saw it
            failure = self._left_without_a_word(code)
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

    def _left_without_a_word(self, code: int) -> RankFailure:
        """The rank its peers' watchdog saw leave (:attr:`lost`), as the job's failure."""
        assert self.lost is not None
        rank, why = self.lost
        sig = self.banner.get("signal")
        own = self.banner.get("pid") == self.pids.get(rank, (None,))[0]
        signum = int(sig) if sig is not None and own else None
        reason, exit_code = seen_leaving(why)
        return RankFailure(rank, exit_code=None if signum else exit_code or code or 1,
                           signal_number=signum, reason=reason)

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
            reason, exit_code = seen_leaving(self.lost[1])
            if pid not in (None, self.pids[rank][0]):  # the banner names a rank killed after
                signum, number = None, code
            if exit_code is not None:
                signum, number = None, exit_code
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
    _STOP_REQUESTED.clear()
    previous = {s: signal.signal(s, _interrupt) for s in stops} if in_main_thread else {}
    remove_stale_run_dirs()
    try:
        return _attempts(cfg, program, flavour, out, err)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class _StopFlag:
    """Whether a stop signal came. Set from a signal handler, so it takes no lock: a
    ``threading.Event`` would, and a signal landing while the main thread holds that lock
    (inside ``Event.wait``, between taking it and waiting) would block the handler, and the
    launcher, forever. The job's loop looks at it every ``_POLL_S``."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> None:
        """Sleep ``timeout`` unless the flag is set (a signal cuts the sleep short only by
        running its handler; the loop's next look sees it)."""
        if not self._set:
            time.sleep(timeout)


#: Set by a stop signal; the job's wait loop stops the job at its next look (:func:`_interrupt`).
_STOP_REQUESTED = _StopFlag()


def _interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C (SIGINT, handled even where the launcher was started with it ignored, as
    mpiexec and torchrun handle it), SIGTERM (a scheduler ending the launcher) or SIGHUP
    (its terminal closed) stops the job. The handler only records it: an exception raised
    where a signal lands can land inside ``Popen.poll`` between taking its wait lock and the
    ``try`` that gives it back, and every later wait for mpiexec then blocks forever. Nor
    does it take a lock (:class:`_StopFlag`)."""
    _STOP_REQUESTED.set()


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
        if _STOP_REQUESTED.is_set():  # between attempts: no job to stop
            print("axondist run: interrupted; the job was stopped", file=err)
            return 130
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
