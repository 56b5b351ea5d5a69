"""Scaled dot-product attention and its backward pass, and the attention block split by
heads: the Q/K/V projection by columns, the output projection by rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _array
from ..comm import all_gather, split_sizes
from ..parameter import Parameter
from ..process_group import ProcessGroup, resolve_group
from .dense import batch_sum, check_dense, full_dense, store_grad, weight_grad
from .mappings import adjoint, gather_last_axis, identity, reduce_sum, shard_bounds

Array = Any


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
        w_qkv, b_qkv = full_dense(self.embed_dim, 3 * self.embed_dim, bias, s1, None)
        w_out, b_out = full_dense(self.embed_dim, self.embed_dim, bias, s2, None)
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
        out_weight, out_bias = check_dense(where, out_weight, out_bias)
        d = out_weight.shape[0]
        qkv_weight, qkv_bias = check_dense(where, qkv_weight, qkv_bias)
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
        store_grad(self.out_weight, weight_grad(grad_y, merged), accumulate)
        if self.out_bias is not None:
            store_grad(self.out_bias, batch_sum(grad_y), accumulate)
        grad_o = _split_heads(grad_y @ self.out_weight.data, len(self.heads))
        grads = scaled_dot_product_attention_backward(q, k, v, weights, grad_o)
        grad_qkv = xp.concatenate([_merge_heads(g) for g in grads], axis=-1)
        store_grad(self.qkv_weight, weight_grad(grad_qkv, x), accumulate)
        if self.qkv_bias is not None:
            store_grad(self.qkv_bias, batch_sum(grad_qkv), accumulate)
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


__all__ = [
    "TensorParallelAttention",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
]
