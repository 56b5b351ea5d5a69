"""Exceptions raised by axondist.

Every error derives from :class:`AxondistError` and also from the built-in
exception a user would expect (``ValueError`` for bad arguments, ``TypeError``
for bad dtypes, ``TimeoutError`` for a collective that never completes), so
``except ValueError`` keeps working in code that does not know axondist.
"""

from __future__ import annotations

from typing import Any


class AxondistError(Exception):
    """Base class of every axondist error."""


class CollectiveMismatchError(AxondistError, ValueError):
    """Ranks called a collective with incompatible arguments (shape, dtype, op, root)."""


class RankError(AxondistError, ValueError):
    """A rank (src, dst, root, member) is outside the group it was used with."""


class NotAMemberError(AxondistError, RuntimeError):
    """This process tried to communicate on a group it does not belong to."""


class TooManyGroupsError(AxondistError, RuntimeError):
    """``new_group`` could not make another group: too many are alive (never destroyed)."""


class InvalidBufferError(AxondistError, ValueError):
    """A buffer that must be written is read-only, non-contiguous or of the wrong size."""


class UnsupportedDTypeError(AxondistError, TypeError):
    """The array's dtype is not supported by this operation or backend."""


class CollectiveTimeoutError(AxondistError, TimeoutError):
    """A collective or receive did not complete within the group's timeout."""


class WorldAbortedError(AxondistError, RuntimeError):
    """Another rank failed, so this rank's pending communication was cancelled."""


class RankExitedError(WorldAbortedError):
    """A rank this call needs has left (its function returned, it called sys.exit, or its
    process ended) without making the call."""


class BackendUnavailableError(AxondistError, ImportError):
    """The requested backend's library is not installed or cannot start."""


class CheckpointError(AxondistError, ValueError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit its target."""


class ScheduleError(AxondistError, ValueError):
    """A pipeline schedule is malformed, inconsistent, or deadlocks.

    ``rank``, ``step`` and ``action`` locate the first offending action when
    there is one (``step`` is ``None`` for an action that is missing altogether);
    ``reason`` is the message without the location prefix. A deadlock
    additionally fills ``stuck``: rank -> the action that rank cannot start.
    """

    def __init__(self, reason: str, *, rank: int | None = None, step: int | None = None,
                 action: Any = None, stuck: dict[int, Any] | None = None) -> None:
        self.reason = reason
        self.rank = rank
        self.step = step
        self.action = action
        self.stuck = dict(stuck or {})
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if step is not None:
            where.append(f"step {step}")
        if action is not None:
            where.append(f"action {action}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {reason}" if prefix else reason)


class NonFiniteNormError(AxondistError, RuntimeError):
    """A gradient norm to clip by is NaN or inf and ``error_if_nonfinite`` was set."""


class NcclError(AxondistError, RuntimeError):
    """An NCCL call failed; the message names the operation and what to check.

    Attributes:
        op: the axondist operation that failed (``"all_reduce"``...).
        status: NCCL's ``ncclResult_t`` code, or None when unknown.
        status_name: its name (``"ncclRemoteError"``...).
    """

    def __init__(self, message: str, op: str = "", status: int | None = None,
                 status_name: str = "") -> None:
        super().__init__(message)
        self.op = op
        self.status = status
        self.status_name = status_name

    def __reduce__(self) -> Any:  # keep op/status when pickled across processes
        return (type(self), (str(self), self.op, self.status, self.status_name))


class NotOnDeviceError(AxondistError, TypeError):
    """An NCCL operation was given a host (NumPy) array or a non-array."""


class GroupedCallError(AxondistError, RuntimeError):
    """A call that needs the host to wait was made inside ``grouped()``."""


class RendezvousError(AxondistError, ConnectionError):
    """The rendezvous could not start (port taken) or a peer broke the protocol."""


class LaunchError(AxondistError, RuntimeError):
    """The job cannot start as launched: an env-style launch the backend cannot join, or no
    ``mpiexec`` to launch with."""


__all__ = [
    "AxondistError",
    "CheckpointError",
    "GroupedCallError",
    "LaunchError",
    "NcclError",
    "NonFiniteNormError",
    "NotOnDeviceError",
    "RendezvousError",
    "ScheduleError",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "InvalidBufferError",
    "NotAMemberError",
    "RankError",
    "RankExitedError",
    "TooManyGroupsError",
    "UnsupportedDTypeError",
    "WorldAbortedError",
]
