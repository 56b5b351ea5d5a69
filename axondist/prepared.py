"""Collectives prepared once and run many times (as MPI's persistent requests).

:func:`prepare` finds the plan of a call once; the :class:`PreparedCall` it returns runs
that plan on buffers like the one it was prepared with, checking only that they match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _array
from ._frameworks import any_framework
from ._validate import as_rank
from .backends.plan import CallKey, Plan
from .comm import in_callers_framework
from .errors import InvalidBufferError
from .ops import ReduceOp
from .process_group import ProcessGroup, resolve_group


class PreparedCall:
    """A collective prepared once and run many times on buffers like the one it was
    prepared with (as MPI's persistent requests): the per-call cost of finding the plan
    is gone, and each run checks only that the buffers match.

    Made by :func:`prepare`; call it as ``prepared(x)`` (``prepared(x, out)`` for the
    collectives that take an ``out``) with the arguments of the collective it stands for.
    """

    __slots__ = ("plan", "_dtype", "_shape")

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._dtype, self._shape = plan.key.dtype, plan.key.shape

    def __call__(self, x: Any, out: Any = None) -> Any:
        """Run the prepared call on ``x`` (of the prepared dtype and shape).

        A torch tensor or JAX array gives its result in its framework, as the
        collective would.

        Raises:
            InvalidBufferError: ``x`` differs from the array the call was prepared with.
        """
        if type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray):
            if any_framework(x, out):
                return in_callers_framework(self, x, out=out, in_place=self.plan.key.collective
                                            in ("all_reduce", "broadcast"))
        if x.dtype != self._dtype or x.shape != self._shape or _array.layout_of(x)[1] != "ok":
            raise InvalidBufferError(
                f"prepared {self.plan.key.collective}: got {_array.describe(x)}, prepared for "
                f"a writable, C-contiguous {self._dtype}{list(self._shape)} "
                f"({self.plan.key.library}); prepare a call for this array instead")
        return self.plan.run(x, out)

    def __repr__(self) -> str:
        return f"PreparedCall({self.plan!r})"


def prepare(collective: str, x: Any, *, op: ReduceOp | str | None = None,
            group: ProcessGroup | None = None, src: int | None = None,
            sizes: Sequence[int] | None = None, async_op: bool = False) -> PreparedCall:
    """Prepare ``collective`` (``"all_reduce"``, ``"broadcast"``, ``"all_gather"``,
    ``"reduce_scatter"``) on arrays like ``x`` for many runs.

    Every rank prepares the same call; running it is then what calling the collective
    would be, minus finding its plan. ``all_gather`` needs ``sizes`` (the row counts the
    plan is for).

    Raises:
        ValueError: an unknown collective, or an all_gather without ``sizes``.
    """
    x = _array.as_array(x)
    if collective in ("all_reduce", "reduce_scatter"):
        key = CallKey.of(collective, x, reduce_op=ReduceOp.SUM if op is None else op,
                         async_op=async_op)
    elif collective == "broadcast":
        g = resolve_group(group)
        key = CallKey.of("broadcast", x, root=as_rank(src or 0, g.world_size, "prepare", "src"),
                         async_op=async_op)
    elif collective == "all_gather" and sizes is not None:
        rows = x.reshape(1) if x.ndim == 0 else x
        key = CallKey.of("all_gather", rows, counts=tuple(map(int, sizes)),
                         async_op=async_op)
    else:
        raise ValueError(f"prepare: collective={collective!r} cannot be prepared; use "
                         "all_reduce, broadcast, reduce_scatter, or all_gather with sizes=")
    return PreparedCall(resolve_group(group).backend_for(collective).plan(key))


__all__ = ["PreparedCall", "prepare"]
