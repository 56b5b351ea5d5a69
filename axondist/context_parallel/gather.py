"""All-gather attention (Llama 3's form): every rank gathers the whole sequence's keys and
values once and attends its own queries to them.

Forward is one all-gather of the packed keys and values (token counts from the
layout, so uneven counts need no padding). Backward gathers them again, computes
dK/dV for the whole sequence from its own queries, and hands each rank the sum of
everyone's share of its tokens with one reduce-scatter (its adjoint), in the compute
dtype, every rank's rows padded to the largest count.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import comm
from .call import Call
from .kernel import block_backward, block_forward, block_mask

Array = Any


def _token_rows(call: Call, a: Array) -> Array:
    """``(*kv_lead, T, c)`` as ``(T, prod(kv_lead) * c)`` (tokens first, contiguous)."""
    xp = call.xp
    width = math.prod(call.kv_lead) * a.shape[-1]
    return xp.ascontiguousarray(xp.moveaxis(a, -2, 0)).reshape(a.shape[-2], width)


def _from_rows(call: Call, rows: Array, width: int) -> Array:
    """The inverse of :func:`_token_rows`: ``(S, .)`` rows as ``(*kv_lead, S, width)``."""
    xp = call.xp
    shaped = rows.reshape((rows.shape[0],) + call.kv_lead + (width,))
    return xp.moveaxis(shaped, 0, -2)


def _gather_kv(call: Call, k: Array, v: Array) -> tuple[Array, Array]:
    """Every rank's keys and values, in rank order, grouped in the compute dtype."""
    xp = call.xp
    rows = xp.concatenate([_token_rows(call, k), _token_rows(call, v)], axis=1)
    everything = comm.all_gather(rows, call.group, sizes=call.counts)
    split = math.prod(call.kv_lead) * call.d
    return (call.grouped_kv(_from_rows(call, everything[:, :split], call.d)),
            call.grouped_kv(_from_rows(call, everything[:, split:], call.dv)))


def gather_forward(call: Call, q: Array, k: Array, v: Array) -> tuple[Array, Array]:
    """This rank's ``(out, lse)``, grouped, in the compute dtype."""
    xp = call.xp
    qg = call.grouped(q)
    out = xp.zeros(qg.shape[:-1] + (call.dv,), dtype=call.cdtype)
    lse = xp.full(qg.shape[:-1], -xp.inf, dtype=call.cdtype)
    kg, vg = _gather_kv(call, k, v)
    mask = block_mask(call.rule, call.positions[call.rank], np.concatenate(call.positions), xp)
    if not mask.empty:
        o, lse_b = block_forward(qg[..., mask.rows, :], kg[..., mask.cols, :],
                                 vg[..., mask.cols, :], mask, call.scale)
        out[..., mask.rows, :] = o
        lse[..., mask.rows] = lse_b
    return out, lse


def gather_backward(call: Call, q: Array, k: Array, v: Array, out: Array, lse: Array,
                    grad_out: Array) -> tuple[Array, Array, Array]:
    """This rank's ``(dq, dk, dv)``: dq grouped, dk and dv ``(*kv_lead, T, .)``."""
    xp, n = call.xp, call.world_size
    qg, dog, lse_g = call.grouped(q), call.grouped(grad_out), call.grouped(lse)
    delta = (dog * call.grouped(out)).sum(axis=-1)
    kg, vg = _gather_kv(call, k, v)
    grad_q = xp.zeros(qg.shape, dtype=call.cdtype)
    grad_k = xp.zeros(call.kv_lead + (call.seq_len, call.d), dtype=call.cdtype)
    grad_v = xp.zeros(call.kv_lead + (call.seq_len, call.dv), dtype=call.cdtype)
    mask = block_mask(call.rule, call.positions[call.rank], np.concatenate(call.positions), xp)
    if not mask.empty:
        rows, cols = mask.rows, mask.cols
        gq, gk, gv = block_backward(qg[..., rows, :], kg[..., cols, :], vg[..., cols, :],
                                    dog[..., rows, :], lse_g[..., rows], delta[..., rows],
                                    mask, call.scale)
        grad_q[..., rows, :] = gq
        grad_k[..., cols, :] = gk[..., 0, :, :]
        grad_v[..., cols, :] = gv[..., 0, :, :]
    rows_all = xp.concatenate([_token_rows(call, grad_k), _token_rows(call, grad_v)], axis=1)
    most = max(call.counts)
    padded = xp.zeros((n * most, rows_all.shape[1]), dtype=call.cdtype)
    starts = np.concatenate([[0], np.cumsum(call.counts)])
    for j in range(n):
        padded[j * most:j * most + call.counts[j]] = rows_all[starts[j]:starts[j + 1]]
    mine = comm.reduce_scatter_sum(padded, call.group)[:call.counts[call.rank]]
    split = math.prod(call.kv_lead) * call.d
    return (grad_q, _from_rows(call, mine[:, :split], call.d),
            _from_rows(call, mine[:, split:], call.dv))


__all__ = ["gather_backward", "gather_forward"]
