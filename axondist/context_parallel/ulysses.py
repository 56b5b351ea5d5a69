"""Ulysses attention (DeepSpeed's): trade the sequence split for a head split and back.

One all-to-all turns every rank's ``(..., H, T_r, d)`` queries, keys and values into
``(..., H/W, N, d)``: its share of the heads over the whole sequence. Each rank then
attends locally, and a second all-to-all turns the output (with its log-sum-exp) back
into sequence shards. Backward moves q, k, v, out, lse and dO the same way in one
all-to-all and dq, dk, dv back in another. Both the query and the key heads must divide
by ``W``. Messages carry the compute dtype, one buffer per all-to-all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import comm
from .call import Call
from .kernel import block_backward, block_forward, block_mask

Array = Any


def _to_heads(call: Call, arrays: Sequence[Array]) -> list[Array]:
    """Each ``(*B, H, T_me, c)`` array (heads on axis -3) as this rank's ``(*B, H/W, N, c)``,
    the sequence in rank order; one all-to-all for all of them."""
    xp, n = call.xp, call.world_size
    pieces, send_sizes = [], []
    for j in range(n):
        block = [a[..., j * (a.shape[-3] // n):(j + 1) * (a.shape[-3] // n), :, :]
                 .astype(call.cdtype).reshape(-1) for a in arrays]
        pieces.extend(block)
        send_sizes.append(sum(b.size for b in block))
    per_token = [math.prod(a.shape[:-3]) * (a.shape[-3] // n) * a.shape[-1] for a in arrays]
    recv_sizes = [sum(per_token) * t for t in call.counts]
    flat = xp.concatenate(pieces) if pieces else xp.zeros(0, call.cdtype)
    got = comm.all_to_all(flat, call.group, send_sizes=send_sizes, recv_sizes=recv_sizes)
    result: list[list[Array]] = [[] for _ in arrays]
    at = 0
    for t in call.counts:
        for i, a in enumerate(arrays):
            shape = tuple(a.shape[:-3]) + (a.shape[-3] // n, t, a.shape[-1])
            size = math.prod(shape)
            result[i].append(got[at:at + size].reshape(shape))
            at += size
    return [xp.concatenate(parts, axis=-2) for parts in result]


def _to_sequence(call: Call, arrays: Sequence[Array]) -> list[Array]:
    """The inverse of :func:`_to_heads`: ``(*B, H/W, N, c)`` arrays back to this rank's
    ``(*B, H, T_me, c)``."""
    xp, n = call.xp, call.world_size
    starts = np.concatenate([[0], np.cumsum(call.counts)])
    pieces, send_sizes = [], []
    for j in range(n):
        block = [a[..., starts[j]:starts[j + 1], :].reshape(-1) for a in arrays]
        pieces.extend(block)
        send_sizes.append(sum(b.size for b in block))
    mine = call.counts[call.rank]
    sizes = [math.prod(a.shape[:-2]) * mine * a.shape[-1] for a in arrays]
    flat = xp.concatenate(pieces) if pieces else xp.zeros(0, call.cdtype)
    got = comm.all_to_all(flat, call.group, send_sizes=send_sizes,
                          recv_sizes=[sum(sizes)] * n)
    result: list[list[Array]] = [[] for _ in arrays]
    at = 0
    for _ in range(n):
        for i, a in enumerate(arrays):
            shape = tuple(a.shape[:-2]) + (mine, a.shape[-1])
            result[i].append(got[at:at + sizes[i]].reshape(shape))
            at += sizes[i]
    return [xp.concatenate(parts, axis=-3) for parts in result]


def _head_lead(call: Call, heads_of: Array) -> tuple[int, ...]:
    """The keys' leading shape with this rank's share of the key heads."""
    return tuple(call.kv_lead[:-1]) + (heads_of.shape[-3],)


def ulysses_forward(call: Call, q: Array, k: Array, v: Array) -> tuple[Array, Array]:
    """This rank's ``(out, lse)``, grouped, in the compute dtype."""
    qh, kh, vh = _to_heads(call, [q, k, v])
    positions = np.concatenate(call.positions)
    lead = _head_lead(call, kh)
    qg = call.grouped(qh, lead)
    out = call.xp.zeros(qg.shape[:-1] + (call.dv,), dtype=call.cdtype)
    lse = call.xp.full(qg.shape[:-1] + (1,), -call.xp.inf, dtype=call.cdtype)
    mask = block_mask(call.rule, positions, positions, call.xp)
    if not mask.empty:
        o, lse_b = block_forward(qg[..., mask.rows, :], kh[..., None, mask.cols, :],
                                 vh[..., None, mask.cols, :], mask, call.scale)
        out[..., mask.rows, :] = o
        lse[..., mask.rows, 0] = lse_b
    heads = lead[:-1] + (lead[-1] * call.groups,)
    out_s, lse_s = _to_sequence(call, [out.reshape(heads + out.shape[-2:]),
                                       lse.reshape(heads + lse.shape[-2:])])
    return call.grouped(out_s), call.grouped(lse_s[..., 0])


def ulysses_backward(call: Call, q: Array, k: Array, v: Array, out: Array, lse: Array,
                     grad_out: Array) -> tuple[Array, Array, Array]:
    """This rank's ``(dq, dk, dv)``: dq grouped, dk and dv ``(*kv_lead, T, .)``."""
    qh, kh, vh, oh, lh, doh = _to_heads(call, [q, k, v, out, lse[..., None], grad_out])
    positions = np.concatenate(call.positions)
    lead = _head_lead(call, kh)
    qg, dog = call.grouped(qh, lead), call.grouped(doh, lead)
    lse_g = call.grouped(lh, lead)[..., 0]
    delta = (dog * call.grouped(oh, lead)).sum(axis=-1)
    grad_q = call.xp.zeros(qg.shape, dtype=call.cdtype)
    grad_k = call.xp.zeros(kh.shape, dtype=call.cdtype)
    grad_v = call.xp.zeros(vh.shape, dtype=call.cdtype)
    mask = block_mask(call.rule, positions, positions, call.xp)
    if not mask.empty:
        rows, cols = mask.rows, mask.cols
        gq, gk, gv = block_backward(qg[..., rows, :], kh[..., None, cols, :],
                                    vh[..., None, cols, :], dog[..., rows, :], lse_g[..., rows],
                                    delta[..., rows], mask, call.scale)
        grad_q[..., rows, :] = gq
        grad_k[..., cols, :] = gk[..., 0, :, :]
        grad_v[..., cols, :] = gv[..., 0, :, :]
    heads = lead[:-1] + (lead[-1] * call.groups,)
    dq_s, dk_s, dv_s = _to_sequence(call, [grad_q.reshape(heads + grad_q.shape[-2:]),
                                           grad_k, grad_v])
    return call.grouped(dq_s), dk_s, dv_s


__all__ = ["ulysses_backward", "ulysses_forward"]
