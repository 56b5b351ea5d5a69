"""The experts one rank holds: two-layer feed-forward networks, applied to the rows
dispatched to each.

Expert e computes ``FFN_e(x) = act(x W1_e^T + b1_e) W2_e^T + b2_e`` with ``W1_e``
``(d_hidden, d_model)`` and ``W2_e`` ``(d_model, d_hidden)``. Its weights are drawn from
a seed of its own (:func:`expert_weights`), so a rank draws only the experts it holds and
every group size gives the same dense layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _array
from ..parameter import Parameter
from ..tensor_parallel import Activation, default_init

Array = Any

#: The order of an expert's four parameters, and their names' suffixes.
EXPERT_TENSORS = ("w1", "b1", "w2", "b2")


def _rng(seed: int, stream: int) -> np.random.Generator:
    """Stream 0 is the router's, stream ``1 + e`` expert e's: independent of each other."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream,)))


def router_weight(seed: int, num_experts: int, d_model: int) -> np.ndarray:
    """The router's dense ``(E, d_model)`` float64 weight for ``seed`` (any group size)."""
    return default_init(_rng(seed, 0), (num_experts, d_model))


def expert_weights(seed: int, expert: int, d_model: int, d_hidden: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Expert ``expert``'s float64 ``(W1, b1, W2, b2)`` for ``seed``: each weight uniform in
    ``±1/sqrt(fan_in)`` (as :func:`~axondist.tensor_parallel.default_init`), each bias too."""
    rng = _rng(seed, 1 + expert)
    w1 = default_init(rng, (d_hidden, d_model))
    b1 = rng.uniform(-1, 1, d_hidden) / np.sqrt(d_model)
    w2 = default_init(rng, (d_model, d_hidden))
    b2 = rng.uniform(-1, 1, d_model) / np.sqrt(d_hidden)
    return w1, b1, w2, b2


def store_grad(p: Parameter, g: Array, accumulate: bool) -> None:
    """Write ``g`` as ``p``'s gradient in ``p``'s dtype: into the existing array when it
    fits (views of it, such as a bucket's, stay valid), added to it with ``accumulate``."""
    g = g.astype(p.dtype, copy=False)
    old = p.grad
    fits = (old is not None and tuple(old.shape) == p.shape and old.dtype == p.dtype
            and getattr(getattr(old, "flags", None), "writeable", False))
    if accumulate and old is not None:
        if fits:
            old += g
        else:
            p.grad = old + g
    elif fits:
        old[...] = g
    else:
        p.grad = _array.namespace(g).ascontiguousarray(g)


class LocalExperts:
    """This rank's experts, ``first .. first + count - 1``, as Parameters named
    ``experts.{e}.w1`` / ``b1`` / ``w2`` / ``b2`` (by global expert index, so a checkpoint
    reshards by name).

    Args:
        d_model, d_hidden: the widths.
        first, count: the global index of this rank's first expert, and how many it holds.
        activation: the hidden layer's element-wise function and its derivative.
        seed: the layer's seed (:func:`expert_weights`).
        dtype: the parameters' dtype.
    """

    def __init__(self, d_model: int, d_hidden: int, first: int, count: int,
                 activation: Activation, seed: int, dtype: Any) -> None:
        self.d_model, self.d_hidden = d_model, d_hidden
        self.first, self.count = first, count
        self.activation = activation
        self.params: list[list[Parameter]] = []
        for e in range(first, first + count):
            arrays = expert_weights(seed, e, d_model, d_hidden)
            self.params.append([Parameter(np.asarray(a, dtype=dtype), f"experts.{e}.{name}")
                                for name, a in zip(EXPERT_TENSORS, arrays)])
        self._saved: list[tuple[Array, Array, Array]] | None = None
        self._rows: Sequence[Array] = ()

    def parameters(self) -> list[Parameter]:
        """Every local expert's ``w1, b1, w2, b2``, expert by expert."""
        return [p for group in self.params for p in group]

    def forward(self, rows: Array, expert_rows: Sequence[Array]) -> Array:
        """Each expert applied to its rows of ``rows`` ``(R, d_model)``: the outputs, in
        the same row order."""
        xp = _array.namespace(rows)
        out = xp.zeros((rows.shape[0], self.d_model), dtype=rows.dtype)
        saved = []
        for (w1, b1, w2, b2), index in zip(self.params, expert_rows):
            x = rows[index]
            h = x @ w1.data.T + b1.data
            a = self.activation.fn(h)
            out[index] = a @ w2.data.T + b2.data
            saved.append((x, h, a))
        self._saved, self._rows = saved, expert_rows
        return out

    def backward(self, grad_out: Array) -> tuple[Array, list[Array]]:
        """The gradient for the forward's ``rows`` and each parameter's fresh gradient (in
        :meth:`parameters` order; not stored: the layer reduces them first)."""
        if self._saved is None:
            raise RuntimeError("LocalExperts.backward: called before forward")
        xp = _array.namespace(grad_out)
        grad_rows = xp.zeros_like(grad_out)
        grads: list[Array] = []
        for (w1, _, w2, _), (x, h, a), index in zip(self.params, self._saved, self._rows):
            g = grad_out[index]
            grad_h = (g @ w2.data) * self.activation.grad(h)
            grads += [grad_h.T @ x, grad_h.sum(axis=0), g.T @ a, g.sum(axis=0)]
            grad_rows[index] = grad_h @ w1.data
        return grad_rows, grads

    def stacked(self, which: str, grads: bool = False) -> Array:
        """This rank's ``which`` (one of :data:`EXPERT_TENSORS`) of every local expert,
        stacked on a new first axis (its ``.grad`` with ``grads``)."""
        k = EXPERT_TENSORS.index(which)
        values = []
        for group in self.params:
            p = group[k]
            if grads and p.grad is None:
                raise RuntimeError(f"MixtureOfExperts.full_grads: {p.name} has no gradient; "
                                   "run backward first")
            values.append(_array.as_array(p.grad) if grads else p.data)
        return _array.namespace(*values).stack(values)


__all__ = ["EXPERT_TENSORS", "LocalExperts", "expert_weights", "router_weight", "store_grad"]
