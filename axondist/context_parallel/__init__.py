"""Context parallelism: attention over a sequence too long for one rank.

Each rank holds a share of the sequence's tokens (:mod:`.layout`: zigzag or
contiguous); :func:`attention` and :func:`attention_backward` compute exact softmax
attention for them by one of three methods (ring, all-gather, Ulysses), with causal,
grouped-query and packed-document masks. No autograd: the forward returns what the
backward needs (``out`` and ``lse``). See ``docs/context-parallel.md``.
"""

from .attention import METHODS, Method, attention, attention_backward
from .layout import (
    LAYOUTS,
    Layout,
    contiguous_indices,
    layout_indices,
    pad,
    padded_length,
    shard,
    token_counts,
    unshard,
    zigzag_indices,
)

__all__ = [
    "LAYOUTS",
    "METHODS",
    "Layout",
    "Method",
    "attention",
    "attention_backward",
    "contiguous_indices",
    "layout_indices",
    "pad",
    "padded_length",
    "shard",
    "token_counts",
    "unshard",
    "zigzag_indices",
]
