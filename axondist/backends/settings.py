"""Every ``AXONDIST_*`` environment variable, declared once: its name, what it holds, its
default, what it does, and the one reader that turns its text into a value (a bad value is a
``ValueError`` naming the variable, what it must be, and what to do). A world reads them all
when it is made (:func:`load`, from ``init`` and ``spawn``): a bad value fails there rather
than at first use, and a name that is not declared (a misspelling) is named in a warning with
the nearest real one. The guide's table of variables is :func:`markdown_table`'s output
(``python -m axondist.backends.settings`` prints it; a test compares the two)."""

# No ``from __future__ import annotations``: NamedTuple would compile each field's annotation
# text at import (26 compiles); evaluated annotations cost nothing.
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

PREFIX = "AXONDIST_"


class Variable(NamedTuple):
    """One environment variable: how it is read and documented."""

    name: str
    """The full name, ``AXONDIST_...``."""
    field: str
    """The :class:`Settings` attribute that holds its value."""
    default: Any
    """The value when it is unset or empty."""
    meaning: str
    """What it does (a row of the guide's table, in Markdown)."""
    parse: Callable[[str], Any]
    """Text (stripped, not empty) -> value; raises ``ValueError(what it must be)``."""


def _flag(text: str) -> bool:
    word = text.lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError("0 or 1 (also false/true, no/yes, off/on)")


def _number(text: str, what: str, *, low: float, above: bool = True) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(what) from None
    if not math.isfinite(value) or value < low or (above and value == low):
        raise ValueError(what)
    return value


def _seconds(text: str) -> float:
    return _number(text, "a number of seconds > 0", low=0.0)


def _mib(text: str) -> float:
    return _number(text, "a number of MiB > 0 (fractions allowed)", low=0.0)


def _int(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"an int >= {low}") from None
        if value < low:
            raise ValueError(f"an int >= {low}")
        return value
    return parse


def _choice(*words: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in words:
            raise ValueError("one of " + ", ".join(words))
        return text.lower()
    return parse


def _port_range(text: str) -> range:
    what = "a port range LO-HI (e.g. 29400-29499) with 1 <= LO <= HI <= 65535"
    low, dash, high = text.partition("-")
    try:
        lo, hi = int(low), int(high if dash else low)
    except ValueError:
        raise ValueError(what) from None
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(what)
    return range(lo, hi + 1)


def _text(text: str) -> str:
    return text


def _lower(text: str) -> str:
    return text.lower()


#: Every variable the library reads, in the order the guide lists them.
VARIABLES: tuple[Variable, ...] = (
    Variable("AXONDIST_BACKEND", "backend", None,
             "the backend `init()` picks (`mock`, `mpi`, `nccl`, or one added with "
             "`axondist.register_backend`)", _lower),
    Variable("AXONDIST_TIMEOUT", "timeout", 600.0,
             "seconds any call may wait for its peers before it fails (mock) or the job ends "
             "(MPI, NCCL), on every backend (default 600, torch's default for NCCL; also "
             "`init(timeout=...)`, `spawn(..., timeout=...)`)", _seconds),
    Variable("AXONDIST_STALL_WARNING", "stall_warning", 60.0,
             "seconds before the first stall warning, repeated at that interval (default 60, "
             "at most half the timeout)", _seconds),
    Variable("AXONDIST_CHECKS", "checks", True,
             "`0` is **unsafe**: turns off the check that every rank calls the same collective "
             "with the same arguments (one small exchange per MPI call, which the data of a "
             "small all-reduce rides in a group of two); a mismatch then hangs or returns "
             "wrong numbers", _flag),
    Variable("AXONDIST_DEBUG", "debug", False,
             "`1` also compares every argument by name with a pickled all-gather per call "
             "(slower; the messages name every differing argument)", _flag),
    Variable("AXONDIST_FLIGHT_RECORDER", "flight_recorder", 256,
             "how many recent calls each rank's flight recorder keeps (default 256)", _int(1)),
    Variable("AXONDIST_LOG_LEVEL", "log_level", None,
             "adds a handler to the `axondist` logger at this level (`INFO`, `DEBUG`...); "
             "unset, axondist logs through whatever the script set up "
             "([Launching](launching.md))", _text),
    Variable("AXONDIST_MAX_GROUPS", "max_groups", None,
             "the most groups made by `new_group` that may be alive at once on a rank (unset: "
             "as many as the backend allows)", _int(0)),
    Variable("AXONDIST_PIECE_MB", "piece_mb", None,
             "MPI: MiB per piece of a persistent all-reduce (DDP's OVERLAPPED pieces; default "
             "2; see [MPI on one machine](#mpi-on-one-machine))", _mib),
    Variable("AXONDIST_MPI_CHUNK_BYTES", "mpi_chunk_bytes", None,
             "MPI: the size of the pieces big all-reduces go in, where the algorithm table "
             "sends them in pieces (default 2 MiB in a group on one node, whole across nodes; "
             "0: never in pieces)", _int(0)),
    Variable("AXONDIST_MPI_SHARED_BUFFERS", "mpi_shared_buffers", True,
             "MPI, two ranks on one host: DDP's buckets and FSDP's gradient packing in memory "
             "both ranks map, each rank combining its half in place (`0`: ordinary memory, "
             "through MPI)", _flag),
    Variable("AXONDIST_MPI_HOST_STAGING", "mpi_host_staging", "auto",
             "MPI with CuPy arrays: `auto` (through host memory when the MPI library is not "
             "CUDA-aware), `always` or `never`", _choice("auto", "always", "never")),
    Variable("AXONDIST_DIAGNOSTICS", "diagnostics", "auto",
             "MPI and torch: the address the watchdog's diagnostics server binds, and on torch "
             "each group's own sockets too, which carry its check and its collectives of host "
             "memory (`auto`: the loopback when every rank is on this host, else the host's "
             "address; `off`: no server, only the timeout ends a wait, and torch's check and "
             "collectives are gloo's)", _text),
    Variable("AXONDIST_DIAGNOSTICS_PORTS", "diagnostics_ports", None,
             "MPI and torch: the port range `LO-HI` that server (and torch's group sockets, "
             "while a group is made) may take (a firewall's open range; default: any free "
             "port)", _port_range),
    Variable("AXONDIST_CUT_OFF_TIMEOUT", "cut_off_timeout", 30.0,
             "MPI: seconds without an answer from any rank of a peer's host before that host "
             "counts as cut off and the job ends (default 30)", _seconds),
    Variable("AXONDIST_TRACE", "trace", None,
             "a folder: every rank records its calls and spans there from the world's start "
             "(`python -m axondist trace DIR` reads it)", _text),
    Variable("AXONDIST_TRACE_MB", "trace_mb", 64.0,
             "MiB of trace kept per rank (default 64)", _mib),
    Variable("AXONDIST_TUNE_FILE", "tune_file", None,
             "where `python -m axondist tune` writes its settings and `tuned_ddp_options` "
             "reads them (default `axondist-tune.json` here; [multi-host](multi-host.md))",
             _text),
    Variable("AXONDIST_RESTART_COUNT", "restart_count", 0,
             "set by `axondist run --max-restarts` for the script to read: 0 on the first "
             "launch, then 1, 2... ([Launching](launching.md))", _int(0)),
    Variable("AXONDIST_RUN_DIR", "run_dir", None,
             "set by `axondist run` for its ranks: the folder where they leave their reports "
             "(not for users to set)", _text),
    Variable("AXONDIST_CHECKPOINT_FAULT", "checkpoint_fault", None,
             "a test hook: `KIND:K` makes this process's K-th checkpoint file step fail as "
             "KIND says (`kill`, `kill-tmp`, `enospc`, `erofs`, `pause`); never set it in "
             "training", _text),
    Variable("AXONDIST_CHECKPOINT_RELEASE", "checkpoint_release", None,
             "the test hook's `pause` waits until the file this names exists", _text),
)

#: The variables by name.
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}

#: Knobs of the project's own test suite and benchmarks, which the library never reads;
#: declared so that setting one is not reported as a misspelling. Any name that starts with
#: ``AXONDIST_TEST`` is the suite's too.
TEST_KNOBS: dict[str, str] = {
    "AXONDIST_COLLECTED_TESTS": "tests: the file the coverage table's collection is written to",
    "AXONDIST_FAIL_RANKS": "fault tests: the ranks a fault script makes fail",
    "AXONDIST_FAULT_GROUPS": "fault tests: the groups a fault script builds",
    "AXONDIST_FAULT_PARALLEL": "fault tests: how many fault scripts run at once",
    "AXONDIST_MPI_LAUNCH_TIMEOUT": "tests: seconds one mpiexec launch of the world suite may take",
    "AXONDIST_MPI_TEST_EXAMPLES": "tests: hypothesis examples per test under mpiexec",
    "AXONDIST_RANK_REPORT_DIR": "tests: where each launched rank of the world suite reports",
    "AXONDIST_TORCH_TEST_EXAMPLES": "tests: hypothesis examples per test under torchrun",
}
TEST_PREFIX = "AXONDIST_TEST"


class Settings(NamedTuple):
    """The values of every variable of :data:`VARIABLES`, read at once (see :func:`load`).

    An immutable record (a named tuple rather than a frozen dataclass: it is made at every
    ``import axondist``, and a dataclass of 21 fields compiles six methods there)."""

    backend: str | None = None
    """``AXONDIST_BACKEND``: the backend name, lower case; None lets ``init`` choose."""
    timeout: float = 600.0
    """``AXONDIST_TIMEOUT``: seconds a call may wait for its peers."""
    stall_warning: float = 60.0
    """``AXONDIST_STALL_WARNING``: seconds before the first stall warning."""
    checks: bool = True
    """``AXONDIST_CHECKS``: the cross-rank argument check runs."""
    debug: bool = False
    """``AXONDIST_DEBUG``: every argument is compared by name."""
    flight_recorder: int = 256
    """``AXONDIST_FLIGHT_RECORDER``: calls each rank's flight recorder keeps."""
    log_level: str | None = None
    """``AXONDIST_LOG_LEVEL``: the level of the handler :mod:`axondist.log` adds."""
    max_groups: int | None = None
    """``AXONDIST_MAX_GROUPS``: the most live groups on a rank (None: no limit of ours)."""
    piece_mb: float | None = None
    """``AXONDIST_PIECE_MB``: MiB per piece of a persistent MPI all-reduce."""
    mpi_chunk_bytes: int | None = None
    """``AXONDIST_MPI_CHUNK_BYTES``: bytes per piece of a big MPI all-reduce."""
    mpi_shared_buffers: bool = True
    """``AXONDIST_MPI_SHARED_BUFFERS``: a pair of ranks on one host shares DDP's buckets
    and FSDP's gradient packing."""
    mpi_host_staging: str = "auto"
    """``AXONDIST_MPI_HOST_STAGING``: ``auto``, ``always`` or ``never``."""
    diagnostics: str = "auto"
    """``AXONDIST_DIAGNOSTICS``: ``auto``, ``off`` or the address to bind."""
    diagnostics_ports: range | None = None
    """``AXONDIST_DIAGNOSTICS_PORTS``: the ports the diagnostics server may take."""
    cut_off_timeout: float = 30.0
    """``AXONDIST_CUT_OFF_TIMEOUT``: seconds of silence before a host counts as cut off."""
    trace: str | None = None
    """``AXONDIST_TRACE``: the trace folder (None: no trace from the start)."""
    trace_mb: float = 64.0
    """``AXONDIST_TRACE_MB``: MiB of trace kept per rank."""
    tune_file: str | None = None
    """``AXONDIST_TUNE_FILE``: the tuning file (None: ``axondist-tune.json`` here)."""
    restart_count: int = 0
    """``AXONDIST_RESTART_COUNT``: how often ``axondist run`` restarted the job."""
    run_dir: str | None = None
    """``AXONDIST_RUN_DIR``: the run folder of the ``axondist run`` that started this rank."""
    checkpoint_fault: str | None = None
    """``AXONDIST_CHECKPOINT_FAULT``: the checkpoint test hook's fault."""
    checkpoint_release: str | None = None
    """``AXONDIST_CHECKPOINT_RELEASE``: the file the hook's pause waits for."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Every variable read from ``environ`` (``os.environ`` when None).

        Raises:
            ValueError: one or more values are bad; the message names each variable, what
                it must be, and how to fix it.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        bad: list[str] = []
        for var in VARIABLES:
            try:
                values[var.field] = _parse(var, env)
            except ValueError as exc:
                bad.append(str(exc))
        if bad:
            raise ValueError("; ".join(bad))
        return cls(**values)


def _parse(var: Variable, env: Mapping[str, str]) -> Any:
    text = env.get(var.name, "").strip()
    if not text:
        return var.default
    try:
        return var.parse(text)
    except ValueError as exc:
        default = "no value" if var.default is None else f"{_shown(var.default)}"
        raise ValueError(f"{var.name}={text!r} must be {exc}; set it so, or unset it for "
                         f"the default ({default})") from None


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the declared variable ``name`` in ``environ`` (``os.environ`` when None),
    through its one reader (:class:`Settings` holds them all).

    Raises:
        ValueError: a bad value (the message names the variable and what to do).
        KeyError: ``name`` is not declared in :data:`VARIABLES`.
    """
    return _parse(BY_NAME[name], os.environ if environ is None else environ)


def unknown_names(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The ``AXONDIST_*`` names in ``environ`` that are neither variables nor test knobs,
    each with the nearest declared name (None when none is near)."""
    env = os.environ if environ is None else environ
    unknown = [name for name in env if name.startswith(PREFIX) and name not in BY_NAME
               and name not in TEST_KNOBS and not name.startswith(TEST_PREFIX)]
    if not unknown:
        return {}
    import difflib  # only for a misspelling: start-up pays nothing for it

    # Compared without the shared prefix, which would make every name look near.
    known = {name[len(PREFIX):]: name for name in [*BY_NAME, *TEST_KNOBS]}
    found: dict[str, str | None] = {}
    for name in unknown:
        near = difflib.get_close_matches(name[len(PREFIX):], known, n=1, cutoff=0.6)
        found[name] = known[near[0]] if near else None
    return found


def warn_unknown(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Warn (a ``RuntimeWarning``) about each name :func:`unknown_names` finds; returns them."""
    found = unknown_names(environ)
    for name, near in sorted(found.items()):
        hint = f"did you mean {near}?" if near else "no axondist setting has a similar name"
        warnings.warn(f"axondist: the environment variable {name} is not an axondist setting "
                      f"and is ignored; {hint} (the list: docs/guide.md, Environment "
                      "variables)", RuntimeWarning, stacklevel=_caller_level())
    return found


def _caller_level() -> int:
    """The ``stacklevel`` that makes a warning from :func:`warn_unknown` name the first frame
    outside axondist (the script's ``init()`` or ``spawn()`` line)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1  # warn_unknown's own frame is level 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of a world being made: every variable read (a bad one raises here, before
    any rank waits for another), and each unknown ``AXONDIST_*`` name warned about (Python's
    warning filter shows each text once per process).

    Raises:
        ValueError: a bad value (the message names each variable and what to do).
    """
    settings = Settings.from_environ(environ)
    warn_unknown(environ)
    return settings


def markdown_table() -> str:
    """The guide's table of variables, one row per declared variable."""
    rows = ["| variable | effect |", "| --- | --- |"]
    rows += [f"| `{v.name}` | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)


__all__ = ["BY_NAME", "PREFIX", "TEST_KNOBS", "TEST_PREFIX", "VARIABLES", "Settings",
           "Variable", "load", "markdown_table", "read", "unknown_names", "warn_unknown"]


if __name__ == "__main__":
    print(markdown_table())
