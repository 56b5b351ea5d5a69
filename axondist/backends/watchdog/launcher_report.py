"""The lines a rank sends to the ``axondist run`` that started it: ``"<MARK> rank event
fields..."`` on stderr, and in ``status.RANK`` under the run folder when the rank runs on the
launching host (hydra may drop an aborting job's last output; a file cannot be dropped).
The rank's entry (:mod:`axondist.launching.in_rank`) reports start and end; the watchdog
reports a peer that left without a word. Both write here, so the backends import nothing from
the launcher."""

from __future__ import annotations

import os
import sys

from .. import settings

#: The environment variable a launched script reads to know how often the job was restarted.
RESTART_COUNT_VAR = "AXONDIST_RESTART_COUNT"
#: The run folder of the launcher that started this rank (set only by ``axondist run``).
RUN_DIR_VAR = "AXONDIST_RUN_DIR"
#: Starts a line meant for the launcher only (never shown): "<MARK> rank event fields...".
MARK = "\x1eaxondist-run"


def report(rank: int, *fields: object) -> None:
    """Send ``rank event fields...`` to the launcher (a no-op for the reader of a plain job's
    stderr, which the launcher filters)."""
    line = " ".join([MARK, str(rank), *map(str, fields)]) + "\n"
    sys.stdout.flush()
    sys.stderr.write(line)
    sys.stderr.flush()
    run_dir = settings.read(RUN_DIR_VAR)
    if run_dir and os.path.isdir(run_dir):  # on the launching host only
        try:
            with open(os.path.join(run_dir, f"status.{rank}"), "a") as f:
                f.write(line)
        except OSError:
            pass


def report_lost(rank: int, lost: int, how: str) -> None:
    """Tell the launcher that rank ``lost`` left the job (``how``: what its peers saw), when
    ``axondist run`` started this rank: a rank that ends without a word (``os._exit``, a
    signal) cannot say so itself, and the launcher cannot tell it from the ranks killed in
    the clean-up."""
    if settings.read(RUN_DIR_VAR):
        report(rank, "lost", lost, " ".join(how.split()))


__all__ = ["MARK", "RESTART_COUNT_VAR", "RUN_DIR_VAR", "report", "report_lost"]
