"""The NCCL backend's machinery: loading CuPy, NCCL error wrapping, groups, Work handles,
and what one rank's backends share (flight recorder, watchdog), and the texts of a failed
cross-rank check.

See :mod:`axondist.backends.nccl` for how they fit together. Nothing here
imports CuPy at module level.
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankExitedError,
)
from ..base import Work, stall_warning_after
from ..checks import compare_signatures
from ..recording.recorder import CALL_FIELDS, FlightRecorder
from ..watchdog.watchdog import Watchdog, print_and_flush
from .basics import (
    GroupedCallError,
    NcclError,
    NcclUniqueId,
    missing_cupy_message,
    nccl_error,
)

if TYPE_CHECKING:
    from .communicator import Communicator


# --- loading CuPy --------------------------------------------------------------------

def load_cupy() -> tuple[ModuleType, ModuleType]:
    """``(cupy, cupy.cuda.nccl)``, or BackendUnavailableError saying what to install."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or CUDA libraries that fail to load
        raise BackendUnavailableError(missing_cupy_message(f"import cupy failed: {exc}")) from exc
    try:
        nccl = importlib.import_module("cupy.cuda.nccl")
    except Exception as exc:
        raise BackendUnavailableError(
            missing_cupy_message(f"import cupy.cuda.nccl failed: {exc}")) from exc
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        raise BackendUnavailableError(
            "the nccl backend: CuPy is installed but cannot load the NCCL library; "
            "pip install nvidia-nccl-cu13 for CUDA 13, nvidia-nccl-cu12 for CUDA 12 (the "
            "\"CUDA Version\" that nvidia-smi prints says which; or: python -m "
            "cupyx.tools.install_library --library nccl --cuda 13.x)")
    return cupy, nccl


def new_communicator(nccl: ModuleType, size: int, uid: NcclUniqueId, rank: int) -> Any:
    """``ncclCommInitRank`` through CuPy: ``NcclCommunicator(size, id, rank)``.

    CuPy 14 takes the id as its 128 raw bytes; earlier CuPy took a tuple of
    128 signed chars and refuses bytes with a TypeError raised before NCCL
    is called, so that form is the fallback.
    """
    try:
        return nccl.NcclCommunicator(size, uid.internal, rank)
    except TypeError:
        return nccl.NcclCommunicator(size, uid.to_cupy(), rank)


def device_count(cupy: ModuleType) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError without a driver
        raise BackendUnavailableError(
            f"the nccl backend needs a CUDA GPU, but CUDA reports none ({exc}); check the driver "
            "with nvidia-smi and CUDA_VISIBLE_DEVICES") from exc


def gpu_identity(cupy: ModuleType, device: int) -> str:
    """GPU ``device``'s UUID (``GPU-...``, as nvidia-smi -L prints it), else its PCI bus id:
    what names one physical GPU whatever ``CUDA_VISIBLE_DEVICES`` calls it."""
    try:
        props = cupy.cuda.runtime.getDeviceProperties(device)
    except Exception:  # noqa: BLE001 - the placement check then compares device ids
        return f"device {device}"
    uuid = props.get("uuid")
    if isinstance(uuid, (bytes, bytearray)) and any(uuid):
        h = bytes(uuid).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    return (f"PCI {int(props.get('pciDomainID', 0)):04x}:{int(props.get('pciBusID', 0)):02x}:"
            f"{int(props.get('pciDeviceID', 0)):02x}.0")


class NcclCall:
    """Context manager turning CuPy's NcclError into :class:`NcclError` naming ``op``."""

    __slots__ = ("_nccl", "_op", "_where")

    def __init__(self, nccl: ModuleType, op: str, where: str) -> None:
        self._nccl, self._op, self._where = nccl, op, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        error_class = getattr(self._nccl, "NcclError", None)
        if exc is not None and error_class is not None and isinstance(exc, error_class):
            raise nccl_error(self._op, exc, self._where) from exc


# --- groups ------------------------------------------------------------------------------

class PendingCall:
    """A call made inside :class:`group_calls`, started when the outermost group ends."""

    __slots__ = ("comm", "work", "post", "blocking")

    def __init__(self, comm: Communicator, work: NcclWork, post: Callable[[], Any] | None,
                 blocking: bool) -> None:
        self.comm, self.work, self.post, self.blocking = comm, work, post, blocking


class _GroupState(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.pending: list[PendingCall] = []


GROUP_STATE = _GroupState()


class group_calls:
    """Context manager: NCCL calls of this thread inside it launch together at its end.

    Wraps ``ncclGroupStart``/``ncclGroupEnd``; may be nested (the outermost
    block launches). When the block ends, each operation's completion event
    is recorded and blocking calls are waited for; async calls' Works can
    be waited on from then on.

    Raises (at the end of the block):
        NcclError: ``ncclGroupEnd`` failed (e.g. mismatched calls).
    """

    def __enter__(self) -> group_calls:
        _, self._nccl = load_cupy()
        with NcclCall(self._nccl, "grouped (ncclGroupStart)", "this thread"):
            self._nccl.groupStart()
        GROUP_STATE.depth += 1
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        GROUP_STATE.depth -= 1
        outermost = GROUP_STATE.depth == 0
        state = GROUP_STATE
        pending, state.pending = (state.pending, []) if outermost else ([], state.pending)
        try:
            with NcclCall(self._nccl, "grouped (ncclGroupEnd)", "this thread"):
                self._nccl.groupEnd()
        except NcclError as end_error:
            for p in pending:
                p.work._fail(end_error)
            if exc is None:
                raise
            return None
        for p in pending:  # the kernels are enqueued now: post-steps and events follow them
            p.comm.start(p.work, p.post)
        if exc is None:
            for p in pending:
                if p.blocking:
                    p.work.wait()
        return None


def require_no_group(what: str) -> None:
    if GROUP_STATE.depth:
        raise GroupedCallError(
            f"{what}: cannot run inside NcclBackend.grouped()/group_calls(), where no NCCL call "
            "has run yet; call it before or after the with-block")


# --- handles ------------------------------------------------------------------------------

class NcclWork(Work):
    """Handle of one NCCL operation: for an async call, an event recorded after it on the
    backend's stream; a blocking call's handle is complete when returned.

    Its flight-recorder entry is stamped done once the operation is seen complete
    (in :meth:`wait`, :meth:`is_completed`, when a later blocking call finds the stream
    idle, or when the backend's recorder is read).
    """

    __slots__ = ("_comm", "_op", "_result", "_keep", "_event", "_done", "_error", "_entry",
                 "_check")

    def __init__(self, comm: Communicator, op: str, result: Any, keep: tuple[Any, ...],
                 entry: Entry | None = None) -> None:
        self._comm = comm
        self._op = op
        self._result = result
        self._keep: tuple[Any, ...] | None = keep  # buffers stay alive until completion
        self._event: Any = None
        self._done = False
        self._error: BaseException | None = None
        self._entry = entry
        #: Settles the cross-rank check of an async call (raises on a mismatch).
        self._check: Callable[[float | None], None] | None = None

    def answering(self, result: Any) -> NcclWork:
        """This Work, its ``wait()`` returning ``result`` (the caller's array, where the plan
        ran on a flat view of it)."""
        self._result = result
        return self

    def _finish(self) -> None:
        """Completed (a blocking call whose stream the host saw idle): keep the result only."""
        self._done, self._keep = True, None
        self._record_end()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._keep = None
        self._record_end()

    def _record_end(self) -> None:
        if self._entry is not None:
            self._comm.state.finish(self._entry)
            self._entry = None

    def wait(self, timeout: float | None = None) -> Any:
        """Block the host until the operation completed; return its result.

        Args:
            timeout: seconds (the backend's timeout when None).

        Raises:
            CollectiveTimeoutError: not completed in time (peers missing); with
                the default timeout, the watchdog's report (the communicators
                are aborted then); with an explicit ``timeout``, the operation
                keeps running and ``wait`` may be called again.
            RankExitedError: a rank the operation needs has left.
            CollectiveMismatchError: the ranks disagree on the call (its
                check is settled here, before the data is waited for).
            NcclError: NCCL reported a failure of this communicator.
            GroupedCallError: called inside the ``grouped()`` block that
                issued it, before anything ran.
        """
        if self._done:
            return self._result
        if self._error is not None:
            raise self._error
        if self._event is None:
            raise GroupedCallError(
                f"{self._op}: wait() inside NcclBackend.grouped(): the group's operations start "
                "when the with-block ends; pass async_op=True and call wait() after the block")
        entry, state = self._entry, self._comm.state
        waiting = None
        if entry is not None and not entry.blocking and not self._event.done:
            waiting = state.begin(entry.group, entry.seq, f"wait {self._op}", None, True)
        try:
            if self._check is not None:
                self._check(timeout)
                self._check = None
            self._comm.wait_event(self._event, self._op, timeout)
        except CollectiveMismatchError as exc:
            self._fail(exc)
            raise
        finally:
            if waiting is not None:
                state.finish(waiting)
        self._finish()
        return self._result

    def is_completed(self) -> bool:
        """True once the GPU finished the operation (never blocks)."""
        if self._done or self._error is not None:
            return True
        if self._event is not None and bool(self._event.done):
            self._record_end()
            return True
        return False

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (the current stream when None) wait for the operation, on the GPU.

        The host does not block; work queued on ``stream`` afterwards sees the result.
        """
        if self._error is not None:
            raise self._error
        if self._event is None:
            if self._done:
                return  # a blocking call: complete on the GPU before it returned
            raise GroupedCallError(f"{self._op}: wait_stream() before the grouped() block ended")
        cupy = self._comm.cupy
        with cupy.cuda.Device(self._comm.device):
            (stream or cupy.cuda.get_current_stream()).wait_event(self._event)


# --- what one rank's backends share -----------------------------------------------------------

#: Seconds a launched process whose communicators the watchdog aborted keeps running (its
#: exception unwinds, a handler may save what it can) before it ends itself.
EXIT_AFTER_ABORT = 30.0


class Entry:
    """One call in the rank's flight recorder, until its completion is recorded."""

    __slots__ = ("group", "seq", "slot", "index", "blocking", "open")

    def __init__(self, group: str, seq: int, slot: int, index: int, blocking: bool) -> None:
        self.group, self.seq, self.slot, self.index = group, seq, slot, index
        self.blocking, self.open = blocking, True


def _pending(event: Any) -> bool:
    """Whether ``event`` has not completed (queried from the watchdog's thread; a query that
    fails counts as pending, so the abort goes ahead)."""
    try:
        return not event.done
    except Exception:  # noqa: BLE001 - e.g. a CUDA error on a wedged device
        return True


class RankState:
    """What the backends of one rank (its world and its sub-groups) share.

    The flight recorder, the watchdog (for more than one rank), the check
    switches read when the world was created, the rank's live communicators
    and, once the watchdog ended the rank's communication, its verdict: every
    wait then raises it.

    Args:
        rank: the rank in the world.
        world_size: ranks in the world.
        host: this host's name, for messages.
        timeout: seconds a call may wait for its peers.
        checks: run the cross-rank check before each collective.
        debug: compare every argument by name instead of a hash.
    """

    def __init__(self, rank: int, world_size: int, host: str, timeout: float, *,
                 checks: bool, debug: bool) -> None:
        self.recorder = FlightRecorder(rank, world_size, host)
        # The ring's size: an entry whose slot was reused since is not stamped at completion.
        capacity = len(self.recorder._slots)
        self._stamp_within = capacity - min(8, capacity // 4)
        self._counter = itertools.count()
        self._latest = -1
        self.timeout = timeout
        self.checks = checks
        self.debug = debug
        self.watchdog: Watchdog | None = None
        self.comms: list[Any] = []
        #: Events the rank's threads are polling now, by id (what a watchdog verdict is about).
        self.polling: dict[int, Any] = {}
        self.verdict: str | None = None
        self._verdict_kind: type[Exception] = CollectiveTimeoutError
        self._timed_out = False
        #: End the process :data:`EXIT_AFTER_ABORT` s after a watchdog abort (launched jobs).
        self.end_process = False

    # --- the flight recorder --------------------------------------------------------------
    def begin(self, group: str, seq: int, op: str, detail: Any, blocking: bool) -> Entry:
        """Record call ``seq`` of ``group`` as started (enqueued) now."""
        index = self._latest = next(self._counter)
        return Entry(group, seq, self.recorder.begin(group, seq, op, detail, blocking), index,
                     blocking)

    def finish(self, entry: Entry) -> None:
        """Record ``entry``'s call as completed (once; later calls do nothing)."""
        if not entry.open:
            return
        entry.open = False
        if self._latest - entry.index < self._stamp_within:
            self.recorder.end(entry.slot)
        if not entry.blocking:
            self.recorder.complete(entry.group, entry.seq)

    # --- the watchdog ---------------------------------------------------------------------
    def make_watchdog(self, token: str) -> Watchdog:
        """This rank's watchdog (started by the caller once every rank's address is known)."""
        self.watchdog = Watchdog(self.recorder, timeout=self.timeout,
                                 stall=stall_warning_after(self.timeout),
                                 abort=self._stopped_by_watchdog, token=token)
        return self.watchdog

    def _stopped_by_watchdog(self, message: str) -> None:
        """The watchdog's end, on its thread: abort this rank's communicators, so the call
        that waits returns and raises the verdict (NCCL cannot cancel a single call).

        A verdict about a call whose GPU work already completed (its thread had not
        noticed yet: a peer that sent, then left) is dropped; that rank's later waits
        still end at their own timeout.
        """
        if not any(_pending(event) for event in list(self.polling.values())):
            return
        waited = max((e["started_s_ago"] for e in self.recorder.running()), default=0.0)
        self._timed_out = waited >= self.timeout
        left = self.watchdog is not None and bool(self.watchdog.left)
        self._verdict_kind = (RankExitedError if left and not self._timed_out
                              else CollectiveTimeoutError)
        self.verdict = message
        self.abort_all()
        if self.end_process:
            timer = threading.Timer(EXIT_AFTER_ABORT, self._end_process)
            timer.daemon = True
            timer.start()

    def _end_process(self) -> None:
        rank, size = self.recorder.rank, self.recorder.world_size
        print_and_flush(f"[axondist rank {rank}/{size}] ",
                        f"{self.verdict}\nthe process did not end within {EXIT_AFTER_ABORT:g} s "
                        "of the abort: exiting")
        os._exit(1)

    def abort_all(self) -> None:
        """``ncclCommAbort`` every live communicator of this rank (from any thread)."""
        comms, self.comms = self.comms, []
        for comm in comms:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - an abort must reach every communicator
                continue

    def verdict_error(self, op: str, where: str) -> Exception:
        """The error a call of this rank raises once the watchdog ended its communication."""
        head = (f"{op}: not completed within {self.timeout:g} s on {where}" if self._timed_out
                else f"{op}: cannot complete on {where}")
        return self._verdict_kind(
            f"{head}; the watchdog aborted this rank's NCCL communicators (ncclCommAbort), "
            f"which cannot be used any more:\n{self.verdict}")

    def timeout_error(self, op: str, where: str, limit: float) -> CollectiveTimeoutError:
        """The error of a wait that ran past ``limit`` without a watchdog verdict."""
        return CollectiveTimeoutError(
            f"{op}: not completed within {limit:g} s on {where}; every rank of the group must "
            "make the same calls in the same order (NCCL_DEBUG=INFO shows where each rank is)"
            "\n" + self.recorder.last_calls())


# --- a failed cross-rank check -----------------------------------------------------------------

def named_signatures(calls: Sequence[tuple[str, tuple[Any, ...]]]
                     ) -> list[tuple[tuple[str, Any], ...]]:
    """Every rank's ``(op, key)`` as ``compare_signatures`` takes them, fields named by
    :data:`~axondist.backends.recording.recorder.CALL_FIELDS` (the raw key when names cannot tell
    the calls apart)."""
    named = [(("op", name),) + tuple(zip(CALL_FIELDS.get(name, ()), _printable(key)))
             for name, key in calls]
    if all(s == named[0] for s in named):
        return [(("op", name), ("key", repr(key))) for name, key in calls]
    return named


_FIELD = re.compile(r"(\w+)=(\[[^\]]*\]|[^,]*)")
_UNKNOWN = "unknown (its watchdog did not answer)"


def recorded_call(status: Any, group: str, seq: int) -> tuple[str, str, bool] | None:
    """``(op, detail text, blocking)`` of call ``seq`` of ``group`` in a peer's flight-recorder
    status (what its watchdog answered); None when it is not there."""
    if not isinstance(status, dict):
        return None
    for e in list(status.get("running") or []) + list(status.get("recent") or []):
        name = str(e.get("op", ""))
        if e.get("group") == group and e.get("seq") == seq and \
                not name.startswith(("wait ", "check ")):
            return name, str(e.get("detail", "")), bool(e.get("blocking", True))
    return None


def mismatch_error(op: str, calls: Sequence[tuple[str, str, bool] | None]
                   ) -> tuple[CollectiveMismatchError, bool]:
    """The error naming what differs between the ranks' calls (each as :func:`recorded_call`
    gives it, None when unknown), and whether a call was async or unknown."""
    signatures = [(("op", _UNKNOWN),) if c is None else
                  (("op", c[0]),) + tuple(_FIELD.findall(c[1])) + (("async_op", not c[2]),)
                  for c in calls]
    error = compare_signatures(op, signatures) or CollectiveMismatchError(
        f"{op}: the ranks' cross-rank check disagreed, though their recorded calls look alike: "
        + "; ".join(f"rank {k}: {c}" for k, c in enumerate(calls)))
    return error, any(c is None or not c[2] for c in calls)


def _printable(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(str(v) if isinstance(v, np.dtype) else list(v) if isinstance(v, tuple) else v
                 for v in key)


class WorldLink:
    """Shared by the backends of one :meth:`NcclBackend.create_world`: the abort flag."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def abort(self, rank: int, exc: BaseException) -> None:
        if self.reason is None:
            self.reason = f"rank {rank} failed with {type(exc).__name__}: {exc}"


__all__ = ["EXIT_AFTER_ABORT", "GROUP_STATE", "Entry", "NcclCall", "NcclWork", "PendingCall",
           "RankState", "WorldLink", "device_count", "gpu_identity",
           "group_calls", "load_cupy", "mismatch_error", "named_signatures",
           "new_communicator", "recorded_call", "require_no_group"]
