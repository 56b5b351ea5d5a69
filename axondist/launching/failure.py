"""How a failed ``axondist run`` job is told: which rank failed first and how
(:class:`RankFailure`, from the rank's own report, its launcher's, or what its peers saw), and
the summary the launcher prints."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field


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


def seen_leaving(how: str) -> tuple[str, int | None]:
    """The reason for a rank its peers' watchdog saw leave (``how``: what they saw), and its
    exit status when that says ``os._exit(N)``."""
    m = re.search(r"_exit\((\d+)\)", how)
    return (f"its peers saw it leave ({how})" if how else "its peers saw it leave",
            int(m[1]) if m else None)


#: Errors a rank raises because another rank failed or left (their class as reported).
CAUSED_BY_A_PEER = ("axondist.errors.WorldAbortedError", "axondist.errors.RankExitedError")


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


__all__ = ["CAUSED_BY_A_PEER", "RankFailure", "seen_leaving", "summary"]
