"""Ring attention: key/value blocks travel around the ring while each rank computes.

Forward: at step s rank r holds the keys and values of rank ``r - s``; it posts
their transfer to rank ``r + 1`` (and the receipt of rank ``r - s - 1``'s), folds
the block into its running output by log-sum-exp, then waits: ``W - 1`` transfers
in all, each overlapping one block's compute. Backward: the keys and values travel
the same way, and with each block a dK/dV accumulator in the compute dtype, to which
every rank adds its queries' share; after ``W`` steps it arrives back at the rank that
owns those keys (``W`` accumulator transfers, each overlapping the next step).
"""

from __future__ import annotations

from typing import Any

from .call import Call
from .kernel import block_backward, block_forward, block_mask, merge
from .ring_link import GRAD_TAG, KV_TAG, RingLink

Array = Any


def ring_forward(call: Call, q: Array, k: Array, v: Array) -> tuple[Array, Array]:
    """This rank's ``(out, lse)``, in the grouped compute form (see :class:`Call`)."""
    xp, n, r = call.xp, call.world_size, call.rank
    qg = call.grouped(q)
    out = xp.zeros(qg.shape[:-1] + (call.dv,), dtype=call.cdtype)
    lse = xp.full(qg.shape[:-1], -xp.inf, dtype=call.cdtype)
    kv = call.pack_kv(k, v, call.dtype)
    with RingLink(call.backend) as link:
        for step in range(n):
            src = (r - step) % n
            transfer, incoming = None, None
            if step < n - 1:
                incoming = xp.empty(call.kv_size(call.counts[(src - 1) % n]), dtype=call.dtype)
                transfer = link.start(kv, incoming, KV_TAG)
            mask = block_mask(call.rule, call.positions[r], call.positions[src], xp)
            if not mask.empty:
                kb, vb = (call.grouped_kv(a) for a in call.unpack_kv(kv, call.counts[src]))
                o, lse_b = block_forward(qg[..., mask.rows, :], kb[..., mask.cols, :],
                                         vb[..., mask.cols, :], mask, call.scale)
                merge(out[..., mask.rows, :], lse[..., mask.rows], o, lse_b)
            if transfer is not None:
                transfer.wait()
                kv = incoming
    return out, lse


def ring_backward(call: Call, q: Array, k: Array, v: Array, out: Array, lse: Array,
                  grad_out: Array) -> tuple[Array, Array, Array]:
    """This rank's ``(dq, dk, dv)``: dq grouped, dk and dv ``(*kv_lead, T, .)``, all in
    the compute dtype."""
    xp, n, r = call.xp, call.world_size, call.rank
    qg, dog, lse_g = call.grouped(q), call.grouped(grad_out), call.grouped(lse)
    delta = (dog * call.grouped(out)).sum(axis=-1)
    grad_q = xp.zeros(qg.shape, dtype=call.cdtype)
    kv = call.pack_kv(k, v, call.dtype)
    arrived = None  # the accumulator of the block this step holds, from the previous rank
    pending = None
    with RingLink(call.backend, streams=2) as link:
        for step in range(n):
            src = (r - step) % n
            kv_transfer, incoming = None, None
            if step < n - 1:
                incoming = xp.empty(call.kv_size(call.counts[(src - 1) % n]), dtype=call.dtype)
                kv_transfer = link.start(kv, incoming, KV_TAG)
            acc = xp.zeros(call.kv_size(call.counts[src]), dtype=call.cdtype)
            mask = block_mask(call.rule, call.positions[r], call.positions[src], xp)
            if not mask.empty:
                kb, vb = (call.grouped_kv(a) for a in call.unpack_kv(kv, call.counts[src]))
                rows, cols = mask.rows, mask.cols
                gq, gk, gv = block_backward(qg[..., rows, :], kb[..., cols, :], vb[..., cols, :],
                                            dog[..., rows, :], lse_g[..., rows], delta[..., rows],
                                            mask, call.scale)
                grad_q[..., rows, :] += gq
                acc_k, acc_v = call.unpack_kv(acc, call.counts[src])
                acc_k[..., cols, :] += gk[..., 0, :, :]
                acc_v[..., cols, :] += gv[..., 0, :, :]
            if pending is not None:
                pending.wait()
                acc += arrived
            if n == 1:
                arrived = acc
            else:
                arrived = xp.empty(call.kv_size(call.counts[(src - 1) % n]), dtype=call.cdtype)
                pending = link.start(acc, arrived, GRAD_TAG)
            if kv_transfer is not None:
                kv_transfer.wait()
                kv = incoming
        if pending is not None:
            pending.wait()
    grad_k, grad_v = call.unpack_kv(arrived, call.counts[r])
    return grad_q, grad_k, grad_v


__all__ = ["ring_backward", "ring_forward"]
