"""Attention over a sequence split across a group: the public forward and backward.

``attention`` and ``attention_backward`` check the call on every rank
(:func:`~axondist.context_parallel.call.prepare`), then run the chosen entry of
:data:`METHODS`. Each method computes exactly the softmax attention of the whole
sequence, restricted to this rank's queries (and, backward, this rank's keys and
values); they differ only in how keys and values reach the queries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _array
from .._frameworks import Framework, framework_of
from ..errors import InvalidBufferError
from ..process_group import ProcessGroup
from .call import Call, prepare
from .gather import gather_backward, gather_forward
from .ring import ring_backward, ring_forward
from .ulysses import ulysses_backward, ulysses_forward

Array = Any


@dataclass(frozen=True)
class Method:
    """One way to bring keys and values to the queries.

    Attributes:
        name: the ``method=`` name.
        forward: ``forward(call, q, k, v) -> (out, lse)``, grouped, compute dtype.
        backward: ``backward(call, q, k, v, out, lse, grad_out) -> (dq, dk, dv)``.
        splits_heads: it splits heads over the group (their count must divide by it).
        summary: one line for the docs and error messages.
    """

    name: str
    forward: Callable[..., tuple[Array, Array]]
    backward: Callable[..., tuple[Array, Array, Array]]
    splits_heads: bool
    summary: str


#: Every method, by name.
METHODS: dict[str, Method] = {
    "ring": Method("ring", ring_forward, ring_backward, False,
                   "keys and values pass around the ring in W-1 overlapped steps"),
    "all_gather": Method("all_gather", gather_forward, gather_backward, False,
                         "keys and values gathered once; dK/dV reduce-scattered back"),
    "ulysses": Method("ulysses", ulysses_forward, ulysses_backward, True,
                      "all-to-all from sequence shards to head shards and back"),
}


def method_named(name: Any, where: str) -> Method:
    """The :class:`Method` called ``name``.

    Raises:
        ValueError: no method has that name (the message lists them).
    """
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise ValueError(f"{where}: method={name!r} is not one of {', '.join(METHODS)}")
    return method


def _arrays(where: str, named: Sequence[tuple[str, Any]]) -> tuple[Framework | None, list[Any]]:
    """The NumPy/CuPy arrays of the inputs, and their common framework (None for NumPy/CuPy).

    Raises:
        InvalidBufferError: the inputs mix frameworks.
    """
    frameworks = [framework_of(x) for _, x in named]
    if any(f is not frameworks[0] for f in frameworks):
        said = ", ".join(f"{n} is {f.name if f else type(x).__module__.split('.')[0]}"
                         for (n, x), f in zip(named, frameworks))
        raise InvalidBufferError(f"{where}: the inputs mix array frameworks ({said}); pass "
                                 "them all as one framework's arrays")
    framework = frameworks[0]
    return framework, [framework.array(x, where) if framework is not None else
                       _array.as_array(x) for _, x in named]


def _results(framework: Framework | None, like: Any, arrays: Sequence[Array]) -> tuple[Any, ...]:
    if framework is None:
        return tuple(arrays)
    return tuple(framework.wrap(a, like) for a in arrays)


def _empty_forward(call: Call, q: Array) -> tuple[Array, Array]:
    xp = call.xp
    return (xp.zeros(tuple(q.shape[:-1]) + (call.dv,), dtype=call.dtype),
            xp.full(tuple(q.shape[:-1]), -xp.inf, dtype=call.cdtype))


def attention(q: Any, k: Any, v: Any, group: ProcessGroup | None = None, *, causal: bool = True,
              layout: str = "zigzag", method: str = "ring", scale: float | None = None,
              cu_seqlens: Sequence[int] | None = None) -> tuple[Any, Any]:
    """O = softmax(Q K^T * scale + M) V for this rank's queries, over the whole sequence.

    Each rank passes its own tokens, in ``layout``'s order (see
    :func:`~axondist.context_parallel.shard`); M masks keys after the query (``causal``),
    in another document or padding (``cu_seqlens``), by global position. Collective:
    every rank of the group calls it with the same settings.

    Args:
        q: queries ``(..., T, d)``; leading axes are batch and heads.
        k: keys ``(..., T, d)``, the same leading shape, or fewer heads on axis -3 (the
            query heads a multiple of them: grouped-query attention).
        v: values ``(..., T, dv)`` with ``k``'s leading shape.
        group: the context-parallel group (the current world when None).
        causal: a query sees only keys at or before its position.
        layout: ``"zigzag"`` (balanced under a causal mask) or ``"contiguous"``.
        method: ``"ring"``, ``"all_gather"`` or ``"ulysses"`` (see :data:`METHODS`).
        scale: the scores' factor; ``1/sqrt(d)`` when None.
        cu_seqlens: packed documents' global boundaries ``[0, e1, ..., en]``: tokens attend
            within their document only, and tokens at or past ``en`` are padding (their
            outputs are zero).

    Returns:
        ``(out, lse)``: ``out`` ``(..., T, dv)`` in the inputs' dtype, and ``lse``
        ``(..., T)``, each query row's log-sum-exp of its scaled scores, in float32
        (float64 for float64 inputs); -inf for a row that sees no key. Torch tensors or
        JAX arrays in give the same framework out.

    Raises:
        InvalidBufferError: shapes that do not fit, or heads that ``"ulysses"`` cannot split.
        UnsupportedDTypeError: non-floating or mixed dtypes.
        CollectiveMismatchError: ranks disagree on settings, shapes or the layout's counts.
        ValueError: an unknown method or layout, a bad scale or cu_seqlens.
    """
    where = "context_parallel.attention"
    chosen = method_named(method, where)
    framework, (qa, ka, va) = _arrays(where, [("q", q), ("k", k), ("v", v)])
    call = prepare(where, chosen.name, layout, qa, ka, va, (), group, causal, scale, cu_seqlens,
                   chosen.splits_heads)
    if call.seq_len == 0:
        return _results(framework, q, _empty_forward(call, qa))
    out, lse = chosen.forward(call, qa, ka, va)
    return _results(framework, q, [call.ungrouped(out, call.q_lead, call.dtype),
                                   call.ungrouped(lse, call.q_lead, call.cdtype)])


def attention_backward(q: Any, k: Any, v: Any, out: Any, lse: Any, grad_out: Any,
                       group: ProcessGroup | None = None, *, causal: bool = True,
                       layout: str = "zigzag", method: str = "ring", scale: float | None = None,
                       cu_seqlens: Sequence[int] | None = None) -> tuple[Any, Any, Any]:
    """dQ, dK, dV of :func:`attention` for this rank's tokens, from dO = ``grad_out``.

    With P = exp(S - lse) (masked pairs 0) and D = rowsum(dO * O): dV = P^T dO,
    dS = P * (dO V^T - D), dQ = scale dS K, dK = scale dS^T Q, each summed over every
    rank's share and delivered to the rank that holds those tokens. Pass the same
    settings as the forward call, and its ``out`` and ``lse``.

    Returns:
        ``(grad_q, grad_k, grad_v)`` shaped like ``q``, ``k``, ``v``, in their dtype
        (accumulated in float32 or wider).

    Raises:
        as :func:`attention`; InvalidBufferError also when ``out``, ``lse`` or ``grad_out``
        does not have the shape the forward gives.
    """
    where = "context_parallel.attention_backward"
    chosen = method_named(method, where)
    framework, arrays = _arrays(where, [("q", q), ("k", k), ("v", v), ("out", out),
                                        ("lse", lse), ("grad_out", grad_out)])
    qa, ka, va, oa, la, ga = arrays
    call = prepare(where, chosen.name, layout, qa, ka, va,
                   (("out", oa), ("lse", la), ("grad_out", ga)), group, causal, scale,
                   cu_seqlens, chosen.splits_heads)
    if call.seq_len == 0:
        xp = call.xp
        return _results(framework, q, [xp.zeros(a.shape, dtype=call.dtype) for a in (qa, ka, va)])
    grad_q, grad_k, grad_v = chosen.backward(call, qa, ka, va, oa, la, ga)
    xp = call.xp
    return _results(framework, q, [call.ungrouped(grad_q, call.q_lead, call.dtype),
                                   xp.ascontiguousarray(grad_k.astype(call.dtype, copy=False)),
                                   xp.ascontiguousarray(grad_v.astype(call.dtype, copy=False))])


__all__ = ["METHODS", "Method", "attention", "attention_backward", "method_named"]

