"""The differentiable collectives on torch tensors: one ``torch.autograd.Function`` each,
whose backward is the row of :mod:`~axondist.differentiable.adjoints` for its forward.

Each forward reduces a copy (the input is left as it was, as an autograd graph needs);
each backward makes its collective over the group its forward used, so the ranks must
call ``backward`` alike, as they called the forward. The backward passes are not themselves
differentiated (``create_graph=True`` through them raises torch's own error).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .. import comm
from ..ops import ReduceOp
from . import adjoints
from .adjoints import CallContext, fresh


class AllReduce(torch.autograd.Function):
    """``y = all_reduce(x, op)``; backward: the all_reduce table row."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: CallContext) -> torch.Tensor:
        y = comm.all_reduce(fresh(x), call.op, call.group)
        ctx.call = call
        if call.op in (ReduceOp.MIN, ReduceOp.MAX):
            ctx.save_for_backward(x.detach(), y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors if ctx.call.op in (ReduceOp.MIN, ReduceOp.MAX) else ()
        return adjoints.all_reduce_backward(g.contiguous(), ctx.call, *saved), None


class AllGather(torch.autograd.Function):
    """``y = concat_k x_k`` (rows ``call.rows``); backward: a reduce-scatter of ``g``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: CallContext) -> torch.Tensor:
        ctx.call = call
        return comm.all_gather(x.detach(), call.group, sizes=call.rows)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return adjoints.all_gather_backward(g.contiguous(), ctx.call), None


class ReduceScatter(torch.autograd.Function):
    """``y = block r of reduce(x)``; backward: an all-gather of ``g``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: CallContext) -> torch.Tensor:
        ctx.call = call
        return comm.reduce_scatter(x.detach().contiguous(), call.op, call.group)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return adjoints.reduce_scatter_backward(g.contiguous(), ctx.call), None


class Broadcast(torch.autograd.Function):
    """``y = x_src``; backward: a reduce of ``g`` to the source."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: CallContext) -> torch.Tensor:
        ctx.call = call
        return comm.broadcast(fresh(x), call.group, src=call.src)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return adjoints.broadcast_backward(g.contiguous(), ctx.call), None


class AllToAll(torch.autograd.Function):
    """``y = every rank's block for this rank``; backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: CallContext) -> torch.Tensor:
        ctx.call = call
        return comm.all_to_all(x.detach().contiguous(), call.group,
                               send_sizes=call.rows, recv_sizes=call.recv_rows)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return adjoints.all_to_all_backward(g.contiguous(), ctx.call), None


FUNCTIONS: dict[str, type[torch.autograd.Function]] = {
    "all_reduce": AllReduce, "all_gather": AllGather, "reduce_scatter": ReduceScatter,
    "broadcast": Broadcast, "all_to_all": AllToAll}


def apply(name: str, x: torch.Tensor, call: CallContext) -> torch.Tensor:
    """The differentiable collective ``name`` on ``x``."""
    return FUNCTIONS[name].apply(x, call)


__all__ = ["FUNCTIONS", "AllGather", "AllReduce", "AllToAll", "Broadcast", "ReduceScatter",
           "apply"]
