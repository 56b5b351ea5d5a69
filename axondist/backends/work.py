"""Handles of started operations: what ``async_op=True`` returns.

:class:`Work` is the contract (``wait`` and ``is_completed``); the classes here complete
it in the ways the backends need: already done, a future, a function applied after another
Work, or a request polled until it finishes.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from ..errors import CollectiveTimeoutError
from .recording.recorder import FlightRecorder


class Work:
    """Handle of an operation started with ``async_op=True``.

    ``wait()`` blocks until the operation finished and returns its result
    (the output array, or None); it re-raises the operation's error. Calling
    it again returns the same result.
    """

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finished; its result (the output array, or None).

        Args:
            timeout: seconds to wait at most; None waits until the
                operation ends (the mock and NCCL backends still stop it
                after their collective timeout).

        Raises:
            Exception: the operation's own error (a mismatch, a timeout of
                the collective, a backend failure), re-raised here; also a
                timeout error when ``timeout`` passes first (the operation
                keeps running: ``wait`` may be called again).
        """
        raise NotImplementedError

    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not); never blocks."""
        raise NotImplementedError


class CompletedWork(Work):
    """A Work whose operation already finished (what blocking calls return)."""

    __slots__ = ("_result",)

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def wait(self, timeout: float | None = None) -> Any:
        """The result given at construction, at once (``timeout`` is ignored)."""
        return self._result

    def is_completed(self) -> bool:
        """Always True."""
        return True


class FutureWork(Work):
    """A Work backed by a ``concurrent.futures.Future``; ``then`` maps its result."""

    __slots__ = ("_future", "_then", "_done", "_result", "what")

    def __init__(self, future: concurrent.futures.Future, then: Callable[[Any], Any] | None = None,
                 what: str = "the operation") -> None:
        self._future = future
        self._then = then
        self.what = what
        self._done = False
        self._result: Any = None

    def wait(self, timeout: float | None = None) -> Any:
        """The future's result passed through ``then`` (applied once, then cached).

        Raises:
            Exception: the future's error, re-raised on every call.
            CollectiveTimeoutError: ``timeout`` seconds passed first (the
                operation keeps running).
        """
        if not self._done:
            try:
                value = self._future.result(timeout)
            except concurrent.futures.TimeoutError:
                if self._future.done():  # the operation's own timeout error: raise it as is
                    raise
                raise CollectiveTimeoutError(
                    f"Work.wait: {self.what} did not complete within timeout={timeout:g} s; "
                    "it is still running (call wait() again, or check that every rank "
                    "issued it)") from None
            self._result = self._then(value) if self._then else value
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        """True once the future finished (``then`` may not have run yet)."""
        return self._future.done()


class ThenWork(Work):
    """A Work that runs ``then`` once, after ``inner`` completed, and returns its value."""

    __slots__ = ("_inner", "_then", "_value", "_done")

    def __init__(self, inner: Work, then: Callable[[Any], Any]) -> None:
        self._inner, self._then, self._value, self._done = inner, then, None, False

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for ``inner``, then return ``then``'s value (computed once)."""
        if not self._done:
            self._value = self._then(self._inner.wait(timeout))
            self._done = True
        return self._value

    def is_completed(self) -> bool:
        """True once ``inner`` completed (``then`` runs in :meth:`wait`)."""
        return self._done or self._inner.is_completed()


class PolledWork(Work):
    """A Work completed by polling: ``test()`` says, without blocking, whether the
    operation finished; ``block()`` waits for it.

    ``wait(timeout)`` polls until the deadline (sleeps growing to 1 ms);
    ``finish`` runs once after completion. With ``record=(recorder, group,
    seq)`` each wait is recorded in that flight recorder as call ``seq`` of
    ``group``, so the watchdog sees which call a waiting rank is in.
    """

    __slots__ = ("_test", "_block", "_result", "what", "_finish", "_record", "_done")

    def __init__(self, test: Callable[[], bool], block: Callable[[], Any], result: Any = None,
                 what: str = "the operation", finish: Callable[[], None] | None = None,
                 record: tuple[FlightRecorder, str, int] | None = None) -> None:
        self._test, self._block, self._result, self.what = test, block, result, what
        self._finish, self._record, self._done = finish, record, False

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the operation (at most ``timeout`` seconds); the result.

        Raises:
            CollectiveTimeoutError: ``timeout`` passed first (the operation keeps
                running: call ``wait`` again).
        """
        if self._done:
            return self._result
        slot = None
        if self._record is not None:
            recorder, group, seq = self._record
            slot = recorder.begin(group, seq, f"wait {self.what}", None)
        try:
            if timeout is None:
                self._block()
            else:
                deadline, pause = time.monotonic() + timeout, 1e-5
                while not self._test():
                    if time.monotonic() >= deadline:
                        raise CollectiveTimeoutError(
                            f"Work.wait: {self.what} did not complete within timeout="
                            f"{timeout:g} s; it is still running (call wait() again, or check "
                            "that every rank started it)")
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
        finally:
            if slot is not None:
                self._record[0].end(slot)  # type: ignore[index]
        self._complete()
        return self._result

    def is_completed(self) -> bool:
        """Test without blocking; runs ``finish`` when the operation just completed."""
        if not self._done and self._test():
            self._complete()
        return self._done

    def _complete(self) -> None:
        if not self._done:
            self._done = True
            if self._finish is not None:
                self._finish()


class MappedWork(Work):
    """A Work whose ``wait()`` returns ``result`` once ``inner`` completed."""

    __slots__ = ("_inner", "_result")

    def __init__(self, inner: Work, result: Any) -> None:
        self._inner, self._result = inner, result

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for ``inner``; the result given at construction."""
        self._inner.wait(timeout)
        return self._result

    def is_completed(self) -> bool:
        """True once ``inner`` completed."""
        return self._inner.is_completed()


def finished(work: Work, result: Any, async_op: bool) -> Any:
    """``result`` once ``work`` completed (blocking), or a Work whose ``wait()`` returns it."""
    if not async_op:
        work.wait()
        return result
    if isinstance(work, CompletedWork):
        return CompletedWork(result)
    return MappedWork(work, result)


__all__ = ["CompletedWork", "FutureWork", "MappedWork", "PolledWork", "ThenWork", "Work",
           "finished"]
