"""Collectives on JAX tracers: ``all_reduce``, ``all_gather``, ``reduce_scatter``,
``broadcast`` and ``all_to_all`` inside ``jax.jit`` (and ``vmap``).

A traced collective becomes an ordered host callback (``io_callback(..., ordered=True)``):
JAX runs the callbacks of one program in program order and the programs of one process
in dispatch order, so every rank makes its collectives in the order its code calls them,
and the callback runs the ordinary eager collective, cross-rank check included. The group
is resolved while tracing and travels inside the callback, because JAX may run the
callback on a thread of its own (where the mock world's thread-local world is absent).
Output shapes must be known while tracing: an all-gather or all-to-all without its sizes
asks the other ranks for theirs then (every rank traces its program on its first call).
Under ``vmap`` the batch travels as one collective on the stacked array.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends.plan import split_sizes
from .errors import CollectiveMismatchError, InvalidBufferError
from .process_group import ProcessGroup, peek_world, resolve_group

#: The collectives that have a traced form (the others refuse, naming these).
TRACED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce")
#: Tracer types that mean a transformation is differentiating the call.
_DIFFERENTIATING = ("JVPTracer", "LinearizeTracer")


@dataclass(frozen=True, eq=False)
class TracedCall:
    """One traced collective: which, with what arguments, over which group.

    Attributes:
        collective: the eager collective (a function of :mod:`axondist.comm`).
        arguments: its arguments but ``x`` and ``group``, sizes filled in.
        group: the group, resolved while tracing.
        implicit_group: the caller passed no group (the world current while tracing).
        rows_out: leading size of the result (None when it keeps the input's shape).
    """

    collective: Callable[..., Any]
    arguments: dict[str, Any]
    group: ProcessGroup
    implicit_group: bool
    rows_out: int | None

    @property
    def name(self) -> str:
        return self.collective.__name__

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The result's shape for an input of ``shape``."""
        if self.rows_out is None:
            return shape
        return (self.rows_out,) + tuple(shape[1:])

    def on_host(self, array: np.ndarray) -> np.ndarray:
        """Run the eager collective on ``array`` (in the callback, on any thread)."""
        self._check_thread()
        if self.name in ("all_reduce", "broadcast", "reduce"):
            array = np.array(array, copy=True)  # written in place
        else:
            array = np.ascontiguousarray(array)
        result = self.collective(array, group=self.group, **self.arguments)
        return np.asarray(result)

    def _check_thread(self) -> None:
        here = peek_world()
        world = self.group
        if not self.implicit_group or here is None or here is world:
            return
        if here.world_size == world.world_size and here.rank != world.rank:
            raise CollectiveMismatchError(
                f"{self.name} inside jax.jit: the jitted function was traced on rank "
                f"{world.rank} and now runs on rank {here.rank}; ranks that are threads of "
                "one process (axondist.spawn) share JAX's trace cache, so make the jitted "
                "function inside each rank's function, or pass group= explicitly")


def _arguments(collective: Callable[..., Any], x: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = inspect.signature(collective).bind(x, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("x")
    return arguments


def _refuse(name: str, why: str) -> InvalidBufferError:
    return InvalidBufferError(f"{name}: {why}")


def plan_call(collective: Callable[..., Any], x: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> TracedCall:
    """Check a collective's arguments on tracer ``x`` and settle its result's shape
    (exchanging row counts with the other ranks where they are not given).

    Raises:
        InvalidBufferError: a collective with no traced form, ``async_op``, ``out``, or a
            shape the collective cannot split.
        CollectiveMismatchError: ``sizes``/``recv_sizes`` contradict this rank's input.
    """
    name = getattr(collective, "__name__", "prepared call")
    if name not in TRACED:
        raise _refuse(name, "has no form inside jax.jit/grad/vmap (a JAX tracer came in); "
                      f"the collectives that work there are {', '.join(TRACED)}; call "
                      f"{name} outside the transformation")
    if type(x).__name__ in _DIFFERENTIATING:
        raise _refuse(name, "jax.grad/jvp is differentiating an axondist.comm collective, "
                      "which has no gradient (nor have the backward passes of "
                      "axondist.differentiable: no second derivatives); for a first derivative "
                      "use axondist.differentiable." + name)
    arguments = _arguments(collective, x, args, kwargs)
    if arguments.pop("async_op", False):
        raise _refuse(name, "async_op=True has no meaning inside jax.jit (JAX orders the "
                      "call itself); leave it False")
    arguments.pop("out", None)
    given = arguments.pop("group")
    group = resolve_group(given)
    shape = tuple(int(d) for d in x.shape)
    rows_out = _rows_out(name, shape, arguments, group)
    return TracedCall(collective, arguments, group, given is None, rows_out)


def _exchange(group: ProcessGroup, value: Any) -> list[Any]:
    return group.backend_for("all_gather_object").allgather_object(value)


def _rows_out(name: str, shape: tuple[int, ...], arguments: dict[str, Any],
              group: ProcessGroup) -> int | None:
    n, me = group.world_size, group.rank
    if name == "all_gather":
        rows = shape[0] if shape else 1
        sizes = arguments.get("sizes")
        if sizes is None:
            arguments["sizes"] = sizes = [int(r) for r in _exchange(group, rows)]
        sizes = [int(s) for s in sizes]
        if len(sizes) != n or sizes[me] != rows:
            raise CollectiveMismatchError(
                f"all_gather: sizes={sizes} must list {n} row counts with this rank's own "
                f"({rows}) at index {me}")
        arguments["sizes"] = sizes
        return sum(sizes)
    if name in ("reduce_scatter", "all_to_all") and not shape:
        raise _refuse(name, "a 0-d array has no axis to split; pass x[None]")
    if name == "reduce_scatter":
        return split_sizes(shape[0], n)[me]
    if name == "all_to_all":
        return _all_to_all_rows(shape[0], arguments, group)
    return None


def _all_to_all_rows(rows: int, arguments: dict[str, Any], group: ProcessGroup) -> int:
    n, me = group.world_size, group.rank
    send = arguments.get("send_sizes")
    send_rows = split_sizes(rows, n) if send is None else [int(s) for s in send]
    if len(send_rows) != n or sum(send_rows) != rows or min(send_rows) < 0:
        raise InvalidBufferError(
            f"all_to_all: send_sizes={send_rows} must list {n} row counts >= 0 adding up to "
            f"x's {rows} rows")
    arguments["send_sizes"] = send_rows
    if arguments.get("recv_sizes") is None:
        table = _exchange(group, send_rows)
        arguments["recv_sizes"] = [int(t[me]) for t in table]
    recv = [int(r) for r in arguments["recv_sizes"]]
    arguments["recv_sizes"] = recv
    return sum(recv)


def run_traced(collective: Callable[..., Any], x: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any], out: Any = None) -> Any:
    """``collective(x, *args, **kwargs)`` for a JAX tracer ``x``: a new traced array."""
    if out is not None:
        name = getattr(collective, "__name__", "prepared call")
        raise _refuse(name, "out= cannot be given inside jax.jit (JAX arrays are immutable); "
                      "use the array returned")
    return _bind(plan_call(collective, x, args, kwargs), x)


def _bind(call: TracedCall, x: Any) -> Any:
    jax = sys.modules["jax"]
    from jax.custom_batching import custom_vmap
    from jax.experimental import io_callback

    @custom_vmap
    def traced(value: Any) -> Any:
        out = jax.ShapeDtypeStruct(call.out_shape(tuple(value.shape)), value.dtype)
        return io_callback(call.on_host, out, value, ordered=True)

    @traced.def_vmap
    def batched(axis_size: int, in_batched: list[bool], value: Any) -> tuple[Any, bool]:
        if not in_batched[0]:  # the same value for every example: one call, then broadcast
            one = _bind(call, value)
            return jax.numpy.broadcast_to(one, (axis_size,) + one.shape), True
        return _bind_batched(call, value), True

    return traced(x)


def _bind_batched(call: TracedCall, value: Any) -> Any:
    """The collective of every example at once: the batch (axis 0 of ``value``) becomes
    axis 1, behind the rows the collective splits or joins, and back."""
    if call.rows_out is None and call.name != "all_gather":  # element-wise: as it is
        return _bind(call, value)
    jnp = sys.modules["jax"].numpy
    if value.ndim == 1:  # 0-d examples: all_gather stacks them as one row each
        value = value[:, None]
    rows_first = jnp.moveaxis(value, 0, 1)
    return jnp.moveaxis(_bind(call, rows_first), 1, 0)


__all__ = ["TRACED", "TracedCall", "plan_call", "run_traced"]
