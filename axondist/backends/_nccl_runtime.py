"""The NCCL backend's machinery: loading CuPy, NCCL error wrapping, groups, Work handles.

See :mod:`axondist.backends.nccl` for how they fit together. Nothing here
imports CuPy at module level.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailableError
from ._nccl_types import GroupedCallError, NcclError, missing_cupy_message, nccl_error
from .base import Work

if TYPE_CHECKING:
    from ._nccl_backend import NcclBackend


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
            "pip install nvidia-nccl-cu12 (or: python -m cupyx.tools.install_library "
            "--library nccl --cuda 12.x)")
    return cupy, nccl


def device_count(cupy: ModuleType) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError without a driver
        raise BackendUnavailableError(
            f"the nccl backend needs a CUDA GPU, but CUDA reports none ({exc}); check the driver "
            "with nvidia-smi and CUDA_VISIBLE_DEVICES") from exc


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
    __slots__ = ("backend", "work", "post", "blocking")

    def __init__(self, backend: NcclBackend, work: NcclWork, post: Callable[[], Any] | None,
                 blocking: bool) -> None:
        self.backend, self.work, self.post, self.blocking = backend, work, post, blocking


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
            p.backend._start(p.work, p.post)
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
    """Handle of one NCCL operation: an event recorded after it on the backend's stream."""

    __slots__ = ("_backend", "_op", "_result", "_keep", "_event", "_done", "_error")

    def __init__(self, backend: NcclBackend, op: str, result: Any, keep: tuple[Any, ...]) -> None:
        self._backend = backend
        self._op = op
        self._result = result
        self._keep: tuple[Any, ...] | None = keep  # buffers stay alive until completion
        self._event: Any = None
        self._done = False
        self._error: BaseException | None = None

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._keep = None

    def wait(self, timeout: float | None = None) -> Any:
        """Block the host until the operation completed; return its result.

        Args:
            timeout: seconds (the backend's timeout when None).

        Raises:
            CollectiveTimeoutError: not completed in time (peers missing).
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
        self._backend._wait_event(self._event, self._op, timeout)
        self._done, self._keep = True, None
        return self._result

    def is_completed(self) -> bool:
        """True once the GPU finished the operation (never blocks)."""
        if self._done or self._error is not None:
            return True
        return self._event is not None and bool(self._event.done)

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (the current stream when None) wait for the operation, on the GPU.

        The host does not block; work queued on ``stream`` afterwards sees the result.
        """
        if self._error is not None:
            raise self._error
        if self._event is None:
            raise GroupedCallError(f"{self._op}: wait_stream() before the grouped() block ended")
        cupy = self._backend._cupy
        with cupy.cuda.Device(self._backend.device):
            (stream or cupy.cuda.get_current_stream()).wait_event(self._event)


class WorldLink:
    """Shared by the backends of one :meth:`NcclBackend.create_world`: the abort flag."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def abort(self, rank: int, exc: BaseException) -> None:
        if self.reason is None:
            self.reason = f"rank {rank} failed with {type(exc).__name__}: {exc}"
