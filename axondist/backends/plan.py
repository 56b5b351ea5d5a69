"""Prepared collective calls: what a call is (:class:`CallKey`) and how a backend runs it
(:class:`Plan`).

Every public collective builds the key of its call from its arguments (a pure function of
them), asks the group's backend for that key's plan (:meth:`Backend.plan`: a dict lookup
after the first call, which validates the key, chooses the algorithm and allocates what it
keeps), and runs the plan on the call's buffers. Plans live in their backend and die with
it. Each backend makes its own; the two here (a widened half-precision mean, an all-gather
that learns its row counts first) run through the backend's other plans, so any backend
may use them.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import _array
from .._validate import as_rank
from ..errors import CollectiveMismatchError, InvalidBufferError
from ..ops import ReduceOp, check_op_dtype
from ._rows import row_fingerprint, rows_mismatch
from .work import ThenWork

if TYPE_CHECKING:  # the backend contract imports this module
    from .base import Backend

Signature = tuple[tuple[str, Any], ...]

#: Collectives that write their result into the buffer they were given.
IN_PLACE = frozenset({"all_reduce", "broadcast", "reduce"})
#: Collectives whose key names a reduction.
REDUCTIONS = frozenset({"all_reduce", "reduce_scatter", "reduce"})
_FLOAT32 = np.dtype(np.float32)
_INT64 = np.dtype(np.int64)
_AVERAGE = ReduceOp.AVERAGE.name
_new_tuple = tuple.__new__


class CallKey(NamedTuple):
    """Everything that decides how a collective call runs, and nothing else: equal keys
    take the same plan. Every rank of a group must make its calls with equal keys (the
    backends check it), except ``counts``' own row, which only this rank knows."""

    collective: str
    dtype: Any
    shape: tuple[int, ...]
    #: ``"numpy"`` or ``"cupy"``.
    library: str
    #: ``"ok"``, ``"read-only"`` or ``"strided"``: whether the call may write the buffer.
    layout: str = "ok"
    #: A :class:`ReduceOp`'s name (``"SUM"``...) for reductions, else None.
    reduce_op: str | None = None
    #: The root (broadcast's ``src``, reduce's ``dst``...) as a group rank, else None.
    root: int | None = None
    #: Rows per rank (an all-gather's ``sizes``), or None where the call derives them.
    counts: tuple[int, ...] | None = None
    async_op: bool = False
    #: What the call was made from when it is part of another (a widened mean).
    variant: str = ""

    @classmethod
    def of(cls, collective: str, x: Any, *, reduce_op: ReduceOp | str | None = None,
           root: int | None = None, counts: tuple[int, ...] | None = None,
           async_op: bool = False) -> CallKey:
        """The key of ``collective`` on array ``x`` (a NumPy or CuPy array)."""
        # _name_: the enum's plain attribute, no property
        op = reduce_op._name_ if reduce_op.__class__ is ReduceOp else (
            None if reduce_op is None and collective not in REDUCTIONS
            else ReduceOp.parse(reduce_op, collective)._name_)
        library, layout = _array.layout_of(x)
        # tuple.__new__ straight: the generated NamedTuple.__new__ is a Python frame more
        return _new_tuple(cls, (collective, x.dtype, x.shape, library, layout, op, root,
                                counts, bool(async_op), ""))

    @property
    def op(self) -> ReduceOp | None:
        """The reduction as a :class:`ReduceOp` (None for a collective without one)."""
        return None if self.reduce_op is None else ReduceOp[self.reduce_op]

    def signature(self) -> tuple[tuple[str, Any], ...]:
        """The ``(field, value)`` pairs every rank must agree on, as mismatch messages and
        the flight recorder name them (the leading size of a call whose ranks pass
        different numbers of rows is left out: their counts say it)."""
        fields: list[tuple[str, Any]] = [("dtype", self.dtype)]
        if self.collective in _WHOLE_SHAPE:
            fields.append(("shape", self.shape))
        else:
            fields.append(("trailing shape", self.shape[1:]))
        if self.reduce_op is not None:
            fields.append(("reduce_op", self.reduce_op))
        if self.root is not None:
            fields.append(("root", self.root))
        if self.counts is not None and self.collective != "all_to_all":  # ranks' own
            fields.append(("counts", self.counts))
        elif self.collective == "all_gather":
            fields.append(("counts", "not given"))
        if self.variant:
            fields.append(("variant", self.variant))
        return tuple(fields)


#: Collectives whose ranks all pass the same shape.
_WHOLE_SHAPE = frozenset({"all_reduce", "broadcast", "reduce_scatter", "reduce", "scatter"})


class Plan:
    """A prepared call: :meth:`run` on buffers that match :attr:`key`.

    ``run(send, recv)`` returns the call's result (``send`` itself for in-place
    collectives, else ``recv``, allocated when None), or with ``key.async_op`` a Work
    whose ``wait()`` returns it. ``send`` has the key's shape on every rank, except: a
    scatter's is the root's whole array (None elsewhere, the key's shape being the
    whole's); a gather's result is None except on the root. Row counts (``key.counts``)
    are per rank in rank order; an all-to-all's are this rank's own: the rows it sends
    each rank, then the rows it receives from each. :meth:`free` releases what the plan
    keeps.
    """

    __slots__ = ("key",)

    def __init__(self, key: CallKey) -> None:
        self.key = key

    def run(self, send: Any, recv: Any = None) -> Any:
        """Run the call on ``send`` (and ``recv``); see the class docstring."""
        raise NotImplementedError

    def free(self) -> None:
        """Release what the plan keeps (nothing by default)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key.collective}, {self.key.dtype}, " \
               f"{list(self.key.shape)})"


def validate(key: CallKey, rank: int, world_size: int) -> None:
    """Raise the error that names what is wrong with a call of ``key`` (dtype, op,
    buffer, root, counts), as every backend's first step before planning it."""
    what = key.collective
    _array.check_dtype(key.dtype, what)
    if key.reduce_op is not None:
        check_op_dtype(ReduceOp[key.reduce_op], key.dtype, what)
    if key.layout != "ok" and what in IN_PLACE:
        raise InvalidBufferError(_LAYOUT_ERRORS[key.layout].format(what=what, shape=key.shape))
    if key.root is not None:
        as_rank(key.root, world_size, what, "dst" if what in ("reduce", "gather") else "src")
    if what in ("reduce_scatter", "all_gather", "gather", "scatter", "all_to_all") \
            and not key.shape:
        raise InvalidBufferError(f"{what}: a 0-d array has no axis to split; pass x[None]")
    if what == "reduce_scatter" and key.counts is not None and (
            len(key.counts) != world_size or sum(key.counts) != key.shape[0]):
        raise InvalidBufferError(
            f"reduce_scatter: counts={list(key.counts)} must list {world_size} row counts "
            f"adding up to the {key.shape[0]} rows of send")
    counts = key.counts
    if what in ("all_gather", "gather") and counts is not None and (
            len(counts) != world_size or counts[rank] != key.shape[0]):
        raise CollectiveMismatchError(
            f"{what}: sizes={list(counts)} must list {world_size} row counts with this "
            f"rank's ({key.shape[0]}) at index {rank}")
    if what == "gather" and counts is None:
        raise InvalidBufferError("gather: the key must hold every rank's row count")
    if what == "scatter" and counts is not None and (
            len(counts) != world_size or sum(counts) != key.shape[0]):
        raise InvalidBufferError(
            f"scatter: counts={list(counts)} must list {world_size} row counts adding up to "
            f"the {key.shape[0]} rows of the source's array")
    if what == "all_to_all" and (counts is None or len(counts) != 2 * world_size
                                 or sum(counts[:world_size]) != key.shape[0]):
        raise InvalidBufferError(
            f"all_to_all: counts must list the rows sent to each of the {world_size} ranks, "
            f"adding up to the {key.shape[0]} rows of send, then the rows received from each")


_LAYOUT_ERRORS = {
    "read-only": "{what}: the array is read-only; pass a writable array (e.g. x.copy())",
    "strided": "{what}: the array of shape {shape} is not C-contiguous, so it cannot be written "
               "in place; pass xp.ascontiguousarray(x) and use the returned array",
}


def split_sizes(length: int, parts: int) -> list[int]:
    """Rows per part when ``length`` rows split over ``parts`` (numpy.array_split rule)."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def element_counts(key: CallKey, world_size: int) -> list[int]:
    """Elements per rank of a call that splits or joins rows (``key.counts`` rows, else
    the :func:`split_sizes` rule over ``key.shape``)."""
    rows = key.counts if key.counts is not None else split_sizes(key.shape[0], world_size)
    row = prod(key.shape[1:])
    return [r * row for r in rows]


def output_shape(key: CallKey, rank: int, world_size: int) -> tuple[int, ...]:
    """The shape of the array a collective of ``key`` returns on ``rank`` (a gather's on
    its root)."""
    if key.collective in IN_PLACE:
        return key.shape
    trailing = tuple(key.shape[1:])
    if key.collective in ("all_gather", "gather"):
        return (sum(key.counts or ()),) + trailing
    if key.collective == "all_to_all":
        return (sum((key.counts or ())[world_size:]),) + trailing
    rows = key.counts if key.counts is not None else split_sizes(key.shape[0], world_size)
    return (rows[rank],) + trailing


def checked_out(out: Any, key: CallKey, shape: tuple[int, ...], what: str) -> Any:
    """``out`` when a collective of ``key`` may write its result of ``shape`` there, else
    the error naming why not."""
    if (type(out) is np.ndarray and out.flags.carray and out.shape == shape
            and out.dtype == key.dtype and key.library == "numpy"):
        return out  # the common case, kept cheap
    is_array = isinstance(out, np.ndarray) or _array.is_cupy(out)
    ok = (is_array and _array.library_name(out) == key.library and tuple(out.shape) == shape
          and out.dtype == key.dtype)
    if ok:
        flags = out.flags
        if not flags.c_contiguous or not flags.writeable:
            why = "not C-contiguous" if not flags.c_contiguous else "read-only"
            raise InvalidBufferError(
                f"{what}: out of shape {tuple(out.shape)} is {why}, so the result cannot be "
                "written into it; pass a writable, C-contiguous out, or no out")
    if not ok:
        got = _array.describe(out) if is_array else f"a {type(out).__name__}"
        raise InvalidBufferError(
            f"{what}: out is {got} but the result is {key.dtype}{list(shape)} ({key.library}); "
            "pass a writable, C-contiguous array of that shape, dtype and array library, "
            "or no out")
    return out


# --- plans every backend may use -----------------------------------------------------------

class WidenedMeanPlan(Plan):
    """AVERAGE of a float16/bfloat16 buffer: each rank's values are scaled by 1/n while
    widened to float32, summed in float32 and rounded once to the caller's dtype.

    Summing in the half dtype overflows as soon as the sum passes its largest value (65504
    for float16) even when the mean does not; dividing before a half sum underflows small
    values instead. float32 holds the scaled values of both without loss, at twice the
    bytes on the wire.
    """

    __slots__ = ("_wide", "_scale", "_out_shape", "_xp", "_writes")

    def __init__(self, backend: Backend, key: CallKey) -> None:
        super().__init__(key)
        wide_key = key._replace(dtype=_FLOAT32, reduce_op=ReduceOp.SUM.name,
                                variant=f"mean widened from {key.dtype}")
        self._wide = backend.plan(wide_key)
        self._scale = 1.0 / backend.world_size
        self._out_shape = output_shape(key, backend.rank, backend.world_size)
        self._xp = _array.module_named(key.library)
        #: Whether this rank gets the result (a reduce's others keep their values).
        self._writes = key.collective != "reduce" or backend.rank == key.root

    def run(self, send: Any, recv: Any = None) -> Any:
        key, xp = self.key, self._xp
        out = send if key.collective in IN_PLACE else (
            xp.empty(self._out_shape, dtype=key.dtype) if recv is None
            else checked_out(recv, key, self._out_shape, key.collective))
        wide = xp.multiply(send, self._scale, dtype=_FLOAT32)
        result = self._wide.run(wide)

        def narrow(value: Any) -> Any:
            if self._writes:
                out[...] = value  # one rounding, to the nearest value of out's dtype
            return out

        return ThenWork(result, narrow) if key.async_op else narrow(result)


class UnsizedAllGatherPlan(Plan):
    """An all-gather whose row counts no rank knows: the ranks first all-gather a small
    header (their row count and a fingerprint of dtype and trailing shape) through the
    backend's own plan for it, then the rows through the sized plan for those counts."""

    __slots__ = ("_backend", "_header", "_headers", "_header_plan")

    def __init__(self, backend: Backend, key: CallKey) -> None:
        super().__init__(key)
        self._backend = backend
        n = backend.world_size
        trailing = tuple(key.shape[1:])
        self._header = np.array((0,) + row_fingerprint(key.dtype, trailing), _INT64)
        self._headers = np.empty(4 * n, _INT64)
        self._header_plan: Plan | None = None
        if backend.host_collectives:
            self._header_plan = backend.plan(CallKey.of("all_gather", self._header,
                                                        counts=(4,) * n))

    def counts(self, rows: int) -> tuple[int, ...]:
        """Every rank's row count, given this rank's ``rows``."""
        return exchange_row_counts(self._backend, self.key, rows, self._header,
                                   self._headers, self._header_plan)

    def run(self, send: Any, recv: Any = None) -> Any:
        counts = self.counts(send.shape[0])
        sized = self._backend.plan(self.key._replace(counts=counts))
        return sized.run(send, recv)


def exchange_row_counts(backend: Backend, key: CallKey, rows: int, header: Any = None,
                        headers: Any = None, header_plan: Plan | None = None
                        ) -> tuple[int, ...]:
    """Every rank's row count for a gather of rows described by ``key`` (its dtype and
    trailing shape), given this rank's ``rows``: one small all-gather of each rank's count
    and a fingerprint of dtype and trailing shape (``header``/``headers``/``header_plan``
    reused when a plan keeps them). Where the fingerprints differ, or the backend takes no
    host buffers (NCCL), the ranks exchange pickled descriptions instead, which name the
    disagreement.

    Raises:
        CollectiveMismatchError: on every rank, when ranks' dtypes or trailing shapes differ.
    """
    trailing = tuple(key.shape[1:])
    n = backend.world_size
    if backend.host_collectives:
        if header is None:
            header = np.array((0,) + row_fingerprint(key.dtype, trailing), _INT64)
            headers = np.empty(4 * n, _INT64)
            header_plan = backend.plan(CallKey.of("all_gather", header, counts=(4,) * n))
        header[0] = rows
        values = header_plan.run(header, headers).tolist()  # type: ignore[union-attr]
        prints = values[1:4]
        if all(values[k:k + 3] == prints for k in range(5, 4 * n, 4)):
            return tuple(values[0::4])
    metas = backend.allgather_object((rows, trailing, str(key.dtype)))
    error = rows_mismatch(key.collective, [(dtype, shape) for _, shape, dtype in metas])
    if error is not None:
        raise error
    return tuple(m[0] for m in metas)


__all__ = ["CallKey", "Plan", "Signature", "UnsizedAllGatherPlan", "WidenedMeanPlan",
           "checked_out", "element_counts", "exchange_row_counts", "output_shape", "split_sizes",
           "validate"]
