"""Training progress shown by rank 0 alone: a bar on a terminal, plain lines in logs, pipes and
under mpiexec (which forwards a rank's output through a pipe), nothing on the other ranks."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, Generic, TextIO, TypeVar

from .process_group import ProcessGroup, resolve_group

__all__ = ["MODES", "Progress", "progress", "resolve_mode", "stream_size", "stream_width"]

T = TypeVar("T")

#: How progress is shown: ``"auto"`` (a bar on a terminal, plain lines elsewhere), ``"bar"``,
#: ``"lines"`` or ``"off"``.
MODES = ("auto", "bar", "lines", "off")

MIN_BAR_WIDTH = 20
"""Columns below which a bar shows too little to be worth drawing: plain lines instead."""

_FALLBACK_COLUMNS = 80  # what a terminal that reports no width, or a pipe, is taken to be
_FALLBACK_LINES = 24


def resolve_mode(mode: bool | str | None, stream: TextIO, what: str = "progress") -> str:
    """The mode a :class:`Progress` on ``stream`` uses: ``"bar"``, ``"lines"`` or ``"off"``.

    Args:
        mode: one of :data:`MODES`; True and None mean ``"auto"``, False ``"off"``.
            ``"auto"`` is a bar when ``stream`` is a terminal, plain lines elsewhere.
        stream: where the progress goes.
        what: the caller's name, for the error message.

    Raises:
        ValueError: a mode not in :data:`MODES`.
    """
    if mode is None or mode is True:
        mode = "auto"
    elif mode is False:
        mode = "off"
    if mode not in MODES:
        raise ValueError(f"{what}: progress={mode!r} is not one of {', '.join(MODES)}")
    if mode == "auto":
        return "bar" if _is_terminal(stream) else "lines"
    return str(mode)


def _is_terminal(stream: TextIO) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def stream_size(stream: TextIO) -> tuple[int, int]:
    """Columns and lines available on ``stream``: a terminal's own size, else ``$COLUMNS``
    and ``$LINES``, else 80 x 24.

    A terminal that reports zero (some pseudo-terminals do before they are sized) counts as
    unknown, like a pipe: mpiexec forwards rank 0's output through one, and the terminal at
    its far end is not there to ask.
    """
    columns = lines = 0
    if _is_terminal(stream):
        try:
            columns, lines = os.get_terminal_size(stream.fileno())
        except (AttributeError, OSError, ValueError):
            pass
    if columns <= 0 or lines <= 0:
        import shutil  # here, not at the top: shutil loads bz2 and lzma into every job

        fallback = shutil.get_terminal_size((_FALLBACK_COLUMNS, _FALLBACK_LINES))
        columns = columns if columns > 0 else fallback.columns or _FALLBACK_COLUMNS
        lines = lines if lines > 0 else fallback.lines or _FALLBACK_LINES
    return columns, lines


def stream_width(stream: TextIO) -> int:
    """Columns available on ``stream`` (see :func:`stream_size`)."""
    return stream_size(stream)[0]


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.5f}"
        return f"{value:.4e}"
    return str(value)


class Progress(Generic[T]):
    """Training progress: ``update(step, loss=...)`` after each step, ``close()`` at the end.

    ``"bar"``: a tqdm bar as wide as the terminal (a zero-size terminal counts as 80 x 24;
    through a pipe, ``$COLUMNS`` or 80), redrawn in place and ended with a newline, so what is
    printed next starts on its own line; without tqdm, plain lines instead. ``"lines"``: a
    plain ``step 10/40  loss 0.12345`` line about every tenth of the run (every ``every``
    steps when the total is unknown), and the last step's line at ``close()``. ``"off"``:
    nothing. Iterating over a ``Progress`` made by :func:`progress` yields the iterable's
    items and counts a step as each one is finished. Also a context manager (closes on exit).

    Args:
        total: the number of steps, or None when unknown.
        stream: where the progress goes; sys.stdout when None, the stream ``print`` writes
            to: under mpiexec stdout and stderr reach the terminal through separate pipes, so
            a bar on stderr can end after (and run into) a line printed on stdout.
        mode: one of :data:`MODES` (True and None: ``"auto"``, False: ``"off"``).
        desc: the bar's label.
        every: steps between plain lines when ``total`` is unknown (with a total: a tenth).
        show: False silences this instance (the ranks other than 0).

    Raises:
        ValueError: an unknown ``mode``, a negative ``total`` or ``every`` below 1.
    """

    def __init__(self, total: int | None, *, stream: TextIO | None = None,
                 mode: bool | str | None = "auto", desc: str = "train", every: int = 100,
                 show: bool = True) -> None:
        if total is not None and int(total) < 0:
            raise ValueError(f"progress: total must be >= 0 or None, got {total!r}")
        if int(every) < 1:
            raise ValueError(f"progress: every must be >= 1, got {every!r}")
        self.stream: TextIO = stream if stream is not None else sys.stdout
        self.total = None if total is None else int(total)
        self.desc = desc
        chosen = resolve_mode(mode, self.stream)
        self.mode = chosen if show else "off"
        self.every = -(-self.total // 10) if self.total else int(every)  # ceil: <= 10 lines
        self.step = 0
        self.values: dict[str, Any] = {}
        self._iterable: Iterable[T] | None = None
        self._printed = 0  # the last step a plain line was printed for
        self._bar: Any = None
        if self.mode == "bar":
            width, lines = stream_size(self.stream)
            self._bar = _tqdm_bar(self.total, self.stream, desc, width, lines) \
                if width >= MIN_BAR_WIDTH else None
            if self._bar is None:
                self.mode = "lines"

    def note(self, **values: Any) -> None:
        """Values shown after the step count from the next update on (``note(loss=0.1)``)."""
        self.values.update(values)

    def update(self, step: int, **values: Any) -> None:
        """Record that ``step`` steps are done, with ``values`` (``loss=...``) to show."""
        self.values.update(values)
        self.step = step
        shown = "  ".join(f"{k} {_format_value(v)}" for k, v in self.values.items())
        if self._bar is not None:
            self._bar.ncols = stream_width(self.stream)  # follows a resized terminal
            self._bar.set_postfix_str(shown, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self.mode == "lines" and (step % self.every == 0 or step == self.total):
            self._line(shown)

    def _line(self, shown: str) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        self.stream.write(f"step {self.step}{of}" + (f"  {shown}" if shown else "") + "\n")
        self.stream.flush()
        self._printed = self.step

    def close(self) -> None:
        """End the display: the bar's line ends with a newline; in plain lines the last
        step is printed if it was not yet."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.mode == "lines" and self.step > self._printed:
            self._line("  ".join(f"{k} {_format_value(v)}" for k, v in self.values.items()))
        self.mode = "off"

    def __iter__(self) -> Iterator[T]:
        if self._iterable is None:
            raise TypeError("progress: this Progress counts steps given to update(); only "
                            "one made by axondist.progress(iterable) can be iterated over")
        try:
            for step, item in enumerate(self._iterable, self.step + 1):
                yield item
                self.update(step)
        finally:
            self.close()

    def __enter__(self) -> Progress[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def _tqdm_bar(total: int | None, stream: TextIO, desc: str, width: int, lines: int) -> Any:
    """A tqdm bar ``width`` columns wide on ``stream``, or None without tqdm. ``lines`` is
    passed on: on stdout tqdm asks the terminal itself, and a terminal of zero lines makes it
    draw nothing."""
    try:
        from tqdm import tqdm  # imported when a bar is drawn: start-up stays light
    except ImportError:
        return None
    counted = "{n_fmt}/{total_fmt}" if total is not None else "{n_fmt}"
    return tqdm(total=total, file=stream, desc=desc, unit="step", dynamic_ncols=False,
                ncols=width, nrows=lines, mininterval=0.1, leave=True,
                bar_format="{desc} {percentage:3.0f}%|{bar}| " + counted + "{postfix}"
                if total is not None else "{desc} " + counted + "{postfix}")


def progress(iterable: Iterable[T], *, total: int | None = None, desc: str = "train",
             mode: bool | str | None = "auto", stream: TextIO | None = None,
             every: int = 100, group: ProcessGroup | None = None) -> Progress[T]:
    """``iterable`` with progress shown by rank 0 of ``group`` alone.

    Yields the items on every rank; rank 0 shows a bar on a terminal and a plain line about
    every tenth of the run in a log, a pipe or under mpiexec. Call ``.note(loss=...)`` on the
    result to show values next to the count::

        for step in (bar := ad.progress(range(steps))):
            loss = train_step(step)
            bar.note(loss=loss)

    Args:
        iterable: what to iterate over.
        total: its length; ``len(iterable)`` when None and it has one.
        desc: the bar's label.
        mode: one of :data:`MODES` (True and None: ``"auto"``, False: ``"off"``).
        stream: where rank 0 shows progress; sys.stdout when None (see :class:`Progress`).
        every: steps between plain lines when the total is unknown.
        group: whose rank 0 shows it; the current world when None.

    Returns:
        A :class:`Progress` to iterate over; it closes when the loop ends or breaks.

    Raises:
        ValueError: an unknown ``mode``, a negative ``total`` or ``every`` below 1.
    """
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    shown = Progress[T](total, stream=stream, mode=mode, desc=desc, every=every,
                        show=resolve_group(group).rank == 0)
    shown._iterable = iterable
    return shown
