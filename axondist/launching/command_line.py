"""The command line of ``axondist run``: what one invocation asks for (:class:`RunConfig`)
and how its arguments are read and checked (:func:`parse_args`). The script and its own
arguments end the launcher's options, as with ``python`` itself; a bad argument is a
``ValueError`` that names the option and what to give."""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from .in_rank import RESTART_COUNT_VAR

#: What ``--launcher`` may name (``axondist.launching.supervisor.LAUNCHERS`` says how each finds its
#: program).
LAUNCHER_NAMES = ("mpiexec", "torchrun")
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
    """The mpiexec to use; None finds one (see ``axondist.launching.supervisor.find_mpiexec``)."""
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
    parser.add_argument("--launcher", choices=LAUNCHER_NAMES, default="mpiexec",
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


__all__ = ["LAUNCHER_NAMES", "RunConfig", "parse_args"]
