"""Moving tokens to the ranks that hold their experts and back: dispatch and combine.

Experts are split contiguously over the group: rank r holds experts
``[r * E/W, (r+1) * E/W)``, so sorting a rank's (token, expert) assignments by expert
also sorts them by destination rank. :func:`plan_dispatch` decides, from this rank's
routing, which assignments survive the capacity limit and where each goes, and exchanges
the row counts with one small all-to-all; :func:`dispatch` is then one all-to-all of the
token rows with those sizes and :func:`combine` the same all-to-all with the sizes
swapped. An all-to-all is a permutation of rows across the group, so each is the other's
inverse and its adjoint: a backward pass sends gradients through :func:`dispatch` where
the forward pass combined and through :func:`combine` where it dispatched.

Capacity: with a ``capacity_factor`` each source rank sends at most
``C = ceil(T k cf / E)`` rows to any one expert (T this rank's tokens). Assignments are
served first choice before second choice, then in token order; the rest are dropped
(their contribution to the output is zero) and counted in :class:`DispatchStats`. In the
padded mode every source sends exactly ``C`` rows per expert (zeros after the real ones),
the static shapes a compiled kernel wants; the results are the same as unpadded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .. import _array
from ..comm import all_to_all
from ..process_group import ProcessGroup

Array = Any


def expert_capacity(tokens: int, top_k: int, capacity_factor: float, num_experts: int) -> int:
    """``ceil(tokens * top_k * capacity_factor / num_experts)``, the rows one source rank may
    send each expert; the factor is read as the decimal it prints as (``1.1`` is 11/10,
    not the binary float just above it), so exact multiples do not round up."""
    exact = tokens * top_k * Fraction(repr(float(capacity_factor))) / num_experts
    return math.ceil(exact)


def assignment_positions(experts: Array, num_experts: int) -> Array:
    """Each assignment's place in its expert's queue, ``(T, k)``: first choices before
    second choices, and within one choice in token order (the order capacity serves)."""
    xp = _array.namespace(experts)
    t, k = experts.shape
    slot_major = experts.T.reshape(-1)
    order = xp.argsort(slot_major, kind="stable")
    counts = xp.bincount(slot_major, minlength=num_experts)
    starts = xp.cumsum(counts) - counts
    sorted_experts = slot_major[order]
    place = xp.empty(t * k, dtype=xp.int64)
    place[order] = xp.arange(t * k, dtype=xp.int64) - starts[sorted_experts]
    return place.reshape(k, t).T


@dataclass(frozen=True)
class DispatchStats:
    """What one forward pass routed, kept, dropped and moved, on this rank.

    Attributes:
        capacity: rows this rank may send each expert (None: dropless).
        routed: ``(E,)`` this rank's assignments to each expert, before the capacity limit.
        kept: ``(E,)`` the same after it.
        received: ``(E/W,)`` real rows each of this rank's experts received, from all ranks.
        send_rows: rows this rank's dispatch sends to each rank (padding included).
        recv_rows: rows it receives from each rank (padding included).
        row_bytes: bytes of one row (``d_model`` times the item size).
    """

    capacity: int | None
    routed: tuple[int, ...]
    kept: tuple[int, ...]
    received: tuple[int, ...]
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    row_bytes: int

    @property
    def dropped(self) -> int:
        """Assignments of this rank's tokens that the capacity limit dropped."""
        return sum(self.routed) - sum(self.kept)

    @property
    def bytes_sent(self) -> int:
        """Bytes one dispatch sends (one combine receives the same), own rows included."""
        return sum(self.send_rows) * self.row_bytes

    @property
    def bytes_received(self) -> int:
        """Bytes one dispatch receives (one combine sends the same)."""
        return sum(self.recv_rows) * self.row_bytes

    def bytes_to_others(self, rank: int) -> int:
        """Bytes one dispatch sends to ranks other than ``rank`` (this one)."""
        return (sum(self.send_rows) - self.send_rows[rank]) * self.row_bytes


@dataclass(frozen=True)
class DispatchPlan:
    """Where each of this rank's assignments travels, and what arrives (one forward pass).

    Attributes:
        keep: ``(T, k)`` bool, the assignments within capacity.
        send_index: ``(T, k)`` each kept assignment's row in the send buffer (-1: dropped).
        send_token: ``(S,)`` the token each send-buffer row holds (-1: padding).
        send_slot: ``(S,)`` the flat assignment ``t * k + j`` each row holds (-1: padding).
        send_sizes: rows sent to each rank, in rank order.
        recv_sizes: rows received from each rank.
        expert_rows: for each local expert, the received rows it processes (index arrays,
            padding included in the padded mode).
        stats: the counts, for the user.
    """

    keep: Array
    send_index: Array
    send_token: Array
    send_slot: Array
    send_sizes: tuple[int, ...]
    recv_sizes: tuple[int, ...]
    expert_rows: tuple[Array, ...]
    stats: DispatchStats

    @property
    def send_total(self) -> int:
        """Rows of the send buffer."""
        return sum(self.send_sizes)

    @property
    def recv_total(self) -> int:
        """Rows of the receive buffer."""
        return sum(self.recv_sizes)


def _host_ints(a: Array) -> list[int]:
    return [int(v) for v in _array.to_host(a).reshape(-1)]


def plan_dispatch(experts: Array, num_experts: int, group: ProcessGroup, *,
                  capacity: int | None = None, padded: bool = False,
                  row_bytes: int = 0) -> DispatchPlan:
    """Decide this rank's dispatch and exchange the row counts (collective over ``group``:
    one all-to-all of ``W x (E/W + 1)`` integers).

    Args:
        experts: ``(T, k)`` each token's chosen experts (:class:`~.router.Routing`).
        num_experts: E, a multiple of the group size.
        group: the expert-parallel group.
        capacity: rows this rank may send each expert (None: every assignment is kept).
        padded: send exactly ``capacity`` rows per expert (needs a capacity).
        row_bytes: bytes per row, for the stats.
    """
    xp = _array.namespace(experts)
    w = group.world_size
    local = num_experts // w
    t, k = experts.shape
    position = assignment_positions(experts, num_experts)
    keep = position < capacity if capacity is not None else xp.ones((t, k), dtype=bool)
    routed_counts = xp.bincount(experts.reshape(-1), minlength=num_experts)
    kept_counts = xp.bincount(experts[keep], minlength=num_experts)
    if padded:
        assert capacity is not None
        row = experts * capacity + position
        send_sizes = [local * capacity] * w
    else:
        starts = xp.cumsum(kept_counts) - kept_counts
        row = starts[experts] + position
        send_sizes = _host_ints(kept_counts.reshape(w, local).sum(axis=1))
    send_index = xp.where(keep, row, -1)
    send_slot = xp.full(sum(send_sizes), -1, dtype=xp.int64)
    send_slot[send_index[keep]] = xp.flatnonzero(keep.reshape(-1))
    send_token = xp.where(send_slot >= 0, send_slot // max(k, 1), -1)
    # to each rank: the kept rows for each of its experts, and this rank's capacity (-1: none)
    table = xp.empty((w, local + 1), dtype=xp.int64)
    table[:, :local] = kept_counts.reshape(w, local)
    table[:, local] = -1 if not padded else capacity
    got = _array.to_host(all_to_all(table, group, send_sizes=[1] * w))
    received = got[:, :local]
    if padded:
        per_source = got[:, local]
        recv_sizes = [int(c) * local for c in per_source]
        row_expert = np.concatenate([np.repeat(np.arange(local), c) for c in per_source])
    else:
        recv_sizes = [int(v) for v in received.sum(axis=1)]
        row_expert = np.repeat(np.tile(np.arange(local), w), received.reshape(-1))
    by_expert = np.argsort(row_expert, kind="stable")  # rows of expert 0, then 1, ...
    cuts = np.cumsum(np.bincount(row_expert, minlength=local))[:-1]
    expert_rows = tuple(xp.asarray(rows) for rows in np.split(by_expert, cuts))
    stats = DispatchStats(
        capacity=capacity, routed=tuple(_host_ints(routed_counts)),
        kept=tuple(_host_ints(kept_counts)), received=tuple(int(v) for v in received.sum(0)),
        send_rows=tuple(send_sizes), recv_rows=tuple(recv_sizes), row_bytes=int(row_bytes))
    return DispatchPlan(keep, send_index, send_token, send_slot, tuple(send_sizes),
                        tuple(recv_sizes), expert_rows, stats)


def pack(rows: Array, plan: DispatchPlan, weights: Array | None = None) -> Array:
    """The send buffer ``(S, d)``: ``rows[t]`` (times ``weights[t, j]`` when given) at the
    row of each kept assignment ``(t, j)``; zeros at padding rows. One gather."""
    xp = _array.namespace(rows)
    if plan.send_total == 0 or rows.shape[0] == 0:  # nothing, or padding only
        return xp.zeros((plan.send_total, rows.shape[1]), dtype=rows.dtype)
    padding = plan.send_token < 0
    buf = rows[xp.where(padding, 0, plan.send_token)]
    if weights is not None:
        per_row = weights.reshape(-1)[xp.where(padding, 0, plan.send_slot)]
        buf *= per_row.astype(buf.dtype, copy=False)[:, None]
    if plan.stats.capacity is not None and padding.any():
        buf[padding] = 0
    return buf


def unpack(buf: Array, plan: DispatchPlan) -> Array:
    """The rows of a combined buffer back at their assignments: ``(T, k, d)``, zeros where
    an assignment was dropped (the inverse of :func:`pack` on the kept rows)."""
    xp = _array.namespace(buf)
    t, k = plan.keep.shape
    out = xp.zeros((t, k, buf.shape[1]), dtype=buf.dtype)
    if t:
        out[plan.keep] = buf[plan.send_index[plan.keep]]
    return out


def dispatch(buf: Array, plan: DispatchPlan, group: ProcessGroup) -> Array:
    """Send buffer -> the rows this rank's experts process (one all-to-all).

    Adjoint and inverse: :func:`combine`.
    """
    return all_to_all(buf, group, send_sizes=plan.send_sizes, recv_sizes=plan.recv_sizes)


def combine(buf: Array, plan: DispatchPlan, group: ProcessGroup) -> Array:
    """Rows at the experts -> back to the ranks whose tokens they are, in send-buffer order
    (the all-to-all of :func:`dispatch` with the sizes swapped).

    Adjoint and inverse: :func:`dispatch`.
    """
    return all_to_all(buf, group, send_sizes=plan.recv_sizes, recv_sizes=plan.send_sizes)


__all__ = ["DispatchPlan", "DispatchStats", "assignment_positions", "combine", "dispatch",
           "expert_capacity", "pack", "plan_dispatch", "unpack"]
