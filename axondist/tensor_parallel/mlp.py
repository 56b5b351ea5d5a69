"""The tensor-parallel MLP block: a column-parallel layer, an activation, a row-parallel layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _array
from .._validate import positive_int
from ..parameter import Parameter
from ..process_group import ProcessGroup
from .linear import ColumnParallelLinear, RowParallelLinear

Array = Any


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


__all__ = ["ACTIVATIONS", "Activation", "TensorParallelMLP"]
