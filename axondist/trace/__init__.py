"""One timeline of every rank: record each rank's calls and spans, then read them together.

:func:`start` (or ``AXONDIST_TRACE=DIR`` from the world's start) makes every
rank append its calls, as its flight recorder sees them end, and the spans
of :func:`trace_span` to its own file in the folder; :func:`stop` ends it.
Both measure the ranks' clock offsets by a ping exchange. ``python -m axondist
trace DIR`` turns the folder into a Perfetto JSON, a PNG and a straggler
report (:mod:`axondist.trace.timeline`, :mod:`axondist.trace.report`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from ..backends import settings
from ..backends.recording.recorder import describe_detail
from ..backends.recording.trace_file import TraceWriter
from ..process_group import ProcessGroup, peek_world, resolve_group
from . import clock
from .report import format_report, straggler_report
from .timeline import read_timeline


def _recorder(group: ProcessGroup | None, what: str) -> tuple[Any, Any]:
    g = resolve_group(group)
    backend = g.backend_for(what)
    recorder = backend.recorder
    if recorder is None:
        raise ValueError(f"{what}: the {backend.name} backend keeps no flight recorder, so its "
                         "calls cannot be traced; use the mock, mpi or nccl backend")
    return backend, recorder


def _sync_clock(backend: Any, recorder: Any, writer: TraceWriter, phase: str) -> None:
    """Measure the clock offset with the writer detached (the pings are not traced); the
    ranks leave together (rank 0 answers them in turn: the first would start ahead)."""
    recorder.sink = None
    try:
        writer.clock(clock.exchange(backend).as_record(phase))
        backend.barrier()
    finally:
        recorder.sink = writer if phase == "start" else None


def start(directory: str | os.PathLike[str] | None = None, *, max_mb: float | None = None,
          group: ProcessGroup | None = None) -> str:
    """Start tracing this rank's calls into ``directory``; every rank of the world calls it.

    Each rank writes ``rank-NNNNN.jsonl`` there (and ``rank-NNNNN.old.jsonl``
    once it passes half of ``max_mb``). The ranks' clock offsets are measured
    first by a ping exchange. Under ``AXONDIST_TRACE`` the rank already
    traces into that folder; ``start()`` then only measures the clocks.

    Args:
        directory: the trace folder; None: ``AXONDIST_TRACE``.
        max_mb: MiB of trace kept per rank (``AXONDIST_TRACE_MB``, default 64).
        group: the world (the current one when None).

    Returns:
        This rank's trace file.

    Raises:
        ValueError: no folder given and ``AXONDIST_TRACE`` unset, or a size <= 0.
    """
    backend, recorder = _recorder(group, "trace.start")
    if directory is None:
        directory = settings.read("AXONDIST_TRACE")
        if directory is None:
            raise ValueError("trace.start: give a folder, start(directory), or set "
                             "AXONDIST_TRACE=DIR")
    if max_mb is not None and not max_mb > 0:
        raise ValueError(f"trace.start: max_mb must be > 0, got {max_mb!r}")
    writer = recorder.sink
    if not (isinstance(writer, TraceWriter)
            and os.path.abspath(writer.directory) == os.path.abspath(directory)):
        if isinstance(writer, TraceWriter):
            writer.close()
        max_bytes = None if max_mb is None else int(max_mb * (1 << 20))
        writer = TraceWriter(os.fspath(directory), recorder, max_bytes, describe_detail)
    _sync_clock(backend, recorder, writer, "start")
    return writer.path


def stop(group: ProcessGroup | None = None) -> str | None:
    """Stop tracing and close this rank's file; every rank of the world calls it.

    The clock offsets are measured again (a linear drift between the two
    exchanges is corrected when the trace is read).

    Returns:
        This rank's trace file; None when it was not tracing.
    """
    backend, recorder = _recorder(group, "trace.stop")
    writer = recorder.sink
    if not isinstance(writer, TraceWriter):
        return None
    _sync_clock(backend, recorder, writer, "stop")
    writer.close()
    return writer.path


def is_tracing(group: ProcessGroup | None = None) -> bool:
    """Whether this rank writes a trace now."""
    return _writer(group) is not None


def _writer(group: ProcessGroup | None = None) -> TraceWriter | None:
    """The rank's trace writer; None when it does not trace (or has no world yet)."""
    world = peek_world() if group is None else group
    backend = None if world is None else world.backend
    sink = getattr(getattr(backend, "recorder", None), "sink", None)
    return sink if isinstance(sink, TraceWriter) else None


@contextlib.contextmanager
def trace_span(name: str) -> Iterator[None]:
    """Mark the code inside ``with trace_span("forward"):`` on this rank's timeline.

    A span costs two clock reads while tracing and nothing otherwise; spans
    nest. They show on their own track, under the rank's calls.
    """
    writer = _writer()
    if writer is None:
        yield
        return
    begin = time.monotonic()
    try:
        yield
    finally:
        writer.span(name, begin, time.monotonic())


__all__ = ["format_report", "is_tracing", "read_timeline", "start", "stop", "straggler_report",
           "trace_span"]
