"""Collectives over a process group, for arrays of any shape.

Every function takes an optional ``group`` (the current world when None) and
works on NumPy or CuPy arrays (other frameworks' arrays through DLPack).
Ops named for an in-place effect (``all_reduce*``, ``broadcast*``) write into
the array passed, which must be writable and C-contiguous, and return it.
Ops that make a new array (``all_gather``, ``reduce_scatter*``, ``gather_tensor``,
``scatter_tensor``, ``recv``) return it. With ``async_op=True`` they return a
:class:`~axondist.backends.Work` whose ``wait()`` gives that result.

Splits along axis 0 follow :func:`numpy.array_split`: with ``L`` rows over
``n`` ranks, the first ``L % n`` ranks get one row more.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from math import prod
from typing import Any

from . import _array
from ._validate import as_rank, positive_seconds, sequence_of
from .backends._rows import row_fingerprint, rows_mismatch
from .backends.base import Backend, CompletedWork, ThenWork, Work, default_timeout
from .errors import CollectiveMismatchError, InvalidBufferError, RankError, UnsupportedDTypeError
from .ops import ReduceOp, check_op_dtype
from .process_group import ProcessGroup, World, current_world, resolve_group


def _member(group: ProcessGroup | None, what: str) -> tuple[ProcessGroup, Backend]:
    g = resolve_group(group)
    return g, g.backend_for(what)


# --- the small-message hot path --------------------------------------------------------------
# At 4 KiB a blocking MPI collective takes 2-7 us, so every 0.1 us of Python per
# call shows. all_reduce, broadcast and all_gather first test the common case
# with a few attribute reads: an exact NumPy ndarray whose ``flags.carray``
# (aligned, writable, C-contiguous) holds and whose dtype (and op) passed the
# full checks before: a memo of facts about dtypes, the same for every rank and
# thread. Anything else takes the full checks (which raise the same errors). The
# backend of an exact group class is read inline (a Python frame costs ~0.5 us here).

_HOST_ARRAY: type[_array.np.ndarray] = _array.np.ndarray
#: Exact group classes whose member backend the hot path reads directly.
_GROUP_TYPES = (ProcessGroup, World)
#: dtype -> the ReduceOps check_op_dtype accepted for it (a tuple: ``in`` tests
#: identity first, where a set would call Enum's Python-level __hash__).
_REDUCE_OK: dict[Any, tuple[ReduceOp, ...]] = {}
#: dtypes check_dtype accepted (broadcast, all_gather).
_MOVE_OK: set[Any] = set()


def _backend_of(group: ProcessGroup | None, what: str) -> Backend:
    """The backend of ``group`` (the current world when None) for call ``what``."""
    g = current_world() if group is None else group
    if g.__class__ in _GROUP_TYPES:
        b = g._backend
        if b is not None:
            return b
    return resolve_group(g).backend_for(what)


def _wants_signature(b: Backend) -> bool:
    return b.needs_signature


def _checked_reduce_args(x: Any, op: Any, what: str) -> tuple[Any, ReduceOp]:
    """The full checks of an in-place reduction (the hot path's slow side)."""
    x = _array.as_array(x)
    if op.__class__ is not ReduceOp:
        op = ReduceOp.parse(op)
    check_op_dtype(op, x.dtype, what)
    _array.check_writable(x, what)
    if x.__class__ is _HOST_ARRAY and not (op is ReduceOp.AVERAGE and x.dtype in _HALF):
        known = _REDUCE_OK.get(x.dtype, ())
        if op not in known:
            _REDUCE_OK[x.dtype] = known + (op,)
    return x, op


_HALF = (_array.dtype_named("float16"), _array.dtype_named("bfloat16"))
_FLOAT32 = _array.dtype_named("float32")


def _half_average(x: Any, out: Any, b: Backend, async_op: bool,
                  counts: list[int] | None) -> Any:
    """AVERAGE of a float16/bfloat16 ``x`` into ``out`` (an all-reduce when ``counts`` is
    None, else a reduce-scatter): each rank's values are scaled by 1/n while widened to
    float32, summed in float32 and rounded once to ``out``'s dtype.

    Summing in the half dtype overflows as soon as the sum passes the dtype's largest
    value (65504 for float16) even when the mean does not; dividing before a half sum
    underflows small values instead. float32 holds the scaled values of both without
    loss (its exponent range is bfloat16's, so the scaling before the sum also keeps a
    bfloat16 sum finite), at twice the bytes on the wire.
    """
    xp = _array.namespace(x)
    wide = xp.multiply(x, 1.0 / b.world_size, dtype=_FLOAT32)
    sig = (("dtype", wide.dtype), ("shape", wide.shape), ("widened_from", x.dtype))
    if counts is None:
        result = wide
        work = b.all_reduce(wide, ReduceOp.SUM, signature=sig, async_op=async_op)
    else:
        result = xp.empty(out.shape, dtype=_FLOAT32)
        work = b.reduce_scatter(wide, result, counts, ReduceOp.SUM, signature=sig,
                                async_op=async_op)

    def narrow(_: Any = None) -> Any:
        out[...] = result  # one rounding, to the nearest value of out's dtype
        return out

    if not async_op:
        work.wait()
        return narrow()
    return ThenWork(work, narrow)


def _checked_dtype(x: Any, what: str) -> None:
    _array.check_dtype(x.dtype, what)
    if x.__class__ is _HOST_ARRAY:
        _MOVE_OK.add(x.dtype)


def _int_sizes(sizes: Sequence[int]) -> tuple[list[int], int]:
    """``sizes`` as a new list of ints, and their sum."""
    rows = [int(s) for s in sizes]
    return rows, sum(rows)


def _check_rank(g: ProcessGroup, r: Any, what: str, arg: str) -> int:
    return as_rank(r, g.world_size, what, arg)


def split_sizes(length: int, parts: int) -> list[int]:
    """Rows per part when ``length`` rows split over ``parts`` (numpy.array_split rule)."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _finish(work: Work, async_op: bool) -> Any:
    return work if async_op else work.wait()


def _with_result(work: Work, result: Any) -> Work:
    """A Work whose wait() returns ``result`` once ``work`` completed."""
    if isinstance(work, CompletedWork):
        return CompletedWork(result)
    return _MappedWork(work, result)


class _MappedWork(Work):
    __slots__ = ("_inner", "_result")

    def __init__(self, inner: Work, result: Any) -> None:
        self._inner, self._result = inner, result

    def wait(self, timeout: float | None = None) -> Any:
        self._inner.wait(timeout)
        return self._result

    def is_completed(self) -> bool:
        return self._inner.is_completed()


# --- reductions ----------------------------------------------------------------------

def all_reduce(x: Any, op: ReduceOp | str = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """Reduce ``x`` over the group, in place, and return it.

    Args:
        x: writable, C-contiguous array; every rank passes the same shape and dtype.
        op: a :class:`ReduceOp` (or its name).
        group: the group (current world when None).
        async_op: return a Work instead of waiting.

    Raises:
        CollectiveMismatchError: ranks passed different shapes, dtypes or ops.
        InvalidBufferError: ``x`` is read-only or not contiguous.
        UnsupportedDTypeError: MIN/MAX on complex, AVERAGE on integers, unknown dtype.
    """
    g = current_world() if group is None else group
    b = g._backend if g.__class__ in _GROUP_TYPES else None  # _backend_of, inline
    if b is None:
        b = _backend_of(group, "all_reduce")
    if (x.__class__ is _HOST_ARRAY and x.flags.carray and op in _REDUCE_OK.get(x.dtype, ())):
        if not async_op:
            b.all_reduce_blocking(x, op)
            return x
    else:
        x, op = _checked_reduce_args(x, op, "all_reduce")
        if op is ReduceOp.AVERAGE and x.dtype in _HALF:
            return _half_average(x, x, b, async_op, None)
    # The dtype object itself, not str(dtype): str() costs ~3.5 us, more than
    # a whole small MPI all-reduce; it prints the same in mismatch errors.
    sig = (("dtype", x.dtype), ("shape", x.shape)) if _wants_signature(b) else ()
    work = b.all_reduce(x, op, signature=sig, async_op=async_op)
    return work if async_op else work.wait()


def all_reduce_sum(x: Any, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Sum ``x`` over the group in place (see :func:`all_reduce`)."""
    return all_reduce(x, ReduceOp.SUM, group, async_op)


def all_reduce_mean(x: Any, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Average ``x`` over the group in place (see :func:`all_reduce`)."""
    return all_reduce(x, ReduceOp.AVERAGE, group, async_op)


def all_reduce_min(x: Any, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Element-wise minimum over the group, in place."""
    return all_reduce(x, ReduceOp.MIN, group, async_op)


def all_reduce_max(x: Any, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Element-wise maximum over the group, in place."""
    return all_reduce(x, ReduceOp.MAX, group, async_op)


def all_reduce_product(x: Any, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Element-wise product over the group, in place."""
    return all_reduce(x, ReduceOp.PRODUCT, group, async_op)


def reduce_scatter(x: Any, op: ReduceOp | str = ReduceOp.SUM, group: ProcessGroup | None = None,
                   async_op: bool = False, *, out: Any = None) -> Any:
    """Reduce ``x`` over the group and return this rank's block of rows.

    ``x`` (same shape on every rank, at least 1-D) is split along axis 0 as
    :func:`numpy.array_split` would; rank r gets the reduced block r. Passing
    ``out`` (writable, C-contiguous, of the block's shape and ``x``'s dtype and
    array library) writes the block there instead of into a new array.

    Raises:
        InvalidBufferError: ``out`` is not such an array, or ``x`` is 0-d.
    """
    g = current_world() if group is None else group
    b = g._backend if g.__class__ in _GROUP_TYPES else None  # _backend_of, inline
    if b is None:
        b = _backend_of(group, "reduce_scatter")
    if x.__class__ is _HOST_ARRAY and not async_op and op in _REDUCE_OK.get(x.dtype, ()):
        # The hot path: 1-D NumPy, equal blocks, an op the dtype passed before (each
        # test costs ~0.2 us here, a tenth of the whole call at 4 KiB).
        n, size = b.world_size, x.size
        if size % n == 0 and x.ndim == 1 and x.flags.c_contiguous:
            block = size // n
            if out is None:
                out = _HOST_ARRAY((block,), x.dtype)
            elif not (out.__class__ is _HOST_ARRAY and out.dtype is x.dtype
                      and out.size == block and out.ndim == 1 and out.flags.carray):
                out = _checked_block_out(out, x, (block,))  # (equal dtypes pass here)
            b.reduce_scatter_blocking(x, out, [block] * n, op)
            return out
    g = resolve_group(group)
    x = _array.contiguous(_array.as_array(x))
    op = ReduceOp.parse(op)
    check_op_dtype(op, x.dtype, "reduce_scatter")
    if x.ndim == 0:
        raise InvalidBufferError("reduce_scatter: a 0-d array has no axis to split; pass x[None]")
    rows = split_sizes(x.shape[0], g.world_size)
    row_size = prod(x.shape[1:])
    shape = (rows[g.rank],) + tuple(x.shape[1:])
    if out is None:
        out = _array.namespace(x).empty(shape, dtype=x.dtype)
    else:
        out = _checked_block_out(out, x, shape)
    if op is ReduceOp.AVERAGE and x.dtype in _HALF:
        return _half_average(x, out, b, async_op, [r * row_size for r in rows])
    if x.__class__ is _HOST_ARRAY and not (op is ReduceOp.AVERAGE and x.dtype in _HALF):
        known = _REDUCE_OK.get(x.dtype, ())
        if op not in known:
            _REDUCE_OK[x.dtype] = known + (op,)
    sig = (("dtype", x.dtype), ("shape", x.shape))
    work = b.reduce_scatter(x, out, [r * row_size for r in rows], op, signature=sig,
                            async_op=async_op)
    return _finish(_with_result(work, out), async_op)


def _checked_block_out(out: Any, x: Any, shape: tuple[int, ...]) -> Any:
    """``out`` for :func:`reduce_scatter`'s block of ``shape``, or the error naming why not."""
    is_array = isinstance(out, _HOST_ARRAY) or _array.is_cupy(out)
    ok = (is_array and _array.namespace(out) is _array.namespace(x)
          and tuple(out.shape) == shape and out.dtype == x.dtype)
    if ok:
        _array.check_writable(out, "reduce_scatter")
        ok = bool(out.flags.c_contiguous)
    if not ok:
        what = _array.describe(out) if is_array else f"a {type(out).__name__}"
        raise InvalidBufferError(
            f"reduce_scatter: out is {what} but this rank's block is "
            f"{x.dtype}{list(shape)} of the same array library as x; pass a writable, "
            "C-contiguous array of that shape and dtype, or no out")
    return out


def reduce(x: Any, dst: int = 0, op: ReduceOp | str = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Reduce ``x`` over the group into group rank ``dst``'s ``x`` (in place) and return it.

    Other ranks' ``x`` is left unchanged. Arguments and errors as :func:`all_reduce`.
    """
    g, b = _member(group, "reduce")
    dst = _check_rank(g, dst, "reduce", "dst")
    x, op = _checked_reduce_args(x, op, "reduce")
    if op is ReduceOp.AVERAGE and x.dtype in _HALF:
        copy = _array.namespace(x).array(x, copy=True)
        work = _half_average(copy, copy, b, async_op, None)

        def keep(result: Any) -> Any:
            if g.rank == dst:
                x[...] = result
            return x

        return ThenWork(work, keep) if async_op else keep(work)
    sig = (("dtype", x.dtype), ("shape", x.shape))
    work = b.reduce(x, op, dst, signature=sig, async_op=async_op)
    return _finish(_with_result(work, x), async_op)


def all_to_all(x: Any, group: ProcessGroup | None = None, *,
               send_sizes: Sequence[int] | None = None,
               recv_sizes: Sequence[int] | None = None, async_op: bool = False) -> Any:
    """Send row block k of ``x`` to group rank k; return the blocks received, in rank order.

    ``x`` (at least 1-D; the trailing shape and dtype must agree on every rank) is
    split along axis 0 by ``send_sizes`` (rows per destination; the
    :func:`numpy.array_split` rule when None). The ranks exchange their sizes
    first; ``recv_sizes`` (rows from each source), when given, is checked
    against them. What expert and sequence parallelism use.

    Raises:
        InvalidBufferError: ``send_sizes`` does not split ``x``'s rows.
        CollectiveMismatchError: ranks disagree on dtype or trailing shape, or
            ``recv_sizes`` does not match what the others send.
    """
    g, b = _member(group, "all_to_all")
    x = _array.contiguous(_array.as_array(x))
    _array.check_dtype(x.dtype, "all_to_all")
    if x.ndim == 0:
        raise InvalidBufferError("all_to_all: a 0-d array has no axis to split; pass x[None]")
    n = g.world_size
    if send_sizes is None:
        send_rows = split_sizes(x.shape[0], n)
    else:
        send_rows = [int(s) for s in send_sizes]
        if len(send_rows) != n or sum(send_rows) != x.shape[0] or min(send_rows) < 0:
            raise InvalidBufferError(
                f"all_to_all: send_sizes={send_rows} must list {n} row counts >= 0 adding up "
                f"to x's {x.shape[0]} rows")
    trailing = tuple(x.shape[1:])
    table = b.allgather_object((send_rows, trailing, str(x.dtype)))
    for field, idx in (("dtype", 2), ("trailing shape", 1)):
        values = [t[idx] for t in table]
        if any(v != values[0] for v in values):
            detail = ", ".join(f"rank {k}: {v}" for k, v in enumerate(values))
            raise CollectiveMismatchError(f"all_to_all: ranks disagree on {field} ({detail})")
    recv_rows = [t[0][g.rank] for t in table]
    if recv_sizes is not None and [int(r) for r in recv_sizes] != recv_rows:
        raise CollectiveMismatchError(
            f"all_to_all: recv_sizes={list(recv_sizes)} on rank {g.rank}, but the ranks send "
            f"it {recv_rows} rows")
    row = prod(trailing)
    out = _array.namespace(x).empty((sum(recv_rows),) + trailing, dtype=x.dtype)
    work = b.all_to_all(x, out, [r * row for r in send_rows], [r * row for r in recv_rows],
                        signature=(("dtype", x.dtype),), async_op=async_op)
    return _finish(_with_result(work, out), async_op)


def monitored_barrier(group: ProcessGroup | None = None, timeout: float | None = None) -> None:
    """A barrier that fails after ``timeout`` seconds (the group's timeout when None) with a
    :class:`~axondist.errors.CollectiveTimeoutError` naming the ranks that did not arrive.

    On MPI the failing call leaves the job unusable for collectives (as torch's): end it.
    """
    _, b = _member(group, "monitored_barrier")
    wait = default_timeout() if timeout is None else positive_seconds(
        timeout, "monitored_barrier")
    b.monitored_barrier(wait)


def reduce_scatter_sum(x: Any, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Sum over the group, then keep this rank's block of rows (see :func:`reduce_scatter`)."""
    return reduce_scatter(x, ReduceOp.SUM, group, async_op)


def reduce_scatter_mean(x: Any, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Average over the group, then keep this rank's block of rows."""
    return reduce_scatter(x, ReduceOp.AVERAGE, group, async_op)


# --- broadcast and gathers ---------------------------------------------------------------

def broadcast(x: Any, group: ProcessGroup | None = None, *, src: int = 0,
              async_op: bool = False) -> Any:
    """Copy group rank ``src``'s ``x`` into every rank's ``x`` (in place) and return it."""
    g = current_world() if group is None else group
    b = g._backend if g.__class__ in _GROUP_TYPES else None  # _backend_of, inline
    if b is None:
        b = _backend_of(group, "broadcast")
    if src.__class__ is not int or not 0 <= src < b.world_size:
        src = as_rank(src, b.world_size, "broadcast", "src")
    if x.__class__ is _HOST_ARRAY and x.flags.carray and x.dtype in _MOVE_OK:
        if not async_op:
            b.broadcast_blocking(x, src)
            return x
    else:
        x = _array.as_array(x)
        _checked_dtype(x, "broadcast")
        _array.check_writable(x, "broadcast")
    sig = (("dtype", x.dtype), ("shape", x.shape)) if _wants_signature(b) else ()
    work = b.broadcast(x, src, signature=sig, async_op=async_op)
    return work if async_op else work.wait()


def broadcast_from(x: Any, group: ProcessGroup | None = None, src: int = 0,
                   async_op: bool = False) -> Any:
    """:func:`broadcast` with the source rank as a positional argument."""
    return broadcast(x, group, src=src, async_op=async_op)


def _gather_counts(b: Backend, x: Any, what: str) -> list[int]:
    """Rows each rank contributes, checking that dtype and trailing shape agree."""
    trailing = tuple(x.shape[1:])
    if b.host_collectives:
        # One small all-gather of host numbers (rows and a fingerprint of dtype and
        # trailing shape), ~10x cheaper than exchanging pickled objects. Every
        # rank sees every fingerprint, so when they differ all ranks fall back to
        # the object exchange below, which names the disagreement. (Not for NCCL:
        # its collectives take device memory only.)
        n = b.world_size
        header, table, counts = _row_exchange(b, x.dtype, trailing, n)
        header[0] = x.shape[0]
        b.all_gather_blocking(header, table, counts)
        values = table.tolist()  # small: Python lists beat NumPy calls here
        prints = values[1:4]
        if all(values[k:k + 3] == prints for k in range(5, 4 * n, 4)):
            return values[0::4]
    metas = b.allgather_object((x.shape[0], trailing, str(x.dtype)))
    error = rows_mismatch(what, [(dtype, shape) for _, shape, dtype in metas])
    if error is not None:
        raise error
    return [m[0] for m in metas]


_INT64 = _array.dtype_named("int64")


@functools.lru_cache(maxsize=64)
def _row_exchange(backend: Backend, dtype: Any, trailing: tuple[int, ...],
                  n: int) -> tuple[Any, Any, list[int]]:
    """The buffers of :func:`_gather_counts`' exchange on one rank's ``backend`` for one
    dtype, trailing shape and group size: the header (rows, then the fingerprint), the
    table every rank's header lands in, the counts. Reused call after call: building
    them cost more than the exchange itself."""
    header = _array.np.array((0,) + row_fingerprint(dtype, trailing), _INT64)
    return header, _HOST_ARRAY((4 * n,), _INT64), [4] * n


def _as_rows(x: Any) -> Any:
    """0-d arrays take part in gathers as one row."""
    return x.reshape(1) if x.ndim == 0 else x


def all_gather(x: Any, group: ProcessGroup | None = None, *, sizes: Sequence[int] | None = None,
               out: Any = None, async_op: bool = False) -> Any:
    """Concatenate every rank's ``x`` along axis 0, in rank order, on every rank.

    Leading sizes may differ between ranks (trailing shape and dtype must
    not); 0-d inputs are stacked. Passing ``sizes`` (every rank's leading
    size, the same list on every rank) skips the exchange of sizes. Passing
    ``out`` (writable, C-contiguous, of the result's shape and dtype) reuses
    it instead of allocating: fresh big arrays cost page faults on every call.
    Without ``sizes`` the MPI backend exchanges the counts and the rows together,
    blocking: ``async_op=True`` then returns a Work that is already complete.
    """
    g = current_world() if group is None else group
    b = g._backend if g.__class__ in _GROUP_TYPES else None  # _backend_of, inline
    if b is None:
        b = _backend_of(group, "all_gather")
    host = x.__class__ is _HOST_ARRAY and x.dtype in _MOVE_OK and x.flags.c_contiguous
    if host and not async_op:
        if sizes is None:
            # The hot path without sizes: the row counts travel with the call's check
            # (in a group of two, with the rows themselves when they are small).
            if x.ndim and (out is None or (out.__class__ is _HOST_ARRAY and out.flags.carray)):
                got = b.all_gather_rows_blocking(x, out)
                if got is not None:
                    return got
        elif out.__class__ is _HOST_ARRAY and x.ndim == 1 and out.flags.carray:
            # The hot path: 1-D NumPy in and out, sizes given (the checks below, inlined).
            rows = list(map(int, sizes))
            total = sum(rows)
            if len(rows) != b.world_size or rows[b.rank] != x.size:
                raise _bad_sizes(b, rows, x)
            if ((out.dtype is not x.dtype and out.dtype != x.dtype) or out.size != total
                    or out.ndim != 1):
                raise _bad_out(out, x, (total,))
            b.all_gather_blocking(x, out, rows)
            return out
    if not host:
        x = _array.contiguous(_array.as_array(x))
        _checked_dtype(x, "all_gather")
    if sizes is None:
        # The backend allocates ``out`` once it knows the counts, or checks the one given
        # (async_op: the call is blocking; its Work is already complete).
        if out is not None:
            _checked_gather_out(out)
        got = b.all_gather_rows_blocking(x if x.ndim else x.reshape(1), out)
        if got is not None:
            return CompletedWork(got) if async_op else got
    if x.ndim == 1:  # the common case: no trailing shape
        trailing: tuple[int, ...] = ()
        row_size = 1
    else:
        x = _as_rows(x)
        trailing = tuple(x.shape[1:])
        row_size = prod(trailing)
    if sizes is None:
        rows = _gather_counts(b, x, "all_gather")
        total = sum(rows)
    else:
        rows, total = _int_sizes(sizes)
        if len(rows) != b.world_size or rows[b.rank] != x.shape[0]:
            raise _bad_sizes(b, rows, x)
    shape = (total,) + trailing
    if out is None:
        out = _array.namespace(x).empty(shape, dtype=x.dtype)
    else:
        if out.__class__ is not _HOST_ARRAY or not out.flags.carray:
            host = False
            _checked_gather_out(out)
        if (out.dtype is not x.dtype and out.dtype != x.dtype) or tuple(out.shape) != shape:
            raise _bad_out(out, x, shape)
    counts = rows if row_size == 1 else [r * row_size for r in rows]
    if host and not async_op and out.__class__ is _HOST_ARRAY:
        b.all_gather_blocking(x, out, counts)
        return out
    sig = (("dtype", x.dtype),) if _wants_signature(b) else ()
    work = b.all_gather(x, out, counts, signature=sig, async_op=async_op)
    if async_op:
        return _with_result(work, out)
    work.wait()
    return out


def _checked_gather_out(out: Any) -> None:
    """Raise unless ``out`` is an array all_gather may write whole (writable, C-contiguous:
    :func:`axondist._array.check_writable` says which it is not)."""
    if not (isinstance(out, _HOST_ARRAY) or _array.is_cupy(out)):
        raise InvalidBufferError(f"all_gather: out is a {type(out).__name__}; pass a NumPy or "
                                 "CuPy array of the result's shape and dtype, or no out")
    _array.check_writable(out, "all_gather")


def _bad_sizes(b: Backend, rows: list[int], x: Any) -> CollectiveMismatchError:
    return CollectiveMismatchError(
        f"all_gather: sizes={rows} must list {b.world_size} row counts with this "
        f"rank's ({x.shape[0]}) at index {b.rank}")


def _bad_out(out: Any, x: Any, shape: tuple[int, ...]) -> InvalidBufferError:
    return InvalidBufferError(f"all_gather: out is {_array.describe(out)} but the result "
                              f"is {x.dtype}{list(shape)}")


def gather_tensor(x: Any, group: ProcessGroup | None = None, dst: int = 0,
                  async_op: bool = False) -> Any:
    """Concatenate every rank's ``x`` along axis 0 on group rank ``dst``; None elsewhere."""
    g, b = _member(group, "gather_tensor")
    dst = _check_rank(g, dst, "gather_tensor", "dst")
    x = _as_rows(_array.contiguous(_array.as_array(x)))
    _array.check_dtype(x.dtype, "gather_tensor")
    rows = _gather_counts(b, x, "gather_tensor")
    row_size = prod(x.shape[1:])
    out = None
    if g.rank == dst:
        out = _array.namespace(x).empty((sum(rows),) + tuple(x.shape[1:]), dtype=x.dtype)
    work = b.gather(x, out, [r * row_size for r in rows], dst,
                    signature=(("dtype", x.dtype),), async_op=async_op)
    return _finish(_with_result(work, out), async_op)


def scatter_tensor(x: Any, group: ProcessGroup | None = None, src: int = 0,
                   async_op: bool = False) -> Any:
    """Split ``x`` (given on group rank ``src``, ignored elsewhere) along axis 0; return this
    rank's block (split as :func:`numpy.array_split`)."""
    g, b = _member(group, "scatter_tensor")
    src = _check_rank(g, src, "scatter_tensor", "src")
    send = None
    meta: Any = None
    if g.rank == src:
        # Checked before the exchange, and the verdict shared: a bad input raises on
        # every rank instead of leaving the others waiting for data that never comes.
        try:
            if x is None:
                raise InvalidBufferError(f"scatter_tensor: the source rank {src} must pass "
                                         "an array")
            send = _array.contiguous(_array.as_array(x))
            _array.check_dtype(send.dtype, "scatter_tensor")
            if send.ndim == 0:
                raise InvalidBufferError("scatter_tensor: a 0-d array has no axis to split; "
                                         "pass x[None]")
            meta = (tuple(send.shape), str(send.dtype), _array.library_name(send))
        except (InvalidBufferError, UnsupportedDTypeError) as exc:
            meta = exc
    meta = b.broadcast_object(meta, src)
    if isinstance(meta, Exception):
        raise type(meta)(f"{meta} (raised on the source, rank {src})")
    shape, dtype, lib = meta
    rows = split_sizes(shape[0], g.world_size)
    row_size = prod(shape[1:])
    xp = _array.namespace(send) if send is not None else _array.module_named(lib)
    out = xp.empty((rows[g.rank],) + tuple(shape[1:]), dtype=_array.dtype_named(dtype))
    work = b.scatter(send, out, [r * row_size for r in rows], src,
                     signature=(("dtype", dtype), ("shape", shape)), async_op=async_op)
    return _finish(_with_result(work, out), async_op)


def barrier(group: ProcessGroup | None = None) -> None:
    """Return once every rank of the group has called barrier."""
    _, b = _member(group, "barrier")
    b.barrier()


# --- point to point --------------------------------------------------------------------

def send(x: Any, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send ``x`` (any shape; shape and dtype travel with it) to group rank ``dst``."""
    g, b = _member(group, "send")
    dst = _check_rank(g, dst, "send", "dst")
    if dst == g.rank:
        raise RankError(f"send: dst={dst} is this rank; a rank cannot send to itself")
    x = _array.contiguous(_array.as_array(x))
    _array.check_dtype(x.dtype, "send")
    lib = _array.library_name(x)
    b.send_object((tuple(x.shape), str(x.dtype), lib), dst, tag)
    b.send(x, dst, tag)


def recv(src: int, group: ProcessGroup | None = None, tag: int = 0, *, out: Any = None) -> Any:
    """Receive the array group rank ``src`` sent with :func:`send` and return it.

    Args:
        out: optional array to receive into (its shape and dtype must match
            the message's); a new array is allocated when None.
    """
    g, b = _member(group, "recv")
    src = _check_rank(g, src, "recv", "src")
    if src == g.rank:
        raise RankError(f"recv: src={src} is this rank; a rank cannot receive from itself")
    shape, dtype, lib = b.recv_object(src, tag)
    message = _array.module_named(lib).empty(shape, dtype=_array.dtype_named(dtype))
    if out is None:
        out = message
    elif (tuple(out.shape) != tuple(shape) or str(out.dtype) != dtype
          or not _array.is_writable(out)):
        b.recv(message, src, tag)  # consume it: the next recv gets the next message
        _array.check_writable(out, "recv")
        raise CollectiveMismatchError(
            f"recv: rank {src} sent {dtype}{list(shape)} (tag {tag}) but out is "
            f"{_array.describe(out)}; the message was discarded, so the next recv gets the "
            "next one")
    b.recv(out, src, tag)
    return out


# --- small Python objects ------------------------------------------------------------

def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (for metadata)."""
    return _member(group, "all_gather_object")[1].allgather_object(obj)


def broadcast_object(obj: Any, group: ProcessGroup | None = None, *, src: int = 0) -> Any:
    """Group rank ``src``'s picklable ``obj`` on every rank (``obj`` is ignored elsewhere)."""
    g, b = _member(group, "broadcast_object")
    return b.broadcast_object(obj, as_rank(src, g.world_size, "broadcast_object", "src"))


def broadcast_object_list(object_list: list[Any], src: int = 0,
                          group: ProcessGroup | None = None) -> list[Any]:
    """Replace ``object_list``'s items, in place, by those of group rank ``src`` (torch's
    call); every rank passes a list of the same length. Returns the list."""
    if not isinstance(object_list, list):
        raise TypeError(f"broadcast_object_list: object_list must be a list, got "
                        f"{type(object_list).__name__}")
    items = broadcast_object(list(object_list), group, src=src)
    if len(items) != len(object_list):
        raise CollectiveMismatchError(
            f"broadcast_object_list: rank {src} sent {len(items)} objects but this rank's list "
            f"holds {len(object_list)}; pass lists of the same length on every rank")
    object_list[:] = items
    return object_list


def gather_object(obj: Any, group: ProcessGroup | None = None, dst: int = 0) -> list[Any] | None:
    """Every rank's picklable ``obj`` in rank order on group rank ``dst``; None elsewhere."""
    g, b = _member(group, "gather_object")
    dst = as_rank(dst, g.world_size, "gather_object", "dst")
    objects = b.allgather_object(obj)
    return objects if g.rank == dst else None


def scatter_object_list(objects: Sequence[Any] | None, group: ProcessGroup | None = None,
                        src: int = 0) -> Any:
    """Item r of group rank ``src``'s ``objects`` (one per rank) on rank r.

    Raises:
        ValueError: on the source, ``objects`` does not hold one item per rank.
    """
    g, b = _member(group, "scatter_object_list")
    src = as_rank(src, g.world_size, "scatter_object_list", "src")
    problem = None
    if g.rank == src and (objects is None or len(objects) != g.world_size):
        problem = (f"scatter_object_list: the source (rank {src}) must pass one object per "
                   f"rank ({g.world_size}), got "
                   f"{'None' if objects is None else len(objects)}")
    mine = list(objects) if problem is None and objects is not None and g.rank == src else None
    items = b.broadcast_object((problem, mine), src)
    if items[0] is not None:
        raise ValueError(items[0])
    return items[1][g.rank]


def flight_recorder(group: ProcessGroup | None = None, last: int | None = None
                    ) -> list[dict[str, Any]]:
    """This rank's recent calls, oldest first, for a post-mortem (see the guide).

    Each entry has ``group``, ``seq``, ``op``, ``detail``, ``blocking``,
    ``state`` (``"running"`` or ``"done"``), ``started_s_ago`` and, once done,
    ``duration_s``. Empty for a backend that records nothing.
    """
    g = resolve_group(group)
    recorder = g.backend_for("flight_recorder").recorder
    return [] if recorder is None else recorder.entries(last)


# --- gradients and queries ----------------------------------------------------------

def sync_gradient(grad: Any, group: ProcessGroup | None = None) -> Any:
    """Average one gradient over the group, in place, and return it."""
    return all_reduce(grad, ReduceOp.AVERAGE, group)


def sync_gradients(grads: Sequence[Any], group: ProcessGroup | None = None) -> list[Any]:
    """Average many gradients with one all-reduce per dtype; write back and return them."""
    grads = [_array.as_array(gr) for gr in sequence_of(grads, "sync_gradients", "grads")]
    by_dtype: dict[str, list[int]] = {}
    for i, gr in enumerate(grads):
        by_dtype.setdefault(str(gr.dtype), []).append(i)
    for idx in by_dtype.values():
        group_grads = [grads[i] for i in idx]
        buffer, layout = _array.flatten(group_grads)
        all_reduce(buffer, ReduceOp.AVERAGE, group)
        for gr, view in zip(group_grads, layout.views(buffer)):
            _array.check_writable(gr, "sync_gradients")
            gr[...] = view
    return grads


def rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in the group (-1 when not a member)."""
    return resolve_group(group).rank


def world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in the group."""
    return resolve_group(group).world_size


def is_main_process(group: ProcessGroup | None = None) -> bool:
    """True on group rank 0."""
    return resolve_group(group).rank == 0


__all__ = [
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_min",
    "all_reduce_product",
    "all_reduce_sum",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_from",
    "broadcast_object",
    "broadcast_object_list",
    "flight_recorder",
    "gather_object",
    "gather_tensor",
    "is_main_process",
    "monitored_barrier",
    "rank",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_mean",
    "reduce_scatter_sum",
    "scatter_object_list",
    "scatter_tensor",
    "send",
    "split_sizes",
    "sync_gradient",
    "sync_gradients",
    "world_size",
]
