"""How each launcher that ``axondist run`` drives starts the ranks, where their output comes
back, and how it reports a rank that failed: one :class:`LaunchStyle` per launcher (MPICH's
hydra, Open MPI, another mpiexec, torchrun) in :data:`STYLES`, so the job that tails the
output holds no per-launcher branches."""

from __future__ import annotations

import glob
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .command_line import RunConfig

#: What a launcher reported of a failed rank: ``pid``, ``host``, ``code`` (exit code),
#: ``signal``, and ``rank`` when the launcher names the first failure itself.
Report = dict[str, "int | str"]


@dataclass(frozen=True)
class LaunchStyle:
    """One launcher: the command, where each rank's output lands, what its own lines mean."""

    name: str
    """The launcher as the failure summary names it (``"mpiexec"``, ``"torchrun"``)."""
    command: Callable[[RunConfig, str, str | None, list[str]], list[str]]
    """``(cfg, program, outdir, rank_argv)`` -> the launch command: ``program`` is the
    launcher's executable, ``outdir`` the run folder (None: none), ``rank_argv`` what every
    rank runs."""
    rank_output: Callable[[str, str, int], str | None] | None = None
    """``(outdir, "out" or "err", rank)`` -> the file the launcher writes that rank's stdout or
    stderr to (None while it does not exist yet); None when the ranks' output comes through
    the launcher's own streams."""
    tagged_line: re.Pattern[str] | None = None
    """A line of the launcher's own output that carries a rank's line: groups rank, stream
    (``stdout``/``stderr``), text."""
    read_report: Callable[[str, Report], bool] = lambda line, report: False
    """Records in ``report`` what one of the launcher's own lines says of a failed rank;
    True for the lines of that report, which are not shown."""
    quiet: bool = False
    """The launcher's own lines (its logging, its report) are not shown; the summary quotes
    the last of them when no rank can be named."""
    stopping_chatter: re.Pattern[str] | None = None
    """The launcher's own lines about a job it was told to stop (not shown)."""
    stop_signal: int = signal.SIGINT
    """What stops the job: the launcher passes it on to every rank."""
    cannot_start: re.Pattern[str] | None = None
    """A line of the launcher's output that means it could not start at all."""
    cannot_start_advice: str = ""
    """What to do then (``{program}``: the launcher's executable, ``{line}``: that line)."""


# --- mpiexec: hydra (MPICH, Intel MPI), Open MPI, any other -----------------------------------

# Hydra's banner when a rank dies without calling MPI_Abort (a signal, a crash).
_BANNER_PID = re.compile(r"^=\s+PID (\d+) RUNNING AT (\S+)")
_BANNER_CODE = re.compile(r"^=\s+EXIT CODE: (-?\d+)")
_BANNER_SIGNAL = re.compile(r"EXIT STRING: .*\(signal (\d+)\)")
_BANNER_LINE = re.compile(r"^(=+|=\s.*|YOUR APPLICATION TERMINATED.*|This typically refers.*|"
                          r"Please see the FAQ page.*)$")
_OPENMPI_TAG = re.compile(r"^\[\d+,(\d+)\]<(stdout|stderr)>:\s?(.*)$")
# Hydra's own report of a job it was told to stop: its internals, not the user's business.
_HYDRA_STOPPING = re.compile(r"^(\[(mpiexec|proxy)[^\]]*@[^\]]*\] |Ctrl-C caught\.\.\. )")


def _hydra_banner(line: str, report: Report) -> bool:
    """Record hydra's bad-termination banner (shown instead as one summary line)."""
    if m := _BANNER_PID.match(line):
        report.update(pid=int(m[1]), host=m[2])
    elif m := _BANNER_CODE.match(line):
        report["code"] = int(m[1])
    elif m := _BANNER_SIGNAL.search(line):
        report["signal"] = int(m[1])
    return not line.strip() or bool(_BANNER_LINE.match(line))


def _hydra_placement(cfg: RunConfig) -> list[str]:
    """How many ranks go where, in hydra's options."""
    per_node = ["-ppn", str(cfg.nproc_per_node)] if cfg.nproc_per_node is not None else []
    hosts = ["-hosts", ",".join(cfg.hosts)] if cfg.hosts else []
    return per_node + hosts + (["-f", cfg.hostfile] if cfg.hostfile else [])


def _openmpi_placement(cfg: RunConfig) -> list[str]:
    """How many ranks go where, in Open MPI's options."""
    per_node = (["--map-by", f"ppr:{cfg.nproc_per_node}:node"]
                if cfg.nproc_per_node is not None else [])
    hosts = ["--host", ",".join(cfg.hosts)] if cfg.hosts else []
    return per_node + hosts + (["--hostfile", cfg.hostfile] if cfg.hostfile else [])


def _hydra_command(cfg: RunConfig, program: str, outdir: str | None,
                   rank_argv: list[str]) -> list[str]:
    """Each rank's stdout and stderr go to ``outdir/out.R`` and ``outdir/err.R`` (on the
    launching host, even for remote ranks)."""
    files = (["-outfile-pattern", os.path.join(outdir, "out.%r"),
              "-errfile-pattern", os.path.join(outdir, "err.%r")] if outdir is not None else [])
    return [program, "-n", str(cfg.nprocs), *_hydra_placement(cfg), *files,
            *rank_argv]


def _openmpi_command(cfg: RunConfig, program: str, outdir: str | None,
                     rank_argv: list[str]) -> list[str]:
    """Open MPI tags each rank's lines itself (``--tag-output``)."""
    return [program, "-n", str(cfg.nprocs),
            *_openmpi_placement(cfg), "--tag-output", *rank_argv]


def _plain_mpiexec_command(cfg: RunConfig, program: str, outdir: str | None,
                           rank_argv: list[str]) -> list[str]:
    """An mpiexec of unknown make: hydra's option names, output on its own streams."""
    return [program, "-n", str(cfg.nprocs), *_hydra_placement(cfg),
            *rank_argv]


def _hydra_output(outdir: str, stream: str, rank: int) -> str:
    return os.path.join(outdir, f"{stream}.{rank}")


# --- torchrun -----------------------------------------------------------------------------

_TORCHRUN_LOGS = "torchrun"  # under the run folder
_TORCHRUN_FILES = {"out": "stdout.log", "err": "stderr.log"}
_ROOT_CAUSE = re.compile(r"^Root Cause")
_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_TORCHRUN_HOST = re.compile(r"^\s*host\s*:\s*(\S+)")
_TORCHRUN_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?")


def _torchrun_command(cfg: RunConfig, program: str, outdir: str | None,
                      rank_argv: list[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone`` on this host, without torchrun's own
    restarts (``axondist run`` relaunches the whole job itself), each rank's stdout and stderr
    redirected to files under ``outdir``."""
    logs = (["--redirects", "3", "--log-dir", os.path.join(outdir, _TORCHRUN_LOGS)]
            if outdir is not None else [])
    return [program, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(cfg.nprocs), "--max-restarts", "0", *logs, "--no-python", *rank_argv]


def _torchrun_output(outdir: str, stream: str, rank: int) -> str | None:
    """torchrun's ``LOG_DIR/<run id>/attempt_0/<local rank>/stdout.log`` (one host: the local
    rank is the rank)."""
    pattern = os.path.join(outdir, _TORCHRUN_LOGS, "*", "attempt_*", str(rank),
                           _TORCHRUN_FILES[stream])
    found = sorted(glob.glob(pattern))
    return found[0] if found else None


def _torchrun_report(line: str, report: Report) -> bool:
    """Record the "Root Cause (first observed failure)" block of torchrun's error report: the
    rank that failed first, its exit code (negative: the signal), pid and host."""
    if _ROOT_CAUSE.match(line):
        report["section"] = "root cause"
    elif report.get("section") == "root cause":
        if (m := _TORCHRUN_RANK.match(line)) and "rank" not in report:
            report["rank"] = int(m[1])
        elif m := _TORCHRUN_HOST.match(line):
            report.setdefault("host", m[1])
        elif (m := _TORCHRUN_EXIT.match(line)) and "code" not in report \
                and "signal" not in report:
            code = int(m[1])
            report.update({"signal": -code} if code < 0 else {"code": code})
            if m[2]:
                report["pid"] = int(m[2])
    return True


STYLES: dict[str, LaunchStyle] = {
    "hydra": LaunchStyle("mpiexec", _hydra_command, rank_output=_hydra_output,
                         read_report=_hydra_banner, stopping_chatter=_HYDRA_STOPPING),
    "openmpi": LaunchStyle("mpiexec", _openmpi_command, tagged_line=_OPENMPI_TAG,
                           read_report=_hydra_banner),
    "unknown": LaunchStyle("mpiexec", _plain_mpiexec_command, read_report=_hydra_banner),
    "torchrun": LaunchStyle(
        "torchrun", _torchrun_command, rank_output=_torchrun_output,
        read_report=_torchrun_report, quiet=True, stop_signal=signal.SIGTERM,
        cannot_start=re.compile(r"Error while finding module specification for "
                                r"'torch\.|^(ModuleNotFoundError|ImportError)\b"),
        cannot_start_advice="axondist run: --launcher torchrun needs torch, which {program} "
                            "cannot import ({line}); install it with `pip install '.[torch]'` "
                            "(or `pip install torch`), or launch through MPI with "
                            "--launcher mpiexec"),
}
"""The launch style of each launcher, by
:func:`axondist.launching.supervisor.mpiexec_flavour`'s name or ``"torchrun"``."""


__all__ = ["STYLES", "LaunchStyle", "Report"]
