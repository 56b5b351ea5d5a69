"""Collectives over a process group, for arrays of any shape.

Every function takes an optional ``group`` (the current world when None) and
works on NumPy or CuPy arrays (other frameworks' arrays through DLPack).
Ops named for an in-place effect (``all_reduce*``, ``broadcast*``) write into
the array passed, which must be writable and C-contiguous, and return it.
Ops that make a new array (``all_gather``, ``reduce_scatter*``, ``gather_tensor``,
``scatter_tensor``, ``recv``) return it. With ``async_op=True`` they return a
:class:`~axondist.backends.Work` whose ``wait()`` gives that result. Results come
back in the caller's framework: a torch tensor is written in place and returned, a
JAX array (immutable) gives a new JAX array.

Each collective takes one path: the key of the call
(:class:`~axondist.backends.plan.CallKey`), the group's backend's plan for that key, and
the plan's run (:func:`axondist.prepare` keeps a plan for a caller that wants no per-call
cost). Splits along axis 0 follow :func:`numpy.array_split`: with ``L`` rows over ``n``
ranks, the first ``L % n`` ranks get one row more.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

import numpy as np

from . import _array, _tree
from ._call_args import group_backend, in_callers_framework, member, one_array
from ._frameworks import any_framework, framework_of
from ._object_collectives import (
    all_gather_object,
    broadcast_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from ._validate import as_rank, check_tag, positive_seconds
from .backends.base import default_timeout
from .backends.plan import CallKey, exchange_row_counts, split_sizes
from .backends.work import finished
from .errors import CollectiveMismatchError, InvalidBufferError, RankError, UnsupportedDTypeError
from .ops import ReduceOp
from .process_group import ProcessGroup, resolve_group

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
    if type(x) is not np.ndarray and framework_of(x) is not None:
        return in_callers_framework(all_reduce, x, op, group, async_op, in_place=True)
    if type(x) is not np.ndarray:
        x = one_array(x, "all_reduce", in_place=True)
    key = CallKey.of("all_reduce", x, reduce_op=op, async_op=async_op)
    return group_backend(group, "all_reduce").plan(key).run(x)


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
    if type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray):
        if any_framework(x, out):
            return in_callers_framework(reduce_scatter, x, op, group, async_op, out=out)
    x = _array.contiguous(one_array(x, "reduce_scatter"))
    key = CallKey.of("reduce_scatter", x, reduce_op=op, async_op=async_op)
    return group_backend(group, "reduce_scatter").plan(key).run(x, out)


def reduce_scatter_sum(x: Any, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Sum over the group, then keep this rank's block of rows (see :func:`reduce_scatter`)."""
    return reduce_scatter(x, ReduceOp.SUM, group, async_op)


def reduce_scatter_mean(x: Any, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Average over the group, then keep this rank's block of rows."""
    return reduce_scatter(x, ReduceOp.AVERAGE, group, async_op)


def reduce(x: Any, dst: int = 0, op: ReduceOp | str = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Reduce ``x`` over the group into group rank ``dst``'s ``x`` (in place) and return it.

    Other ranks' ``x`` is left unchanged. Arguments and errors as :func:`all_reduce`.
    """
    if type(x) is not np.ndarray and framework_of(x) is not None:
        return in_callers_framework(reduce, x, dst, op, group, async_op, in_place=True)
    g, b = member(group, "reduce")
    x = one_array(x, "reduce", in_place=True)
    key = CallKey.of("reduce", x, reduce_op=op, root=as_rank(dst, g.world_size, "reduce", "dst"),
                     async_op=async_op)
    return b.plan(key).run(x)


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
    if type(x) is not np.ndarray and framework_of(x) is not None:
        return in_callers_framework(all_to_all, x, group, send_sizes=send_sizes,
                                    recv_sizes=recv_sizes, async_op=async_op)
    g, b = member(group, "all_to_all")
    x = _array.contiguous(one_array(x, "all_to_all"))
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
                        async_op=async_op)
    return finished(work, out, async_op)


def monitored_barrier(group: ProcessGroup | None = None, timeout: float | None = None) -> None:
    """A barrier that fails after ``timeout`` seconds (the group's timeout when None) with a
    :class:`~axondist.errors.CollectiveTimeoutError` naming the ranks that did not arrive.

    On MPI the failing call leaves the job unusable for collectives (as torch's): end it.
    """
    _, b = member(group, "monitored_barrier")
    wait = default_timeout() if timeout is None else positive_seconds(
        timeout, "monitored_barrier")
    b.monitored_barrier(wait)


# --- broadcast and gathers ---------------------------------------------------------------

def broadcast(x: Any, group: ProcessGroup | None = None, *, src: int = 0,
              async_op: bool = False) -> Any:
    """Copy group rank ``src``'s ``x`` into every rank's ``x`` (in place) and return it."""
    if type(x) is not np.ndarray and framework_of(x) is not None:
        return in_callers_framework(broadcast, x, group, src=src, async_op=async_op,
                                    in_place=True)
    g, b = member(group, "broadcast")
    x = one_array(x, "broadcast", in_place=True)
    key = CallKey.of("broadcast", x, root=as_rank(src, g.world_size, "broadcast", "src"),
                     async_op=async_op)
    return b.plan(key).run(x)


def broadcast_from(x: Any, group: ProcessGroup | None = None, src: int = 0,
                   async_op: bool = False) -> Any:
    """:func:`broadcast` with the source rank as a positional argument."""
    return broadcast(x, group, src=src, async_op=async_op)


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
    Without ``sizes`` the ranks exchange their row counts first, blocking:
    ``async_op=True`` then starts only the data's all-gather in the background.

    Raises:
        CollectiveMismatchError: ``sizes`` does not list every rank's rows with this
            rank's own at its index, or ranks disagree on dtype or trailing shape.
        InvalidBufferError: ``out`` cannot hold the result.
    """
    if type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray):
        if any_framework(x, out):
            return in_callers_framework(all_gather, x, group, sizes=sizes, out=out,
                                        async_op=async_op)
    x = _as_rows(_array.contiguous(one_array(x, "all_gather")))
    counts = None if sizes is None else tuple(map(int, sizes))
    key = CallKey.of("all_gather", x, counts=counts, async_op=async_op)
    return group_backend(group, "all_gather").plan(key).run(x, out)


def gather_tensor(x: Any, group: ProcessGroup | None = None, dst: int = 0,
                  async_op: bool = False) -> Any:
    """Concatenate every rank's ``x`` along axis 0 on group rank ``dst``; None elsewhere."""
    if type(x) is not np.ndarray and framework_of(x) is not None:
        return in_callers_framework(gather_tensor, x, group, dst, async_op)
    g, b = member(group, "gather_tensor")
    dst = as_rank(dst, g.world_size, "gather_tensor", "dst")
    x = _as_rows(_array.contiguous(one_array(x, "gather_tensor")))
    _array.check_dtype(x.dtype, "gather_tensor")
    rows = exchange_row_counts(b, CallKey.of("gather_tensor", x), x.shape[0])
    row_size = prod(x.shape[1:])
    out = None
    if g.rank == dst:
        out = _array.namespace(x).empty((sum(rows),) + tuple(x.shape[1:]), dtype=x.dtype)
    work = b.gather(x, out, [r * row_size for r in rows], dst, async_op=async_op)
    return finished(work, out, async_op)


def scatter_tensor(x: Any, group: ProcessGroup | None = None, src: int = 0,
                   async_op: bool = False) -> Any:
    """Split ``x`` (given on group rank ``src``, ignored elsewhere) along axis 0; return this
    rank's block (split as :func:`numpy.array_split`). The block comes back in the
    framework of this rank's ``x`` (NumPy or CuPy where ``x`` is None)."""
    if type(x) is not np.ndarray and framework_of(x) is not None:
        return in_callers_framework(scatter_tensor, x, group, src, async_op)
    g, b = member(group, "scatter_tensor")
    src = as_rank(src, g.world_size, "scatter_tensor", "src")
    send = None
    meta: Any = None
    if g.rank == src:
        # Checked before the exchange, and the verdict shared: a bad input raises on
        # every rank instead of leaving the others waiting for data that never comes.
        try:
            if x is None:
                raise InvalidBufferError(f"scatter_tensor: the source rank {src} must pass "
                                         "an array")
            send = _array.contiguous(one_array(x, "scatter_tensor"))
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
    work = b.scatter(send, out, [r * row_size for r in rows], src, async_op=async_op)
    return finished(work, out, async_op)


def barrier(group: ProcessGroup | None = None) -> None:
    """Return once every rank of the group has called barrier."""
    _, b = member(group, "barrier")
    b.barrier()


# --- point to point --------------------------------------------------------------------

def send(x: Any, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send ``x`` (any shape; shape and dtype travel with it) to group rank ``dst``."""
    g, b = member(group, "send")
    dst = as_rank(dst, g.world_size, "send", "dst")
    tag = check_tag(tag, "send")
    if dst == g.rank:
        raise RankError(f"send: dst={dst} is this rank; a rank cannot send to itself")
    x = _array.contiguous(one_array(x, "send"))
    _array.check_dtype(x.dtype, "send")
    b.send_object((tuple(x.shape), _array.dtype_name(x.dtype), _array.library_name(x)),
                  dst, tag)
    b.send(x, dst, tag)


def recv(src: int, group: ProcessGroup | None = None, tag: int = 0, *, out: Any = None) -> Any:
    """Receive the array group rank ``src`` sent with :func:`send` and return it.

    Args:
        out: optional array to receive into (its shape and dtype must match
            the message's; a torch tensor is written in place and returned); a new
            array is allocated when None.
    """
    if out is not None and type(out) is not np.ndarray:
        framework = framework_of(out)
        if framework is not None:
            recv(src, group, tag, out=framework.out_array(out, "recv"))
            return out
    g, b = member(group, "recv")
    src = as_rank(src, g.world_size, "recv", "src")
    tag = check_tag(tag, "recv")
    if src == g.rank:
        raise RankError(f"recv: src={src} is this rank; a rank cannot receive from itself")
    shape, dtype, lib = b.recv_object(src, tag)
    if out is None:
        out = _message_buffer(shape, dtype, lib)
    elif (tuple(out.shape) != tuple(shape) or _array.dtype_name(out.dtype) != dtype
          or not _array.is_writable(out)):
        b.recv(_message_buffer(shape, dtype, lib), src, tag)  # the next recv gets the next one
        _array.check_writable(out, "recv")
        raise CollectiveMismatchError(
            f"recv: rank {src} sent {dtype}{list(shape)} (tag {tag}) but out is "
            f"{_array.describe(out)}; the message was discarded, so the next recv gets the "
            "next one")
    b.recv(out, src, tag)
    return out


def _message_buffer(shape: Any, dtype: str, lib: str) -> Any:
    """A fresh array for a message whose header said ``shape``, ``dtype`` and library."""
    return _array.module_named(lib).empty(shape, dtype=_array.dtype_named(dtype))


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


def sync_gradients(grads: Any, group: ProcessGroup | None = None, *,
                   missing_grad: str = "error") -> Any:
    """Average many gradients with one all-reduce per dtype and return them, in ``grads``'
    structure.

    ``grads`` is a list or tuple of arrays, or any nesting of dicts, lists and tuples (a
    torch ``state_dict``, a dict of parameters), or a JAX pytree (what ``jax.grad`` returns).
    NumPy and CuPy arrays and torch tensors are averaged in place (the structure returned
    holds them); JAX arrays, which are immutable, give new JAX arrays in their place. Every
    rank passes the same structure; dict keys are matched by name, whatever their order.

    Args:
        grads: the gradients.
        group: the group (current world when None).
        missing_grad: what a ``None`` gradient means (before backward, or a parameter the
            forward did not use). ``"error"``: refused, naming it. ``"zeros"``: a zero
            gradient on this rank (as DDP's option): a small exchange of shapes finds its
            shape, and the average comes back as a new array in its place; a gradient no
            rank has stays None.

    Raises:
        InvalidBufferError: a gradient is None with ``missing_grad="error"``; a NumPy array
            or torch tensor cannot be written in place (read-only, or not contiguous;
            checked after the all-reduce, on every rank).
        CollectiveMismatchError: with ``missing_grad="zeros"``, ranks disagree on a
            gradient's shape or dtype.
        TypeError: ``grads`` is not arrays or a structure of them.
    """
    if missing_grad not in ("error", "zeros"):
        raise ValueError(f"sync_gradients: missing_grad={missing_grad!r}; use 'error' (a None "
                         "gradient is refused) or 'zeros' (it counts as zero on this rank)")
    given, paths, rebuild = _tree.flatten(grads, "grads")
    missing = [i for i, gr in enumerate(given) if gr is None]
    if missing and missing_grad == "error":
        raise InvalidBufferError(
            f"sync_gradients: {paths[missing[0]]} is None"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + ": no gradient yet (backward has not run) or a parameter the forward did not "
            "use. Run backward first, leave it out of grads, or pass missing_grad='zeros' to "
            "count it as zero on this rank")
    if missing_grad == "zeros":
        given = _fill_missing(given, paths, group)
    frameworks = [None if type(gr) is np.ndarray else framework_of(gr) for gr in given]
    arrays: dict[int, Any] = {}
    for i, gr in enumerate(given):
        if gr is not None:
            framework = frameworks[i]
            arrays[i] = (_array.as_array(gr) if framework is None
                         else framework.array(gr, "sync_gradients"))
    by_dtype: dict[str, list[int]] = {}
    for i, array in arrays.items():
        by_dtype.setdefault(str(array.dtype), []).append(i)
    results = list(given)
    for idx in by_dtype.values():
        buffer, layout = _array.flatten([arrays[i] for i in idx])
        all_reduce(buffer, ReduceOp.AVERAGE, group)
        for i, view in zip(idx, layout.views(buffer)):
            framework = frameworks[i]
            if framework is None:
                _array.check_writable(arrays[i], "sync_gradients")
                arrays[i][...] = view
            elif framework.writable:
                framework.array_to_write(given[i], "sync_gradients")[...] = view
                results[i] = given[i]
            else:
                results[i] = framework.wrap(view, given[i])
    return rebuild(results)


def _fill_missing(given: list[Any], paths: list[str], group: ProcessGroup | None) -> list[Any]:
    """Zeros for this rank's None gradients that another rank has (``missing_grad="zeros"``),
    their shape and dtype learnt from one exchange; a gradient every rank lacks stays None."""
    arrays = [None if gr is None else _array.as_array(gr) for gr in given]
    mine = [None if a is None else (tuple(a.shape), str(a.dtype)) for a in arrays]
    table = all_gather_object(mine, group)
    if len({len(t) for t in table}) > 1:
        raise CollectiveMismatchError(
            "sync_gradients: ranks passed different numbers of gradients ("
            + ", ".join(f"rank {r}: {len(t)}" for r, t in enumerate(table)) + ")")
    like = next((a for a in arrays if a is not None), None)
    xp = np if like is None else _array.namespace(like)
    filled = list(given)
    for i, path in enumerate(paths):
        seen = {t[i] for t in table if t[i] is not None}
        if len(seen) > 1:
            detail = ", ".join(f"rank {r}: {t[i]}" for r, t in enumerate(table))
            raise CollectiveMismatchError(
                f"sync_gradients: ranks disagree on the shape or dtype of {path} ({detail})")
        if given[i] is None and seen:
            shape, dtype = seen.pop()
            filled[i] = xp.zeros(shape, dtype=_array.dtype_named(dtype))
    return filled


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
