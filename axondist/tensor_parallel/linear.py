"""The column- and row-parallel linear layers (Megatron-LM's pair).

``ColumnParallelLinear`` splits the weight's output features, ``RowParallelLinear`` its
input features; a column layer, an element-wise function and a row layer communicate once
forward (the row layer's all-reduce) and once backward (the column layer's input-gradient
all-reduce). Dense convention: ``y = x @ W.T + b`` with ``W`` of shape ``(out, in)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _array
from .._validate import positive_int
from ..comm import all_gather, split_sizes
from ..parameter import Parameter
from ..process_group import ProcessGroup, resolve_group
from .dense import Init, batch_sum, check_dense, full_dense, store_grad, weight_grad
from .mappings import (
    adjoint,
    gather_last_axis,
    identity,
    reduce_sum,
    shard_bounds,
    split_last_axis,
)

Array = Any


class _ParallelLinear:
    """What the column and row layers share: group, shard bookkeeping, checks."""

    _split_name = ""  # "out" or "in": which feature axis is split
    weight: Parameter
    bias: Parameter | None

    def _setup(self, in_features: int, out_features: int, group: ProcessGroup | None) -> None:
        name = type(self).__name__
        in_features = positive_int(in_features, name, "in_features")
        out_features = positive_int(out_features, name, "out_features")
        self.group = resolve_group(group)
        self.group.backend_for(name)  # a clear error on non-members
        self.in_features, self.out_features = int(in_features), int(out_features)
        p, r = self.group.world_size, self.group.rank
        split = self.out_features if self._split_name == "out" else self.in_features
        #: every rank's width along the split feature axis, in rank order
        self.shard_sizes: list[int] = split_sizes(split, p)
        #: this rank's features along the split axis
        self.shard = slice(*shard_bounds(split, p, r))
        self._saved: Array | None = None
        self._out_shape: tuple[int, ...] | None = None

    def parameters(self) -> list[Parameter]:
        """This rank's parameters: the weight shard, then the bias (when there is one)."""
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def replicated_parameters(self) -> list[Parameter]:
        """The parameters every rank holds whole (RowParallelLinear's bias), not shards."""
        return [self.bias] if self._split_name == "in" and self.bias is not None else []

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def _where(self) -> str:
        g = self.group
        return (f"{type(self).__name__}(in_features={self.in_features}, "
                f"out_features={self.out_features}, rank {g.rank} of {g.world_size}, "
                f"{self._split_name} features {self.shard.start}:{self.shard.stop})")

    __repr__ = _where

    def _check_input(self, x: Array, width: int, what: str) -> Array:
        x = _array.as_array(x)
        if x.ndim == 0 or x.shape[-1] != width:
            raise ValueError(f"{self._where()}.forward: input of shape {tuple(x.shape)} has last "
                             f"dimension {x.shape[-1] if x.ndim else 'none'}, expected {what}="
                             f"{width}; pass x of shape (..., {width})")
        return x

    def _check_grad(self, grad_y: Array) -> Array:
        if self._saved is None:
            raise RuntimeError(f"{self._where()}.backward: called before forward; run forward(x) "
                               "first (it saves the input backward needs)")
        grad_y = _array.as_array(grad_y)
        if tuple(grad_y.shape) != self._out_shape:
            raise ValueError(f"{self._where()}.backward: grad_y of shape {tuple(grad_y.shape)}, "
                             f"expected the forward output's shape {self._out_shape}")
        return grad_y


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A (out, in) split along its rows (output features) across the group.

    Rank r holds ``A_r = A[out slice r, :]`` and ``b_r = b[out slice r]`` and
    computes ``Y_r = X A_r^T + b_r``, its block of the output's last axis. The
    input X is replicated (every rank passes the same X), so its gradient is
    the sum of every rank's ``dY_r A_r``: backward all-reduces it (the adjoint
    of forward's identity). With ``gather_output`` the blocks are gathered
    into the full Y on every rank (backward then expects the full, replicated
    dY and keeps its own block); without it, Y stays split along the last axis
    (feed it to a :class:`RowParallelLinear` with ``input_is_parallel=True``).

    Args:
        in_features: width of X's last axis.
        out_features: width of Y's last axis; need not divide the group size
            (shards follow :func:`numpy.array_split`).
        bias: learn b.
        group: the tensor-parallel group (the current world when None).
        gather_output: return the full Y rather than this rank's block.
        dtype: the parameters' dtype.
        seed: every rank draws the full dense A (and b) from this seed and
            keeps its slice, so the layer stands for the same dense layer
            whatever the group size (at the transient cost of one full weight).
        init: ``init(rng, (out, in)) -> array``, the full weight's initializer
            (:func:`default_init` when None); b is uniform in ±1/sqrt(in).

    Attributes:
        weight: Parameter of shape ``(shard_sizes[r], in_features)``.
        bias: Parameter of shape ``(shard_sizes[r],)``, or None.
    """

    _split_name = "out"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: ProcessGroup | None = None, gather_output: bool = True,
                 dtype: Any = np.float32, seed: int = 0, init: Init | None = None) -> None:
        self._setup(in_features, out_features, group)
        self.gather_output = bool(gather_output)
        w, b = full_dense(self.in_features, self.out_features, bias, seed, init)
        self._keep_shards(w, b, dtype)

    @classmethod
    def from_dense(cls, weight: Array, bias: Array | None = None,
                   group: ProcessGroup | None = None, *,
                   gather_output: bool = True) -> ColumnParallelLinear:
        """The column-parallel layer holding this rank's rows of the dense ``weight`` (out, in)
        and ``bias`` (out,) (copies, in their dtype and array library)."""
        weight, bias = check_dense(cls.__name__, weight, bias)
        layer = cls.__new__(cls)
        layer._setup(weight.shape[1], weight.shape[0], group)
        layer.gather_output = bool(gather_output)
        layer._keep_shards(weight, bias, weight.dtype)
        return layer

    def _keep_shards(self, w: Array, b: Array | None, dtype: Any) -> None:
        xp = _array.namespace(w)
        self.weight = Parameter(xp.array(w[self.shard], dtype=dtype), "weight")
        self.bias = None if b is None else Parameter(xp.array(b[self.shard], dtype=dtype), "bias")

    def forward(self, x: Array) -> Array:
        """Y (full, or this rank's block when ``gather_output=False``) for X of shape (..., in)."""
        x = identity(self._check_input(x, self.in_features, "in_features"), self.group)
        y = x @ self.weight.data.T
        if self.bias is not None:
            y = y + self.bias.data
        if self.gather_output:
            y = gather_last_axis(y, self.group, sizes=self.shard_sizes)
        self._saved, self._out_shape = x, tuple(y.shape)
        return y

    def backward(self, grad_y: Array, accumulate: bool = False) -> Array:
        """dX (full and identical on every rank) from dY of the forward output's shape.

        Writes ``weight.grad`` (this rank's rows) and ``bias.grad`` (its slice);
        with ``accumulate`` adds to existing gradients instead.
        """
        grad_y = self._check_grad(grad_y)
        if self.gather_output:
            grad_y = adjoint(gather_last_axis)(grad_y, self.group)
        x = self._saved
        store_grad(self.weight, weight_grad(grad_y, x), accumulate)
        if self.bias is not None:
            store_grad(self.bias, batch_sum(grad_y), accumulate)
        grad_x = _array.namespace(grad_y).ascontiguousarray(grad_y @ self.weight.data)
        return adjoint(identity)(grad_x, self.group)

    def full_weights(self) -> tuple[Array, Array | None]:
        """The dense ``(W, b)`` gathered on every rank (collective: every rank calls it)."""
        w = all_gather(self.weight.data, self.group, sizes=self.shard_sizes)
        b = None if self.bias is None else all_gather(self.bias.data, self.group,
                                                       sizes=self.shard_sizes)
        return w, b

    def full_grads(self) -> tuple[Array, Array | None]:
        """The dense ``(dW, db)`` gathered on every rank from the shards' ``.grad``."""
        w = all_gather(_grad_of(self.weight, self), self.group, sizes=self.shard_sizes)
        b = None if self.bias is None else all_gather(_grad_of(self.bias, self), self.group,
                                                       sizes=self.shard_sizes)
        return w, b


class RowParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A (out, in) split along its columns (input features) across the group.

    Rank r holds ``A_r = A[:, in slice r]`` and multiplies it with its block
    ``X_r`` of X's last axis; the partial products are summed over the group
    (all-reduce) and b is added once, after the sum. Every rank then holds
    the full Y, and backward expects the full dY, identical on every rank
    (the adjoint of the sum is the identity). With ``input_is_parallel`` the
    input already arrives split (a :class:`ColumnParallelLinear`'s output with
    ``gather_output=False``) and dX is returned split the same way; otherwise
    X is replicated, each rank takes its own block, and dX is gathered back
    to the full width.

    The bias is replicated: every rank holds the full b, and backward gives
    every rank the same, full ``bias.grad`` (do not sum it over the
    tensor-parallel group; averaging it over a data-parallel group is right).

    Args:
        in_features: width of the full X's last axis; need not divide the
            group size (shards follow :func:`numpy.array_split`).
        out_features: width of Y's last axis.
        bias, group, dtype, seed, init: as for :class:`ColumnParallelLinear`.
        input_is_parallel: the input is this rank's block of X's last axis.

    Attributes:
        weight: Parameter of shape ``(out_features, shard_sizes[r])``.
        bias: Parameter of shape ``(out_features,)`` (replicated), or None.
    """

    _split_name = "in"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: ProcessGroup | None = None, input_is_parallel: bool = False,
                 dtype: Any = np.float32, seed: int = 0, init: Init | None = None) -> None:
        self._setup(in_features, out_features, group)
        self.input_is_parallel = bool(input_is_parallel)
        w, b = full_dense(self.in_features, self.out_features, bias, seed, init)
        self._keep_shards(w, b, dtype)

    @classmethod
    def from_dense(cls, weight: Array, bias: Array | None = None,
                   group: ProcessGroup | None = None, *,
                   input_is_parallel: bool = False) -> RowParallelLinear:
        """The row-parallel layer holding this rank's columns of the dense ``weight``
        (out, in) and the full ``bias`` (out,) (copies)."""
        weight, bias = check_dense(cls.__name__, weight, bias)
        layer = cls.__new__(cls)
        layer._setup(weight.shape[1], weight.shape[0], group)
        layer.input_is_parallel = bool(input_is_parallel)
        layer._keep_shards(weight, bias, weight.dtype)
        return layer

    def _keep_shards(self, w: Array, b: Array | None, dtype: Any) -> None:
        xp = _array.namespace(w)
        self.weight = Parameter(xp.array(w[:, self.shard], dtype=dtype), "weight")
        self.bias = None if b is None else Parameter(xp.array(b, dtype=dtype), "bias")

    def forward(self, x: Array) -> Array:
        """The full Y on every rank, for X of shape (..., in) (or (..., shard_sizes[r]) when
        ``input_is_parallel``)."""
        if self.input_is_parallel:
            r = self.group.rank
            x = self._check_input(x, self.shard_sizes[r], f"shard_sizes[{r}]")
        else:
            x = split_last_axis(self._check_input(x, self.in_features, "in_features"), self.group)
        partial = _array.namespace(x).ascontiguousarray(x @ self.weight.data.T)
        y = reduce_sum(partial, self.group)
        if self.bias is not None:
            y = y + self.bias.data  # once, after the sum
        self._saved, self._out_shape = x, tuple(y.shape)
        return y

    def backward(self, grad_y: Array, accumulate: bool = False) -> Array:
        """dX (this rank's block when ``input_is_parallel``, else full) from the full dY.

        Writes ``weight.grad`` (this rank's columns) and ``bias.grad`` (the full
        bias gradient, the same on every rank).
        """
        grad_y = adjoint(reduce_sum)(self._check_grad(grad_y), self.group)
        x = self._saved
        store_grad(self.weight, weight_grad(grad_y, x), accumulate)
        if self.bias is not None:
            store_grad(self.bias, batch_sum(grad_y), accumulate)
        grad_x = grad_y @ self.weight.data
        if self.input_is_parallel:
            return grad_x
        return adjoint(split_last_axis)(grad_x, self.group, sizes=self.shard_sizes)

    def full_weights(self) -> tuple[Array, Array | None]:
        """The dense ``(W, b)`` gathered on every rank (collective: every rank calls it)."""
        w = gather_last_axis(self.weight.data, self.group, sizes=self.shard_sizes)
        return w, None if self.bias is None else self.bias.data.copy()

    def full_grads(self) -> tuple[Array, Array | None]:
        """The dense ``(dW, db)`` on every rank from the shards' ``.grad``."""
        w = gather_last_axis(_grad_of(self.weight, self), self.group, sizes=self.shard_sizes)
        return w, None if self.bias is None else _grad_of(self.bias, self).copy()


def _grad_of(p: Parameter, layer: _ParallelLinear) -> Array:
    if p.grad is None:
        raise RuntimeError(f"{layer._where()}.full_grads: {p.name} has no gradient; run "
                           "backward first")
    return p.grad


__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
