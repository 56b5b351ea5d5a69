"""Exceptions raised by axondist.

Every error derives from :class:`AxondistError` and also from the built-in
exception a user would expect (``ValueError`` for bad arguments, ``TypeError``
for bad dtypes, ``TimeoutError`` for a collective that never completes), so
``except ValueError`` keeps working in code that does not know axondist.
"""

from __future__ import annotations


class AxondistError(Exception):
    """Base class of every axondist error."""


class CollectiveMismatchError(AxondistError, ValueError):
    """Ranks called a collective with incompatible arguments (shape, dtype, op, root)."""


class RankError(AxondistError, ValueError):
    """A rank (src, dst, root, member) is outside the group it was used with."""


class NotAMemberError(AxondistError, RuntimeError):
    """This process tried to communicate on a group it does not belong to."""


class InvalidBufferError(AxondistError, ValueError):
    """A buffer that must be written is read-only, non-contiguous or of the wrong size."""


class UnsupportedDTypeError(AxondistError, TypeError):
    """The array's dtype is not supported by this operation or backend."""


class CollectiveTimeoutError(AxondistError, TimeoutError):
    """A collective or receive did not complete within the group's timeout."""


class WorldAbortedError(AxondistError, RuntimeError):
    """Another rank failed, so this rank's pending communication was cancelled."""


class BackendUnavailableError(AxondistError, ImportError):
    """The requested backend's library is not installed or cannot start."""

__all__ = [
    "AxondistError",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "InvalidBufferError",
    "NotAMemberError",
    "RankError",
    "UnsupportedDTypeError",
    "WorldAbortedError",
]
