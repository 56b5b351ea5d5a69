"""Tensor parallelism: linear layers whose weights are split across a group.

The layers follow Megatron-LM's pair. ``ColumnParallelLinear`` splits the
weight's output features, ``RowParallelLinear`` its input features; a
column layer followed by an element-wise activation and a row layer (an
MLP block) communicates once forward (the row layer's all-reduce) and once
backward (the column layer's input-gradient all-reduce).

There is no autograd: each layer has ``forward(x)``, which saves what the
backward pass needs, and ``backward(grad_y)``, which returns the input
gradient and writes the parameters' ``.grad``. The communication in both is
built from the adjoint pairs below: a backward pass applies, in reverse
order, the adjoint of each collective its forward pass applied.

Dense convention: ``y = x @ W.T + b`` with ``W`` of shape ``(out, in)``.
Shards follow :func:`numpy.array_split` (:func:`axondist.comm.split_sizes`):
with ``n`` features over ``p`` ranks, the first ``n % p`` ranks hold one
feature more, so sizes need not divide the group size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from . import _array
from .comm import all_gather, all_reduce_sum, reduce_scatter_sum, split_sizes
from .parameter import Parameter
from .process_group import ProcessGroup, resolve_group

Array = Any
Init = Callable[[np.random.Generator, tuple[int, int]], np.ndarray]


def shard_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part ``index`` when ``length`` items split over ``parts``
    (the :func:`numpy.array_split` rule)."""
    sizes = split_sizes(length, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


# --- collectives as adjoint pairs ------------------------------------------------------
#
# Each function maps this rank's array to this rank's result. Where a forward
# value is *replicated* (the same on every rank of the group), its gradient is
# too; where it is *split*, each rank holds the gradient of its own part.

def identity(x: Array, group: ProcessGroup | None = None) -> Array:
    """Forward of a replicated value into per-rank computations: returns ``x``.

    Adjoint: :func:`reduce_sum` (each rank's computation contributes a part
    of the gradient of the shared input).
    """
    return x


def reduce_sum(x: Array, group: ProcessGroup | None = None) -> Array:
    """Sum of every rank's ``x``, written into ``x`` (which must be writable) and returned.

    Adjoint: :func:`identity` (the sum's gradient is replicated, and passes
    unchanged to every rank's part).
    """
    return all_reduce_sum(x, group)


def split_last_axis(x: Array, group: ProcessGroup | None = None) -> Array:
    """This rank's block of the last axis of a replicated ``x`` (array_split rule; no
    communication). Returns a view.

    Adjoint: :func:`gather_last_axis`.
    """
    g = resolve_group(group)
    start, stop = shard_bounds(x.shape[-1], g.world_size, g.rank)
    return x[..., start:stop]


def gather_last_axis(x: Array, group: ProcessGroup | None = None,
                     sizes: Sequence[int] | None = None) -> Array:
    """Every rank's ``x`` concatenated along the last axis, in rank order, on every rank.

    Widths may differ between ranks (all other dimensions may not). Because
    the gather concatenates along axis 0, the last axis is moved to the
    front, gathered and moved back; passing ``sizes`` (every rank's width)
    saves the exchange of widths.

    Adjoint: :func:`split_last_axis` (when the widths follow the
    array_split rule, as the layers' shards do).
    """
    xp = _array.namespace(x)
    front = xp.ascontiguousarray(xp.moveaxis(x, -1, 0))
    gathered = all_gather(front, group, sizes=sizes)
    return xp.ascontiguousarray(xp.moveaxis(gathered, 0, -1))


def gather_first_axis(x: Array, group: ProcessGroup | None = None) -> Array:
    """Every rank's ``x`` concatenated along axis 0 (e.g. the sequence), on every rank.

    Adjoint: :func:`reduce_scatter_first_axis` (when the row counts follow the
    array_split rule): each rank's copy of the result feeds its own
    computation, so the gradients are summed and each rank keeps its rows.
    """
    return all_gather(x, group)


def reduce_scatter_first_axis(x: Array, group: ProcessGroup | None = None) -> Array:
    """Sum over the group, then this rank's block of rows (array_split rule).

    Adjoint: :func:`gather_first_axis`.
    """
    return reduce_scatter_sum(x, group)


#: forward collective -> the collective its backward pass applies.
ADJOINT: dict[Callable[..., Array], Callable[..., Array]] = {
    identity: reduce_sum,
    reduce_sum: identity,
    split_last_axis: gather_last_axis,
    gather_last_axis: split_last_axis,
    gather_first_axis: reduce_scatter_first_axis,
    reduce_scatter_first_axis: gather_first_axis,
}


def adjoint(fn: Callable[..., Array]) -> Callable[..., Array]:
    """The collective that back-propagates through ``fn`` (one of the six above)."""
    try:
        return ADJOINT[fn]
    except KeyError:
        names = ", ".join(f.__name__ for f in ADJOINT)
        raise ValueError(f"adjoint: {getattr(fn, '__name__', fn)!r} is not one of the paired "
                         f"collectives ({names})") from None


# --- shared layer machinery ------------------------------------------------------------

def default_init(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Uniform in ``[-1/sqrt(in), 1/sqrt(in)]`` for a weight of shape ``(out, in)``
    (the bound of PyTorch's ``nn.Linear``)."""
    bound = 1.0 / np.sqrt(max(shape[1], 1))
    return rng.uniform(-bound, bound, size=shape)


def _full_dense(in_features: int, out_features: int, bias: bool, seed: int,
                init: Init | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The dense ``W`` (out, in) and ``b`` a seeded layer stands for: the same on any group.

    The bias is always drawn uniform in ``[-1/sqrt(in), 1/sqrt(in)]`` after the weight.
    """
    rng = np.random.default_rng(seed)
    w = np.asarray((init or default_init)(rng, (out_features, in_features)))
    if w.shape != (out_features, in_features):
        raise ValueError(f"init returned shape {w.shape}, expected (out_features, in_features) "
                         f"= {(out_features, in_features)}")
    b = None
    if bias:
        bound = 1.0 / np.sqrt(max(in_features, 1))
        b = rng.uniform(-bound, bound, size=out_features)
    return w, b


def _store_grad(p: Parameter, g: Array, accumulate: bool) -> None:
    """Write ``g`` as ``p``'s gradient (in ``p``'s dtype).

    An existing gradient array of the right shape and dtype is written in
    place (so views of it, such as DDP's bucket views, stay valid); with
    ``accumulate`` it is added to.
    """
    g = g.astype(p.dtype, copy=False)
    old = p.grad
    fits = (old is not None and tuple(old.shape) == p.shape and old.dtype == p.dtype
            and getattr(old.flags, "writeable", True))
    if accumulate and fits:
        old += g
    elif accumulate and old is not None:
        p.grad = old + g
    elif fits:
        old[...] = g
    else:
        p.grad = _array.namespace(g).ascontiguousarray(g)


def _rows(a: Array) -> Array:
    """``a`` as a matrix (batch, features); explicit sizes, since either may be 0."""
    return a.reshape(prod(a.shape[:-1]), a.shape[-1])


def _weight_grad(grad_y: Array, x: Array) -> Array:
    """``sum over batch of grad_y^T x`` for inputs with any leading batch dimensions."""
    return _rows(grad_y).T @ _rows(x)


def _batch_sum(grad_y: Array) -> Array:
    return _rows(grad_y).sum(axis=0)


class _ParallelLinear:
    """What the column and row layers share: group, shard bookkeeping, checks."""

    _split_name = ""  # "out" or "in": which feature axis is split
    weight: Parameter
    bias: Parameter | None

    def _setup(self, in_features: int, out_features: int, group: ProcessGroup | None) -> None:
        name = type(self).__name__
        if in_features < 1 or out_features < 1:
            raise ValueError(f"{name}: in_features={in_features} and out_features={out_features} "
                             "must be positive")
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
        w, b = _full_dense(self.in_features, self.out_features, bias, seed, init)
        self._keep_shards(w, b, dtype)

    @classmethod
    def from_dense(cls, weight: Array, bias: Array | None = None,
                   group: ProcessGroup | None = None, *,
                   gather_output: bool = True) -> ColumnParallelLinear:
        """The column-parallel layer holding this rank's rows of the dense ``weight`` (out, in)
        and ``bias`` (out,) (copies, in their dtype and array library)."""
        weight, bias = _check_dense(cls.__name__, weight, bias)
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
        _store_grad(self.weight, _weight_grad(grad_y, x), accumulate)
        if self.bias is not None:
            _store_grad(self.bias, _batch_sum(grad_y), accumulate)
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
        w, b = _full_dense(self.in_features, self.out_features, bias, seed, init)
        self._keep_shards(w, b, dtype)

    @classmethod
    def from_dense(cls, weight: Array, bias: Array | None = None,
                   group: ProcessGroup | None = None, *,
                   input_is_parallel: bool = False) -> RowParallelLinear:
        """The row-parallel layer holding this rank's columns of the dense ``weight``
        (out, in) and the full ``bias`` (out,) (copies)."""
        weight, bias = _check_dense(cls.__name__, weight, bias)
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
        _store_grad(self.weight, _weight_grad(grad_y, x), accumulate)
        if self.bias is not None:
            _store_grad(self.bias, _batch_sum(grad_y), accumulate)
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


def _check_dense(where: str, weight: Array, bias: Array | None) -> tuple[Array, Array | None]:
    weight = _array.as_array(weight)
    if weight.ndim != 2:
        raise ValueError(f"{where}.from_dense: weight of shape {tuple(weight.shape)} must be 2-D "
                         "(out_features, in_features)")
    if bias is not None:
        bias = _array.as_array(bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{where}.from_dense: bias of shape {tuple(bias.shape)} does not "
                             f"match weight {tuple(weight.shape)}; expected ({weight.shape[0]},)")
    return weight, bias


def _grad_of(p: Parameter, layer: _ParallelLinear) -> Array:
    if p.grad is None:
        raise RuntimeError(f"{layer._where()}.full_grads: {p.name} has no gradient; run "
                           "backward first")
    return p.grad


# --- the MLP block -------------------------------------------------------------------

@dataclass(frozen=True)
class Activation:
    """An element-wise function and its derivative."""

    name: str
    fn: Callable[[Array], Array]
    """f(h)."""
    grad: Callable[[Array], Array]
    """f'(h), element-wise."""


_GELU_C = float(np.sqrt(2.0 / np.pi))


def _gelu(h: Array) -> Array:
    xp = _array.namespace(h)
    return 0.5 * h * (1.0 + xp.tanh(_GELU_C * (h + 0.044715 * h**3)))


def _gelu_grad(h: Array) -> Array:
    xp = _array.namespace(h)
    t = xp.tanh(_GELU_C * (h + 0.044715 * h**3))
    return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * h * h)


#: the activations :class:`TensorParallelMLP` accepts; "gelu" is the tanh approximation.
ACTIVATIONS: dict[str, Activation] = {
    "gelu": Activation("gelu", _gelu, _gelu_grad),
    "relu": Activation("relu", lambda h: h * (h > 0), lambda h: (h > 0).astype(h.dtype)),
}


class TensorParallelMLP:
    """Y = act(X A^T + a) B^T + b: a column-parallel then a row-parallel linear layer.

    A (hidden, in) is split along its rows and B (out, hidden) along its
    columns, so rank r computes its block of the hidden activations with no
    communication and the block's contribution to Y; one all-reduce forward
    (in ``fc2``) and one backward (in ``fc1``) make the whole exchange. X, Y
    and their gradients are full and replicated over the group.

    Args:
        in_features, hidden_features, out_features: the dense sizes; the
            hidden size need not divide the group size.
        group: the tensor-parallel group (the current world when None).
        activation: ``"gelu"`` (tanh approximation) or ``"relu"``.
        bias, dtype: as for the layers.
        seed: the two layers' seeds derive from it (same dense MLP on any group).

    Attributes:
        fc1: the :class:`ColumnParallelLinear` (``gather_output=False``).
        fc2: the :class:`RowParallelLinear` (``input_is_parallel=True``).
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int,
                 group: ProcessGroup | None = None, activation: str = "gelu",
                 bias: bool = True, dtype: Any = np.float32, seed: int = 0) -> None:
        self.activation = _activation(activation)
        s1, s2 = (int(s) for s in np.random.SeedSequence(seed).generate_state(2))
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, bias, group,
                                        gather_output=False, dtype=dtype, seed=s1)
        self.fc2 = RowParallelLinear(hidden_features, out_features, bias, self.fc1.group,
                                     input_is_parallel=True, dtype=dtype, seed=s2)
        self._name_parameters()

    @classmethod
    def from_dense(cls, w1: Array, b1: Array | None, w2: Array, b2: Array | None,
                   group: ProcessGroup | None = None,
                   activation: str = "gelu") -> TensorParallelMLP:
        """The MLP holding this rank's shards of the dense ``w1`` (hidden, in), ``b1``,
        ``w2`` (out, hidden) and ``b2``."""
        mlp = cls.__new__(cls)
        mlp.activation = _activation(activation)
        mlp.fc1 = ColumnParallelLinear.from_dense(w1, b1, group, gather_output=False)
        mlp.fc2 = RowParallelLinear.from_dense(w2, b2, mlp.fc1.group, input_is_parallel=True)
        if mlp.fc2.in_features != mlp.fc1.out_features:
            raise ValueError(f"TensorParallelMLP.from_dense: w1 has {mlp.fc1.out_features} rows "
                             f"(hidden features) but w2 has {mlp.fc2.in_features} columns")
        mlp._name_parameters()
        return mlp

    def _name_parameters(self) -> None:
        for prefix, layer in (("fc1", self.fc1), ("fc2", self.fc2)):
            for p in layer.parameters():
                p.name = f"{prefix}.{(p.name or '').split('.')[-1]}"
        self._h: Array | None = None

    @property
    def group(self) -> ProcessGroup:
        """The tensor-parallel group both layers are split over."""
        return self.fc1.group

    def parameters(self) -> list[Parameter]:
        """fc1's weight and bias shards, then fc2's (its bias replicated)."""
        return self.fc1.parameters() + self.fc2.parameters()

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (``grad = None``), as before the first backward."""
        for p in self.parameters():
            p.zero_grad()

    def forward(self, x: Array) -> Array:
        """The full Y on every rank for the replicated X of shape (..., in)."""
        h = self.fc1.forward(x)
        self._h = h
        return self.fc2.forward(self.activation.fn(h))

    def backward(self, grad_y: Array, accumulate: bool = False) -> Array:
        """The full dX on every rank; writes every parameter's ``.grad``."""
        if self._h is None:
            raise RuntimeError("TensorParallelMLP.backward: called before forward")
        grad_a = self.fc2.backward(grad_y, accumulate)
        return self.fc1.backward(grad_a * self.activation.grad(self._h), accumulate)

    def full_weights(self) -> dict[str, tuple[Array, Array | None]]:
        """``{"fc1": (W1, b1), "fc2": (W2, b2)}``, dense, on every rank (collective)."""
        return {"fc1": self.fc1.full_weights(), "fc2": self.fc2.full_weights()}

    def full_grads(self) -> dict[str, tuple[Array, Array | None]]:
        """``{"fc1": (dW1, db1), "fc2": (dW2, db2)}``, dense, on every rank (collective)."""
        return {"fc1": self.fc1.full_grads(), "fc2": self.fc2.full_grads()}

    def __repr__(self) -> str:
        return (f"TensorParallelMLP({self.fc1.in_features} -> {self.fc1.out_features} -> "
                f"{self.fc2.out_features}, {self.activation.name}, "
                f"rank {self.group.rank} of {self.group.world_size})")


def _activation(name: str) -> Activation:
    if name not in ACTIVATIONS:
        raise ValueError(f"TensorParallelMLP: activation={name!r} is not supported; choose one "
                         f"of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


__all__ = [
    "ACTIVATIONS",
    "ADJOINT",
    "Activation",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelMLP",
    "adjoint",
    "default_init",
    "gather_first_axis",
    "gather_last_axis",
    "identity",
    "reduce_scatter_first_axis",
    "reduce_sum",
    "shard_bounds",
    "split_last_axis",
]
