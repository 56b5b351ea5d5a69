"""The adjoint of each collective, written once for torch and JAX.

Convention: the objective is the **sum over ranks** of what each rank computes from its
results (``J = sum_s L_s(y_s)``), and each rank's input ``x_r`` is its own variable. A rank
that computes the same loss as every other (a replicated loss) counts it ``n`` times: divide
it by the world size to get the gradient of one copy (docs/autodiff.md).

============== ================================ =========================================
forward        y on rank s                      dJ/dx_r (g_s: rank s's cotangent)
============== ================================ =========================================
all_reduce SUM  sum_k x_k                       all_reduce SUM of g: sum_s g_s
all_reduce AVG  (1/n) sum_k x_k                 all_reduce AVERAGE of g: (1/n) sum_s g_s
all_reduce MAX  max_k x_k (MIN alike)           [x_r == y] / ties * sum_s g_s
all_gather      concat_k x_k (rows s_k)         block r of sum_s g_s (a reduce-scatter)
reduce_scatter  block s of sum_k x_k (SUM)      all_gather of g (AVERAGE: divided by n)
broadcast       x_src                           sum_s g_s on src (a reduce), 0 elsewhere
all_to_all      block s of every x_k            all_to_all of g with the sizes swapped
============== ================================ =========================================

MIN and MAX are differentiated through the mask of the ranks holding the extreme, ties
sharing it equally (as ``jnp.max`` and ``torch.amax`` do); PRODUCT is refused (its
gradient ``y / x_r`` is undefined where ``x_r`` is 0). An uneven all-gather's adjoint is an
all-to-all of the cotangent's blocks and a sum, so it moves no more than a reduce-scatter.
Every rule calls :mod:`axondist.comm`, which takes torch tensors and JAX arrays or tracers.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import comm
from .._frameworks import framework_of
from ..backends.plan import split_sizes
from ..errors import InvalidBufferError, UnsupportedDTypeError
from ..ops import ReduceOp
from ..process_group import ProcessGroup


@dataclass(frozen=True)
class Adjoint:
    """One row of the table: a forward collective and what its backward pass does.

    Attributes:
        forward: the forward call (``"all_reduce SUM"``).
        backward: the collective(s) the backward pass makes.
        refused: why there is no gradient (None where there is one).
    """

    forward: str
    backward: str
    refused: str | None = None


#: Every differentiable collective (and reduce op), and its adjoint.
ADJOINTS: dict[tuple[str, ReduceOp | None], Adjoint] = {
    ("all_reduce", ReduceOp.SUM): Adjoint("all_reduce SUM", "all_reduce SUM"),
    ("all_reduce", ReduceOp.AVERAGE): Adjoint("all_reduce AVERAGE", "all_reduce AVERAGE"),
    ("all_reduce", ReduceOp.MAX): Adjoint("all_reduce MAX", "all_reduce SUM (x2), masked"),
    ("all_reduce", ReduceOp.MIN): Adjoint("all_reduce MIN", "all_reduce SUM (x2), masked"),
    ("all_reduce", ReduceOp.PRODUCT): Adjoint(
        "all_reduce PRODUCT", "", refused="the gradient y / x_r is undefined where x_r is 0; "
        "all_gather x and differentiate a product over the gathered axis instead"),
    ("reduce_scatter", ReduceOp.SUM): Adjoint("reduce_scatter SUM", "all_gather"),
    ("reduce_scatter", ReduceOp.AVERAGE): Adjoint("reduce_scatter AVERAGE", "all_gather / n"),
    ("reduce_scatter", ReduceOp.MAX): Adjoint(
        "reduce_scatter MAX", "", refused="use all_reduce MAX and slice this rank's rows"),
    ("reduce_scatter", ReduceOp.MIN): Adjoint(
        "reduce_scatter MIN", "", refused="use all_reduce MIN and slice this rank's rows"),
    ("reduce_scatter", ReduceOp.PRODUCT): Adjoint(
        "reduce_scatter PRODUCT", "", refused="the gradient y / x_r is undefined where x_r "
        "is 0"),
    ("all_gather", None): Adjoint("all_gather", "reduce_scatter SUM (all_to_all + sum when "
                                  "the row counts are not the array_split rule's)"),
    ("broadcast", None): Adjoint("broadcast", "reduce SUM to src; zeros elsewhere"),
    ("all_to_all", None): Adjoint("all_to_all", "all_to_all with send and receive sizes "
                                  "swapped"),
}


def adjoint_of(name: str, op: ReduceOp | str | None = None) -> Adjoint:
    """The table's row for collective ``name`` (with reduce ``op`` for reductions).

    Raises:
        UnsupportedDTypeError: the op has no gradient (the message says why and what to
            do instead).
        ValueError: ``name`` is not a differentiable collective.
    """
    key = (name, None if op is None else ReduceOp.parse(op, "adjoint_of"))
    row = ADJOINTS.get(key)
    if row is None:
        names = sorted({n for n, _ in ADJOINTS})
        raise ValueError(f"adjoint_of: {name!r} (op {op}) is not a differentiable collective; "
                         f"they are {', '.join(names)}")
    if row.refused is not None:
        raise UnsupportedDTypeError(
            f"axondist.differentiable.{name}: {key[1].name if key[1] else ''} has no "
            f"gradient here: {row.refused}")
    return row


@dataclass(frozen=True)
class CallContext:
    """What a backward pass needs to know of its forward call (static, per call).

    Attributes:
        group: the group the forward call ran over, resolved then (the backward pass may
            run on another thread, where the mock world's current world differs).
        in_shape: the forward input's shape.
        op: the reduce op (reductions only).
        src: the broadcast's source rank.
        rows: an all-gather's rows from each rank, or an all-to-all's rows sent to each.
        recv_rows: an all-to-all's rows received from each rank.
    """

    group: ProcessGroup | None = None
    in_shape: tuple[int, ...] = ()
    op: ReduceOp = ReduceOp.SUM
    src: int = 0
    rows: tuple[int, ...] | None = None
    recv_rows: tuple[int, ...] | None = None


def _xp(x: Any) -> Any:
    """torch or jax.numpy: the functions the rules need have the same names in both."""
    framework = framework_of(x)
    if framework is None:
        raise TypeError(f"axondist.differentiable: expected a torch tensor or JAX array, got "
                        f"{type(x).__name__}")
    return sys.modules["torch" if framework.name == "torch" else "jax.numpy"]


def fresh(x: Any) -> Any:
    """``x``, or a contiguous copy where a collective would write into ``x`` (torch)."""
    framework = framework_of(x)
    if framework is not None and framework.writable:
        return x.detach().clone(memory_format=sys.modules["torch"].contiguous_format)
    return x


def all_reduce_backward(g: Any, c: CallContext, x: Any = None, y: Any = None) -> Any:
    """dJ/dx_r of ``y = all_reduce(x, op)`` (``x`` and ``y`` needed for MIN/MAX)."""
    if c.op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return comm.all_reduce(fresh(g), c.op, c.group)
    xp = _xp(g)
    mask = xp.where(x == y, xp.ones_like(g), xp.zeros_like(g))  # the extreme's holders
    ties = comm.all_reduce(fresh(mask), ReduceOp.SUM, c.group)
    total = comm.all_reduce(fresh(g), ReduceOp.SUM, c.group)
    return mask * total / ties


def reduce_scatter_backward(g: Any, c: CallContext) -> Any:
    """dJ/dx_s of ``y = reduce_scatter(x, op)``."""
    rows = c.in_shape[0]
    gathered = comm.all_gather(g, c.group, sizes=tuple(split_sizes(rows, _size(c.group))))
    if c.op is ReduceOp.AVERAGE:
        gathered = gathered / _size(c.group)
    return gathered


def all_gather_backward(g: Any, c: CallContext) -> Any:
    """dJ/dx_r of ``y = all_gather(x)`` with ``c.rows`` rows from each rank: block r of
    the sum of the ranks' cotangents."""
    assert c.rows is not None
    n = len(c.rows)
    if list(c.rows) == split_sizes(sum(c.rows), n):
        block = comm.reduce_scatter(fresh(g), ReduceOp.SUM, c.group)
    else:  # uneven: every rank sends block k to rank k, and sums what it receives
        mine = c.rows[comm.rank(c.group)]
        received = comm.all_to_all(fresh(g), c.group, send_sizes=list(c.rows),
                                   recv_sizes=[mine] * n)
        block = received.reshape((n, mine) + tuple(g.shape[1:])).sum(0)
    return block.reshape(()) if c.in_shape == () else block


def broadcast_backward(g: Any, c: CallContext) -> Any:
    """dJ/dx_r of ``y = broadcast(x, src)``: the sum of the cotangents on the source."""
    total = comm.reduce(fresh(g), c.src, ReduceOp.SUM, c.group)
    return total if comm.rank(c.group) == c.src else _xp(g).zeros_like(g)


def all_to_all_backward(g: Any, c: CallContext) -> Any:
    """dJ/dx_r of ``y = all_to_all(x)``: the blocks sent back whence they came."""
    assert c.rows is not None and c.recv_rows is not None
    return comm.all_to_all(fresh(g), c.group, send_sizes=list(c.recv_rows),
                           recv_sizes=list(c.rows))


def _size(group: ProcessGroup | None) -> int:
    return comm.world_size(group)


def all_to_all_rows(rows: int, group: ProcessGroup | None,
                    send_sizes: Sequence[int] | None,
                    recv_sizes: Sequence[int] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The rows an all-to-all sends to and receives from each rank (asking the others
    for theirs when ``recv_sizes`` is None).

    Raises:
        InvalidBufferError: ``send_sizes`` does not split ``rows`` over the group.
    """
    n = _size(group)
    send = tuple(int(s) for s in send_sizes) if send_sizes is not None \
        else tuple(split_sizes(rows, n))
    if len(send) != n or sum(send) != rows or min(send) < 0:
        raise InvalidBufferError(
            f"all_to_all: send_sizes={list(send)} must list {n} row counts >= 0 adding up to "
            f"x's {rows} rows")
    if recv_sizes is not None:
        return send, tuple(int(r) for r in recv_sizes)
    table = comm.all_gather_object(send, group)
    me = comm.rank(group)
    return send, tuple(int(t[me]) for t in table)


def all_gather_rows(rows: int, group: ProcessGroup | None,
                    sizes: Sequence[int] | None) -> tuple[int, ...]:
    """Every rank's rows in an all-gather (asking the others when ``sizes`` is None)."""
    if sizes is not None:
        return tuple(int(s) for s in sizes)
    return tuple(int(r) for r in comm.all_gather_object(rows, group))


__all__ = ["ADJOINTS", "Adjoint", "CallContext", "adjoint_of", "all_gather_backward",
           "all_gather_rows", "all_reduce_backward", "all_to_all_backward",
           "all_to_all_rows", "broadcast_backward", "fresh", "reduce_scatter_backward"]
