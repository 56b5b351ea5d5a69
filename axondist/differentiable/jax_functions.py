"""The differentiable collectives on JAX arrays: ``jax.custom_vjp`` functions whose
backward is the row of :mod:`~axondist.differentiable.adjoints` for their forward.

They work eagerly and under ``jax.jit``, ``grad`` and ``vmap``: on tracers the collectives
of :mod:`axondist.comm` become ordered host callbacks (see ``axondist._jax_traced``), in
the forward and in the backward pass alike. The call's context (group, sizes, op) is a
static argument, fixed while tracing.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from .. import comm
from ..ops import ReduceOp
from . import adjoints
from .adjoints import CallContext


def _forward(name: str, x: Any, call: CallContext) -> Any:
    if name == "all_reduce":
        return comm.all_reduce(x, call.op, call.group)
    if name == "all_gather":
        return comm.all_gather(x, call.group, sizes=call.rows)
    if name == "reduce_scatter":
        return comm.reduce_scatter(x, call.op, call.group)
    if name == "broadcast":
        return comm.broadcast(x, call.group, src=call.src)
    return comm.all_to_all(x, call.group, send_sizes=call.rows, recv_sizes=call.recv_rows)


def _backward(name: str, g: Any, call: CallContext, saved: tuple[Any, ...]) -> Any:
    if name == "all_reduce":
        return adjoints.all_reduce_backward(g, call, *saved)
    if name == "all_gather":
        return adjoints.all_gather_backward(g, call)
    if name == "reduce_scatter":
        return adjoints.reduce_scatter_backward(g, call)
    if name == "broadcast":
        return adjoints.broadcast_backward(g, call)
    return adjoints.all_to_all_backward(g, call)


def _keeps_values(name: str, call: CallContext) -> bool:
    return name == "all_reduce" and call.op in (ReduceOp.MIN, ReduceOp.MAX)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _collective(x: Any, name: str, call: CallContext) -> Any:
    return _forward(name, x, call)


def _collective_fwd(x: Any, name: str, call: CallContext) -> tuple[Any, tuple[Any, ...]]:
    y = _forward(name, x, call)
    return y, ((x, y) if _keeps_values(name, call) else ())


def _collective_bwd(name: str, call: CallContext, saved: tuple[Any, ...],
                    g: Any) -> tuple[Any]:
    return (_backward(name, g, call, saved),)


_collective.defvjp(_collective_fwd, _collective_bwd)


def apply(name: str, x: Any, call: CallContext) -> Any:
    """The differentiable collective ``name`` on the JAX array (or tracer) ``x``."""
    return _collective(x, name, call)


__all__ = ["apply"]
