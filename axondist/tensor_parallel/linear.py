"""Tensor parallelism: linear layers, an MLP and an attention block split across a group.

The layers follow Megatron-LM's pair. ``ColumnParallelLinear`` splits the
weight's output features, ``RowParallelLinear`` its input features; a
column layer followed by an element-wise activation and a row layer (an
MLP block) communicates once forward (the row layer's all-reduce) and once
backward (the column layer's input-gradient all-reduce).
``TensorParallelAttention`` splits the same way by heads: the Q/K/V
projection by columns, the output projection by rows.

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

from .. import _array, clip
from .._validate import positive_int
from ..comm import all_gather, all_reduce_sum, reduce_scatter_sum, split_sizes
from ..parameter import Parameter
from ..process_group import ProcessGroup, resolve_group

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
    old: Any = p.grad  # a torch .grad is written through its view; a JAX one is replaced
    old = old if old is None or type(old) is np.ndarray else _array.as_array(old)
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
        for arg, value in (("in_features", in_features), ("hidden_features", hidden_features),
                           ("out_features", out_features)):
            positive_int(value, "TensorParallelMLP", arg)  # 2.5 refused, never truncated
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

    def replicated_parameters(self) -> list[Parameter]:
        """fc2's bias: every rank holds it whole."""
        return self.fc1.replicated_parameters() + self.fc2.replicated_parameters()

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



# --- the attention block --------------------------------------------------------------

def scaled_dot_product_attention(q: Array, k: Array, v: Array,
                                 causal: bool = True) -> tuple[Array, Array]:
    """O = P V with P = softmax(Q K^T / sqrt(d) + M) over the last axis, for every head.

    ``q``, ``k`` and ``v`` have shape ``(..., T, d)`` (leading axes are batch
    and heads); M is 0 on and below the diagonal and -inf above it when
    ``causal`` (position t sees positions <= t), else 0.

    Returns:
        ``(O, P)``: the output ``(..., T, d)`` and the attention weights
        ``(..., T, T)`` that :func:`scaled_dot_product_attention_backward` needs.
    """
    xp = _array.namespace(q)
    scores = (q @ xp.swapaxes(k, -1, -2)) * _scale(q)
    if causal:
        t = q.shape[-2]
        scores = xp.where(xp.tril(xp.ones((t, t), dtype=bool)), scores, -xp.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = xp.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v, weights


def scaled_dot_product_attention_backward(q: Array, k: Array, v: Array, weights: Array,
                                          grad_o: Array) -> tuple[Array, Array, Array]:
    """dQ, dK, dV of :func:`scaled_dot_product_attention` from dO and the saved weights P.

    dV = P^T dO; dS = P * (dP - rowsum(dP * P)) with dP = dO V^T (the softmax
    Jacobian; masked positions have P = 0 and so get no gradient);
    dQ = dS K / sqrt(d) and dK = dS^T Q / sqrt(d).
    """
    xp = _array.namespace(q)
    scale = _scale(q)
    grad_v = xp.swapaxes(weights, -1, -2) @ grad_o
    grad_p = grad_o @ xp.swapaxes(v, -1, -2)
    grad_s = weights * (grad_p - (grad_p * weights).sum(axis=-1, keepdims=True))
    return (grad_s @ k) * scale, (xp.swapaxes(grad_s, -1, -2) @ q) * scale, grad_v


def _scale(q: Array) -> float:
    """1 / sqrt(d) for queries of width d (1 for the empty heads of a rank holding none)."""
    return 1.0 / float(np.sqrt(q.shape[-1])) if q.shape[-1] else 1.0


def _split_heads(a: Array, heads: int) -> Array:
    """(..., T, heads * d) -> (..., heads, T, d)."""
    xp = _array.namespace(a)
    shaped = a.reshape(*a.shape[:-1], heads, a.shape[-1] // heads if heads else 0)
    return xp.moveaxis(shaped, -2, -3)


def _merge_heads(a: Array) -> Array:
    """(..., heads, T, d) -> (..., T, heads * d)."""
    xp = _array.namespace(a)
    moved = xp.moveaxis(a, -3, -2)
    return xp.ascontiguousarray(moved).reshape(*moved.shape[:-2], moved.shape[-2] * a.shape[-1])


class TensorParallelAttention:
    """Y = concat_h(softmax(Q_h K_h^T / sqrt(d_h) + M) V_h) W_o^T + b_o, heads split over ranks.

    Q = X W_q^T + b_q, K and V alike, with W_q, W_k, W_v of shape (d, d)
    stacked as W_qkv = [W_q; W_k; W_v] (3d, d); head h uses features
    ``h*d_h:(h+1)*d_h`` of Q, K and V (``d_h = d / num_heads``), and M is the
    causal mask (see :func:`scaled_dot_product_attention`). Rank r holds the
    heads H_r (the array_split rule over ``num_heads``, so any head count
    works on any group): the rows of W_qkv and b_qkv for its heads (a column
    split, so each rank computes its heads' attention with no communication)
    and the matching columns of W_o (a row split), whose partial products are
    summed over the group (one all-reduce forward); b_o is added once after
    the sum. X, Y and their gradients are full and replicated; backward's one
    all-reduce sums each rank's contribution to dX (the adjoint of forward's
    identity). A rank left with no heads (``num_heads`` < group size) holds
    empty shards and still takes part in both all-reduces.

    Args:
        embed_dim: d, the width of X and Y; a multiple of ``num_heads``.
        num_heads: number of heads.
        group: the tensor-parallel group (the current world when None).
        causal: mask future positions.
        bias: learn b_qkv and b_o.
        dtype: the parameters' dtype.
        seed: every rank draws the dense W_qkv (then W_o) from it, as the
            linear layers do, so the layer is the same dense attention on any group.

    Attributes:
        heads: this rank's heads, a ``range``.
        qkv_weight: Parameter ``(3 * len(heads) * d_h, d)``, rows [Q; K; V] of its heads.
        qkv_bias: Parameter ``(3 * len(heads) * d_h,)``, or None.
        out_weight: Parameter ``(d, len(heads) * d_h)``, W_o's columns for its heads.
        out_bias: Parameter ``(d,)`` (replicated: its gradient is the same on every rank),
            or None.

    Raises:
        ValueError: ``embed_dim`` or ``num_heads`` not positive, or
            ``embed_dim`` not a multiple of ``num_heads``.
    """

    def __init__(self, embed_dim: int, num_heads: int, group: ProcessGroup | None = None,
                 causal: bool = True, bias: bool = True, dtype: Any = np.float32,
                 seed: int = 0) -> None:
        self._setup(embed_dim, num_heads, group, causal, "TensorParallelAttention")
        s1, s2 = (int(s) for s in np.random.SeedSequence(seed).generate_state(2))
        w_qkv, b_qkv = _full_dense(self.embed_dim, 3 * self.embed_dim, bias, s1, None)
        w_out, b_out = _full_dense(self.embed_dim, self.embed_dim, bias, s2, None)
        self._keep_shards(w_qkv, b_qkv, w_out, b_out, dtype)

    @classmethod
    def from_dense(cls, qkv_weight: Array, qkv_bias: Array | None, out_weight: Array,
                   out_bias: Array | None, num_heads: int, group: ProcessGroup | None = None,
                   causal: bool = True) -> TensorParallelAttention:
        """The layer holding this rank's heads of the dense ``qkv_weight`` (3d, d),
        ``qkv_bias`` (3d,), ``out_weight`` (d, d) and ``out_bias`` (d,) (copies).

        Raises:
            ValueError: shapes that do not fit together, or as for the constructor.
        """
        where = "TensorParallelAttention.from_dense"
        out_weight, out_bias = _check_dense(where, out_weight, out_bias)
        d = out_weight.shape[0]
        qkv_weight, qkv_bias = _check_dense(where, qkv_weight, qkv_bias)
        if tuple(qkv_weight.shape) != (3 * d, d) or tuple(out_weight.shape) != (d, d):
            raise ValueError(f"{where}: qkv_weight {tuple(qkv_weight.shape)} and out_weight "
                             f"{tuple(out_weight.shape)} must be (3d, d) and (d, d); out_weight "
                             f"says d={d}, so qkv_weight should be {(3 * d, d)}")
        if (qkv_bias is None) != (out_bias is None):
            raise ValueError(f"{where}: pass both biases or neither")
        layer = cls.__new__(cls)
        layer._setup(d, num_heads, group, causal, where)
        layer._keep_shards(qkv_weight, qkv_bias, out_weight, out_bias, qkv_weight.dtype)
        return layer

    def _setup(self, embed_dim: int, num_heads: int, group: ProcessGroup | None, causal: bool,
               where: str) -> None:
        if embed_dim < 1 or num_heads < 1 or embed_dim % num_heads:
            raise ValueError(f"{where}: embed_dim={embed_dim} must be a positive multiple of "
                             f"num_heads={num_heads}; pick a head count that divides it")
        self.group = resolve_group(group)
        self.group.backend_for("TensorParallelAttention")  # a clear error on non-members
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.head_dim = self.embed_dim // self.num_heads
        self.causal = bool(causal)
        p, r = self.group.world_size, self.group.rank
        #: every rank's number of heads, in rank order
        self.heads_per_rank: list[int] = split_sizes(self.num_heads, p)
        self.heads = range(*shard_bounds(self.num_heads, p, r))
        #: every rank's width of its heads' features (``heads * head_dim``)
        self.shard_sizes = [h * self.head_dim for h in self.heads_per_rank]
        self._saved: tuple[Array, ...] | None = None

    def _feature_slice(self) -> slice:
        return slice(self.heads.start * self.head_dim, self.heads.stop * self.head_dim)

    def _keep_shards(self, w_qkv: Array, b_qkv: Array | None, w_out: Array, b_out: Array | None,
                     dtype: Any) -> None:
        xp = _array.namespace(w_qkv)
        f, d = self._feature_slice(), self.embed_dim
        rows = xp.concatenate([w_qkv[part * d:(part + 1) * d][f] for part in range(3)])
        self.qkv_weight = Parameter(xp.array(rows, dtype=dtype), "qkv.weight")
        self.out_weight = Parameter(xp.array(w_out[:, f], dtype=dtype), "out.weight")
        self.qkv_bias = self.out_bias = None
        if b_qkv is not None and b_out is not None:
            bias = xp.concatenate([b_qkv[part * d:(part + 1) * d][f] for part in range(3)])
            self.qkv_bias = Parameter(xp.array(bias, dtype=dtype), "qkv.bias")
            self.out_bias = Parameter(xp.array(b_out, dtype=dtype), "out.bias")

    def parameters(self) -> list[Parameter]:
        """qkv weight and bias shards, then the out weight shard and the replicated out bias."""
        return [p for p in (self.qkv_weight, self.qkv_bias, self.out_weight, self.out_bias)
                if p is not None]

    def replicated_parameters(self) -> list[Parameter]:
        """The output bias: every rank holds it whole."""
        return [self.out_bias] if self.out_bias is not None else []

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (``grad = None``)."""
        for p in self.parameters():
            p.zero_grad()

    def _where(self) -> str:
        g = self.group
        return (f"TensorParallelAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}"
                f", rank {g.rank} of {g.world_size}, heads {self.heads.start}:{self.heads.stop})")

    __repr__ = _where

    def forward(self, x: Array) -> Array:
        """The full Y (..., T, d) on every rank for the replicated X of shape (..., T, d)."""
        x = _array.as_array(x)
        if x.ndim < 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"{self._where()}.forward: input of shape {tuple(x.shape)}, "
                             f"expected (..., T, embed_dim={self.embed_dim}): a sequence axis "
                             "and then the features")
        xp = _array.namespace(x)
        x = identity(x, self.group)
        qkv = x @ self.qkv_weight.data.T
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias.data
        n = len(self.heads)
        q, k, v = (_split_heads(part, n) for part in xp.split(qkv, 3, axis=-1))
        o, weights = scaled_dot_product_attention(q, k, v, self.causal)
        merged = _merge_heads(o)
        y = reduce_sum(xp.ascontiguousarray(merged @ self.out_weight.data.T), self.group)
        if self.out_bias is not None:
            y = y + self.out_bias.data  # once, after the sum
        self._saved = (x, q, k, v, weights, merged, tuple(y.shape))
        return y

    def backward(self, grad_y: Array, accumulate: bool = False) -> Array:
        """The full dX on every rank from the full, replicated dY; writes every ``.grad``
        (with ``accumulate``, adds to existing gradients)."""
        if self._saved is None:
            raise RuntimeError(f"{self._where()}.backward: called before forward; run "
                               "forward(x) first (it saves what backward needs)")
        x, q, k, v, weights, merged, shape = self._saved
        grad_y = _array.as_array(grad_y)
        if tuple(grad_y.shape) != shape:
            raise ValueError(f"{self._where()}.backward: grad_y of shape "
                             f"{tuple(grad_y.shape)}, expected the forward output's shape {shape}")
        xp = _array.namespace(grad_y)
        grad_y = adjoint(reduce_sum)(grad_y, self.group)
        _store_grad(self.out_weight, _weight_grad(grad_y, merged), accumulate)
        if self.out_bias is not None:
            _store_grad(self.out_bias, _batch_sum(grad_y), accumulate)
        grad_o = _split_heads(grad_y @ self.out_weight.data, len(self.heads))
        grads = scaled_dot_product_attention_backward(q, k, v, weights, grad_o)
        grad_qkv = xp.concatenate([_merge_heads(g) for g in grads], axis=-1)
        _store_grad(self.qkv_weight, _weight_grad(grad_qkv, x), accumulate)
        if self.qkv_bias is not None:
            _store_grad(self.qkv_bias, _batch_sum(grad_qkv), accumulate)
        grad_x = xp.ascontiguousarray(grad_qkv @ self.qkv_weight.data)
        return adjoint(identity)(grad_x, self.group)

    def _gather_qkv(self, a: Array) -> Array:
        """This rank's [Q; K; V] rows (or bias entries) -> the dense (3d, ...) on every rank."""
        xp = _array.namespace(a)
        parts = xp.split(a, 3, axis=0)
        full = [all_gather(xp.ascontiguousarray(part), self.group, sizes=self.shard_sizes)
                for part in parts]
        return xp.concatenate(full, axis=0)

    def _dense(self, grads: bool) -> dict[str, tuple[Array, Array | None]]:
        def pick(p: Parameter) -> Array:
            if not grads:
                return p.data
            if p.grad is None:
                raise RuntimeError(f"{self._where()}.full_grads: {p.name} has no gradient; "
                                   "run backward first")
            return p.grad

        w_out = gather_last_axis(pick(self.out_weight), self.group, sizes=self.shard_sizes)
        qkv_b = None if self.qkv_bias is None else self._gather_qkv(pick(self.qkv_bias))
        out_b = None if self.out_bias is None else pick(self.out_bias).copy()
        return {"qkv": (self._gather_qkv(pick(self.qkv_weight)), qkv_b), "out": (w_out, out_b)}

    def full_weights(self) -> dict[str, tuple[Array, Array | None]]:
        """``{"qkv": (W_qkv, b_qkv), "out": (W_o, b_o)}``, dense, on every rank (collective)."""
        return self._dense(grads=False)

    def full_grads(self) -> dict[str, tuple[Array, Array | None]]:
        """``{"qkv": (dW_qkv, db_qkv), "out": (dW_o, db_o)}``, dense, on every rank (collective).

        Raises:
            RuntimeError: a parameter has no gradient yet.
        """
        return self._dense(grads=True)


def clip_grad_norm(layers: Sequence[Any], max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> float:
    """Clip the gradients of tensor-parallel ``layers`` by their global norm; return the norm.

    The norm is the full model's: every shard counts once (each rank holds a
    different one) and a replicated gradient (RowParallelLinear's bias) once,
    not once per rank. NaN and inf propagate as in
    ``torch.nn.utils.clip_grad_norm_``; every rank gets the same norm. The layers
    must share one group. Combine with data parallelism by clipping after the
    data-parallel average.

    Raises:
        NonFiniteNormError: the norm is NaN or inf and ``error_if_nonfinite`` (on
            every rank; nothing is scaled).
        ValueError: no layers, layers on different groups, or a bad ``max_norm``
            or ``norm_type``.
    """
    layers = list(layers)
    if not layers:
        raise ValueError("tensor_parallel.clip_grad_norm: pass at least one layer")
    group = layers[0].group
    if any(layer.group is not group for layer in layers):
        raise ValueError("tensor_parallel.clip_grad_norm: the layers are split over different "
                         "groups; clip each group's layers in their own call")
    counted, every = [], []
    for layer in layers:
        replicated = {id(p) for p in layer.replicated_parameters()}
        for param in layer.parameters():
            if param.grad is None:
                continue
            every.append(param.grad)
            if id(param) not in replicated or group.rank == 0:
                counted.append(param.grad)
    return clip.clip_grad_norm(every, max_norm, norm_type, error_if_nonfinite, group=group,
                               counted=counted, where="tensor_parallel.clip_grad_norm")


__all__ = [
    "clip_grad_norm",
    "ACTIVATIONS",
    "ADJOINT",
    "Activation",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelAttention",
    "TensorParallelMLP",
    "adjoint",
    "default_init",
    "gather_first_axis",
    "gather_last_axis",
    "identity",
    "reduce_scatter_first_axis",
    "reduce_sum",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "shard_bounds",
    "split_last_axis",
]
