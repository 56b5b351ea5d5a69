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
built from the adjoint pairs of :mod:`~axondist.tensor_parallel.mappings`: a
backward pass applies, in reverse order, the adjoint of each collective its
forward pass applied.

Dense convention: ``y = x @ W.T + b`` with ``W`` of shape ``(out, in)``.
Shards follow :func:`numpy.array_split` (:func:`axondist.comm.split_sizes`):
with ``n`` features over ``p`` ranks, the first ``n % p`` ranks hold one
feature more, so sizes need not divide the group size.
"""

from .attention import (
    TensorParallelAttention,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from .clipping import clip_grad_norm
from .dense import default_init
from .linear import ColumnParallelLinear, RowParallelLinear
from .mappings import (
    ADJOINT,
    adjoint,
    gather_first_axis,
    gather_last_axis,
    identity,
    reduce_scatter_first_axis,
    reduce_sum,
    shard_bounds,
    split_last_axis,
)
from .mlp import ACTIVATIONS, Activation, TensorParallelMLP

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
