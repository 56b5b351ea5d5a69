"""The dense layer behind every tensor-parallel shard: its seeded weights, the checks of a
dense weight handed over whole, and the gradient arithmetic the layers share.

A seeded layer draws the full dense ``W`` (out, in) and ``b`` and keeps its slice, so it
stands for the same dense layer whatever the group size.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import numpy as np

from .. import _array
from ..parameter import Parameter

Array = Any
Init = Callable[[np.random.Generator, tuple[int, int]], np.ndarray]


def default_init(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Uniform in ``[-1/sqrt(in), 1/sqrt(in)]`` for a weight of shape ``(out, in)``
    (the bound of PyTorch's ``nn.Linear``)."""
    bound = 1.0 / np.sqrt(max(shape[1], 1))
    return rng.uniform(-bound, bound, size=shape)


def full_dense(in_features: int, out_features: int, bias: bool, seed: int,
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


def store_grad(p: Parameter, g: Array, accumulate: bool) -> None:
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


def as_rows(a: Array) -> Array:
    """``a`` as a matrix (batch, features); explicit sizes, since either may be 0."""
    return a.reshape(prod(a.shape[:-1]), a.shape[-1])


def weight_grad(grad_y: Array, x: Array) -> Array:
    """``sum over batch of grad_y^T x`` for inputs with any leading batch dimensions."""
    return as_rows(grad_y).T @ as_rows(x)


def batch_sum(grad_y: Array) -> Array:
    return as_rows(grad_y).sum(axis=0)



def check_dense(where: str, weight: Array, bias: Array | None) -> tuple[Array, Array | None]:
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


__all__ = ["Init", "default_init"]
