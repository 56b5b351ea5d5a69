"""The per-rank program of the launched world tests: ``python rank_pytest.py ARGS`` (under
``mpiexec`` or ``torchrun``) runs pytest with every failure's traceback printed the moment
it happens, and a failing rank ends the whole job at once (MPI's ``Abort``; under torchrun,
its own exit, at which torchrun stops the others). A rank whose tests passed prints
``pytest OK``.

A hypothesis test needs this most: after a failing example hypothesis shrinks and replays
it on the failing rank alone, whose collectives then find no partner (the others passed
the example and went on), so the job would hang without a word.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# Seconds a failing rank waits between printing its traceback and aborting the job.
OUTPUT_GRACE_S = 0.5


class _PrintFailuresNow:
    """A pytest plugin that prints a failing test's traceback the moment it fails.

    Under mpiexec the failing rank aborts the job in ``pytest_sessionfinish``, before
    pytest's summary would show the traceback; printed here, it survives the abort.
    A hypothesis test goes further: after a failing example hypothesis shrinks it and
    replays it, on the failing rank alone, so that rank's collectives find no partner
    (the others passed the example and went on) and the job hangs without a word. Its
    first failing example therefore prints the traceback and aborts the job at once.
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            handle = getattr(getattr(item, "obj", None), "hypothesis", None)
            if handle is not None and callable(getattr(handle, "inner_test", None)):
                handle.inner_test = self._abort_on_failure(item, handle.inner_test)

    @classmethod
    def _abort_on_failure(cls, item: pytest.Item, test: Any) -> Any:
        @functools.wraps(test)
        def run_example(*args: Any, **kwargs: Any) -> Any:
            try:
                return test(*args, **kwargs)
            except Exception as exc:
                # hypothesis's own signals (assume(), ...) are no failure; hypothesis is
                # loaded by then (imported here, pytest could not rewrite its asserts)
                if isinstance(exc, sys.modules["hypothesis.errors"].HypothesisException):
                    raise
                text = str(item.repr_failure(pytest.ExceptionInfo.from_exception(exc)))
                example = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
                capture = item.config.pluginmanager.getplugin("capturemanager")
                with capture.global_and_fixture_disabled():  # past pytest's capture
                    cls._print(f"{item.nodeid} failed (call), the job aborts now",
                               f"{text}\nfailing example on this rank: {example[:2000]}")
                    _abort(1, item.config)
                raise  # not reached: the abort ends this process

        return run_example

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self._print(f"{report.nodeid} failed ({report.when})", report.longreprtext)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._print(f"collecting {report.nodeid or 'the tests'} failed",
                        report.longreprtext)

    @staticmethod
    def _print(what: str, text: str) -> None:
        rank = os.environ.get("PMI_RANK", os.environ.get("RANK", "?"))
        print(f"\n--- rank {rank}: {what} ---\n{text}", file=sys.stderr, flush=True)


def _abort(status: int, config: pytest.Config) -> None:
    """End the whole job now (as ``tests/conftest.py`` does when a rank's session fails),
    removing the rank's temporary folder first (the session's own cleanup never runs)."""
    from rank_folders import remove_rank_folder  # tests/, on pytest's path by now

    from axondist._environment import launched_by_mpi
    from axondist.backends.watchdog.watchdog import silence_all

    remove_rank_folder(config.option.basetemp)
    silence_all()  # this rank fails the run: not a departure for the others to report
    sys.stdout.flush()
    sys.stderr.flush()
    # the text goes through this host's proxy to mpiexec, the abort by its own way, and
    # hydra orders neither: a short pause lets the text arrive first
    time.sleep(OUTPUT_GRACE_S)
    if not launched_by_mpi():
        os._exit(status)  # torchrun stops the other ranks
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(status)


#: A folder for each rank's JUnit report (``rank{R}.xml``): which tests passed on which rank,
#: and their seconds, for the launcher's checks (tests/world/launched_job.py).
REPORT_DIR_VARIABLE = "AXONDIST_RANK_REPORT_DIR"


def run_pytest(*args: str) -> None:
    """``python -m pytest ARGS`` with failures printed at once; exits with pytest's status."""
    report_dir = os.environ.get(REPORT_DIR_VARIABLE)
    if report_dir:
        rank = os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))
        args = (*args, f"--junit-xml={Path(report_dir) / f'rank{rank}.xml'}")
    status = pytest.main(list(args), plugins=[_PrintFailuresNow()])
    if status not in (0, 5):
        raise SystemExit(int(status))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # the checkout's axondist
    run_pytest(*sys.argv[1:])
    print("pytest OK", flush=True)
