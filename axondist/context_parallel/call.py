"""One context-parallel call, checked on every rank and agreed between them.

:func:`prepare` checks this rank's arrays, then exchanges one small record per
rank (what each passed, or the error it found), so a bad input or ranks that
disagree (length, heads, layout, method, dtype) raise the same error on every
rank instead of leaving some waiting. The :class:`Call` it returns holds what
every method needs: each rank's token count and global positions, the mask rule,
the scale, the compute dtype, and the reshapes between ``(..., H, T, d)`` and the
grouped form the kernel takes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _array
from ..backends.base import Backend
from ..errors import CollectiveMismatchError, InvalidBufferError, UnsupportedDTypeError
from ..process_group import ProcessGroup, resolve_group
from .kernel import MaskRule, compute_dtype
from .layout import layout_named

Array = Any


@dataclass(frozen=True)
class Call:
    """What one call of one method on one rank works from.

    Attributes:
        where: the public function's name, for messages.
        group, backend, rank, world_size: where it runs.
        counts: every rank's token count, in rank order.
        positions: every rank's global token positions, in rank order.
        rule: which pairs may attend.
        scale: the scores' factor.
        dtype: the inputs' dtype; ``cdtype`` the compute dtype (float32 or wider).
        q_lead, kv_lead: the leading shapes of the queries and of the keys.
        d, dv: the widths of queries/keys and of values.
    """

    where: str
    group: ProcessGroup
    backend: Backend
    counts: list[int]
    positions: list[np.ndarray]
    rule: MaskRule
    scale: float
    dtype: np.dtype
    cdtype: np.dtype
    q_lead: tuple[int, ...]
    kv_lead: tuple[int, ...]
    d: int
    dv: int
    xp: Any = field(repr=False)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def seq_len(self) -> int:
        return sum(self.counts)

    @property
    def groups(self) -> int:
        """Query heads per key head (1 without grouped-query attention)."""
        kv = math.prod(self.kv_lead)
        return math.prod(self.q_lead) // kv if kv else 1

    def grouped(self, a: Array, heads_lead: tuple[int, ...] | None = None) -> Array:
        """``a`` of shape ``(*q_lead, T, c)`` (or ``(*q_lead, T)``) as ``(*kv_lead, G, T, c)``
        in the compute dtype; ``heads_lead`` replaces ``kv_lead`` (Ulysses' head shards)."""
        lead = self.kv_lead if heads_lead is None else heads_lead
        tail = tuple(a.shape[len(lead):])
        return a.reshape(lead + (self.groups,) + tail).astype(self.cdtype, copy=False)

    def grouped_kv(self, a: Array) -> Array:
        """Keys or values ``(*kv_lead, S, c)`` as ``(*kv_lead, 1, S, c)``, compute dtype."""
        return a[..., None, :, :].astype(self.cdtype, copy=False)

    def ungrouped(self, a: Array, lead: tuple[int, ...], dtype: Any) -> Array:
        """The inverse of :meth:`grouped`: ``(*lead, T, ...)`` in ``dtype``, contiguous."""
        shape = lead + tuple(a.shape[len(lead) + 1:])
        return self.xp.ascontiguousarray(a.reshape(shape).astype(dtype, copy=False))

    def kv_size(self, tokens: int) -> int:
        """Elements of one rank's keys and values packed together (``tokens`` tokens)."""
        return math.prod(self.kv_lead) * tokens * (self.d + self.dv)

    def pack_kv(self, k: Array, v: Array, dtype: Any) -> Array:
        """``k`` and ``v`` (or their gradients) flattened into one contiguous buffer."""
        xp = self.xp
        return xp.concatenate([k.reshape(-1), v.reshape(-1)]).astype(dtype, copy=False)

    def unpack_kv(self, flat: Array, tokens: int) -> tuple[Array, Array]:
        """The ``(*kv_lead, tokens, d)`` keys and ``(..., dv)`` values in a packed buffer."""
        lead = self.kv_lead
        split = math.prod(lead) * tokens * self.d
        return (flat[:split].reshape(lead + (tokens, self.d)),
                flat[split:].reshape(lead + (tokens, self.dv)))


def _floating(a: Any) -> bool:
    return _array.is_floating(a.dtype)


def check_local(where: str, q: Array, k: Array, v: Array, saved: Sequence[tuple[str, Array]],
                scale: Any, heads_split: int | None) -> None:
    """Check this rank's arrays alone (shapes, dtypes); ``heads_split`` is the world size
    when the method splits heads (Ulysses).

    Raises:
        InvalidBufferError, UnsupportedDTypeError, ValueError: naming the argument.
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim < 2:
            raise InvalidBufferError(f"{where}: {name} has shape {tuple(a.shape)}; pass "
                                     "(..., T, d): tokens on axis -2, features on axis -1")
        if not _floating(a):
            raise UnsupportedDTypeError(f"{where}: {name} has dtype {a.dtype}; pass floating "
                                        "arrays (float16, bfloat16, float32, float64)")
    if not q.dtype == k.dtype == v.dtype:
        raise UnsupportedDTypeError(f"{where}: q, k and v have dtypes {q.dtype}, {k.dtype}, "
                                    f"{v.dtype}; convert them to one dtype")
    if k.shape[:-1] != v.shape[:-1]:
        raise InvalidBufferError(f"{where}: k has shape {tuple(k.shape)} and v "
                                 f"{tuple(v.shape)}; they must agree on every axis but the last")
    if q.shape[-1] != k.shape[-1]:
        raise InvalidBufferError(f"{where}: q has width {q.shape[-1]} and k {k.shape[-1]}; "
                                 "queries and keys must have the same last axis")
    if q.shape[-2] != k.shape[-2]:
        raise InvalidBufferError(f"{where}: q holds {q.shape[-2]} tokens and k {k.shape[-2]}; "
                                 "pass this rank's queries, keys and values for the same tokens")
    ql, kl = tuple(q.shape[:-2]), tuple(k.shape[:-2])
    if ql != kl:
        ok = (len(ql) == len(kl) >= 1 and ql[:-1] == kl[:-1] and kl[-1] > 0
              and ql[-1] % kl[-1] == 0)
        if not ok:
            raise InvalidBufferError(
                f"{where}: q has leading shape {ql} and k {kl}; they must be equal, or differ "
                "only in the heads axis (-3) with the query heads a multiple of the key heads "
                "(grouped-query attention)")
    if heads_split is not None:
        if q.ndim < 3:
            raise InvalidBufferError(f"{where}: method 'ulysses' splits heads, but q has shape "
                                     f"{tuple(q.shape)}; pass (..., heads, T, d)")
        for name, heads in (("query", q.shape[-3]), ("key", k.shape[-3])):
            if heads % heads_split:
                raise InvalidBufferError(
                    f"{where}: method 'ulysses' splits the {heads} {name} heads over "
                    f"{heads_split} ranks, which does not divide; use a head count that is a "
                    "multiple of the group size, or method='ring' or 'all_gather'")
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    expected = {"out": out_shape, "grad_out": out_shape, "lse": tuple(q.shape[:-1])}
    for name, a in saved:
        if tuple(a.shape) != expected[name]:
            raise InvalidBufferError(f"{where}: {name} has shape {tuple(a.shape)}, expected "
                                     f"{expected[name]} (from q and v); pass what attention "
                                     "returned for these q, k, v")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"{where}: scale={scale!r} must be a positive number (or None for "
                         "1/sqrt(d))")


def _bounds(cu_seqlens: Any, where: str) -> tuple[int, ...] | None:
    if cu_seqlens is None:
        return None
    try:
        bounds = tuple(int(b) for b in _array.to_host(_array.as_array(cu_seqlens)).reshape(-1))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: cu_seqlens={cu_seqlens!r} is not a list of ints") from exc
    if len(bounds) < 2 or bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"{where}: cu_seqlens={list(bounds)} must start at 0 and not decrease, "
                         "with at least two entries ([0, length] for one document)")
    return bounds


def prepare(where: str, method: str, layout: str, q: Array, k: Array, v: Array,
            saved: Sequence[tuple[str, Array]], group: ProcessGroup | None, causal: bool,
            scale: float | None, cu_seqlens: Any, splits_heads: bool) -> Call:
    """Check the call on this rank, agree on it with the others, and describe it.

    Raises:
        the first rank's error about its own arrays (on every rank, naming that rank);
        CollectiveMismatchError: ranks passed different settings or shapes, or hold token
            counts the layout does not give them.
    """
    g = resolve_group(group)
    backend = g.backend_for(where)
    problem: BaseException | None = None
    record: tuple[Any, ...] = ()
    try:
        chosen = layout_named(layout, where)
        bounds = _bounds(cu_seqlens, where)
        check_local(where, q, k, v, saved, scale, g.world_size if splits_heads else None)
        record = (("method", method), ("layout", chosen.name), ("causal", bool(causal)),
                  ("scale", scale), ("cu_seqlens", bounds),
                  ("q leading shape", tuple(q.shape[:-2])),
                  ("k leading shape", tuple(k.shape[:-2])),
                  ("width (q, k)", int(q.shape[-1])), ("width (v)", int(v.shape[-1])),
                  ("dtype", str(q.dtype)), ("array library", _array.library_name(q)))
    except (ValueError, TypeError) as exc:
        problem = exc
    everyone = backend.allgather_object((problem, record, int(q.shape[-2]) if q.ndim >= 2
                                         else 0))
    for r, (found, _, _) in enumerate(everyone):
        if found is not None:
            raise type(found)(f"{found} (on rank {r})" if g.world_size > 1 else str(found))
    for i, (name, _) in enumerate(record):
        values = [rec[i][1] for _, rec, _ in everyone]
        if any(x != values[0] for x in values):
            said = ", ".join(f"rank {r} passed {x}" for r, x in enumerate(values))
            raise CollectiveMismatchError(f"{where}: the ranks disagree on the {name}: {said}; "
                                          "pass the same on every rank of the group")
    counts = [t for _, _, t in everyone]
    seq_len, n = sum(counts), g.world_size
    positions = [chosen.indices(seq_len, n, r) for r in range(n)]
    expected = [len(p) for p in positions]
    if counts != expected:
        raise CollectiveMismatchError(
            f"{where}: the ranks hold {counts} tokens, but the {chosen.name} layout of "
            f"{seq_len} tokens over {n} ranks gives {expected}; cut the sequence with "
            f"axondist.context_parallel.shard(x, {n}, rank, layout={chosen.name!r})")
    if bounds is not None and bounds[-1] > seq_len:
        raise ValueError(f"{where}: cu_seqlens ends at {bounds[-1]}, past the sequence's "
                         f"{seq_len} tokens; the last boundary is the true length")
    return Call(where=where, group=g, backend=backend, counts=counts, positions=positions,
                rule=MaskRule(bool(causal), bounds),
                scale=float(scale) if scale is not None else 1.0 / math.sqrt(max(q.shape[-1], 1)),
                dtype=np.dtype(q.dtype), cdtype=compute_dtype(q.dtype),
                q_lead=tuple(q.shape[:-2]), kv_lead=tuple(k.shape[:-2]),
                d=int(q.shape[-1]), dv=int(v.shape[-1]), xp=_array.namespace(q, k, v))


__all__ = ["Call", "check_local", "prepare"]
