"""What runs inside each rank that ``axondist run`` starts: the script, as ``python script.py``
would run it, then a report to the launcher of how it ended (a marker line on stderr, and a file
when the rank runs on the launching host), and ``MPI_Abort`` after a failure so the other ranks
do not wait forever."""

from __future__ import annotations

import faulthandler
import os
import runpy
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from ..backends import settings
from ..backends.watchdog.launcher_report import MARK, RESTART_COUNT_VAR, RUN_DIR_VAR
from ..backends.watchdog.launcher_report import report as _report

# MPI launchers first; torchrun's RANK last (a leftover RANK must not win under mpiexec).
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK")


def _env_rank() -> int:
    for var in _RANK_VARS:
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return -1


def _exit_code(code: Any) -> int:
    """The process exit status ``sys.exit(code)`` gives (None: 0, an int: itself, else 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def _abort_mpi(code: int) -> None:
    """End every rank's MPI if this rank started it: the others would wait forever."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        from ..backends.watchdog.watchdog import wait_until_output_is_read

        wait_until_output_is_read()  # mpiexec forwards a failing rank's last lines first
        mpi.COMM_WORLD.Abort(code or 1)


def _user_traceback(exc: BaseException) -> None:
    """Print ``exc`` as Python would for the script, without the launcher's own frames."""
    tb = exc.__traceback__
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


_fault_file: Any = None  # kept open for the life of the process


def _enable_faulthandler(rank: int) -> None:
    """Show the Python stack when C code crashes (SIGSEGV...): in a file the launcher reads
    when this rank runs on the launching host (so it knows which rank crashed), else on
    stderr."""
    global _fault_file
    run_dir = settings.read(RUN_DIR_VAR)
    if run_dir and os.path.isdir(run_dir):
        try:
            _fault_file = open(os.path.join(run_dir, f"fault.{rank}"), "w")  # noqa: SIM115
        except OSError:
            _fault_file = None
    faulthandler.enable(file=_fault_file or sys.stderr)


def rank_main(argv: Sequence[str] | None = None) -> None:
    """Run the target on this rank as ``python script.py args`` (or ``python -m``) would, and
    tell the launcher how it ended; on failure, abort MPI so the other ranks do not hang.

    Args:
        argv: the script and its arguments, ``["-m", module, args...]`` or ``["-c", code,
            args...]`` (default: ``sys.argv[1:]``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    rank = _env_rank()
    for stream in (sys.stdout, sys.stderr):  # whole lines reach the launcher as printed
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    _report(rank, "start", os.getpid(), socket.gethostname())
    _enable_faulthandler(rank)
    if "PMI_RANK" in os.environ:
        # MPICH's hydra started this rank: its single-copy setting, decided on this rank's
        # own host, before a script that starts MPI itself (``python -m mpi4py``) can
        from ..backends.mpi.single_copy import before_mpi_starts

        before_mpi_starts()
    try:
        if args[:1] == ["-m"]:
            sys.argv = args[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[:1] == ["-c"]:
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        else:
            sys.argv = args
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
        if code != 0:
            _report(rank, "failed", code, f"sys.exit({exc.code!r})")
            _abort_mpi(code)
        else:
            _report(rank, "end", 0)
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, then the process exits with 1
        _user_traceback(exc)
        reason = traceback.format_exception_only(type(exc), exc)[-1].strip()[:300]
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        _report(rank, "failed", code, reason)
        _abort_mpi(code)
        sys.exit(code)
    _report(rank, "end", 0)


__all__ = ["MARK", "RESTART_COUNT_VAR", "RUN_DIR_VAR", "rank_main"]
