"""The router of a mixture-of-experts layer: top-k gating and its two auxiliary losses.

Every function here is local arithmetic on this rank's tokens; where a loss needs the
whole batch (the load-balancing loss's expert counts, the token count both losses divide
by), the caller passes the global sums (:func:`balance_sums` gives this rank's part).

Gating: ``p = softmax(x Wr^T)`` over the experts; each token goes to the ``top_k``
experts of largest logit (ties to the lower index) with gates ``p`` of those experts
(not renormalised, so ``top_k=1`` still trains the router through the main loss). The
choice itself is not differentiated, as in every production router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import _array

Array = Any


@dataclass(frozen=True)
class Routing:
    """Where each of this rank's tokens goes.

    Attributes:
        probs: ``(T, E)`` softmax of the router logits.
        experts: ``(T, k)`` the chosen experts, best first (integers).
        gates: ``(T, k)`` the chosen experts' probabilities: the weights of their outputs.
    """

    probs: Array
    experts: Array
    gates: Array


def softmax(logits: Array) -> Array:
    """Softmax over the last axis, shifted by the row maximum (no overflow)."""
    xp = _array.namespace(logits)
    if logits.shape[-1] == 0 or logits.size == 0:
        return xp.zeros_like(logits)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    e = xp.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def logsumexp(logits: Array) -> Array:
    """``log(sum(exp(logits)))`` over the last axis, computed without overflow."""
    xp = _array.namespace(logits)
    if logits.size == 0:
        return xp.zeros(logits.shape[:-1], dtype=logits.dtype)
    top = logits.max(axis=-1)
    return top + xp.log(xp.exp(logits - top[..., None]).sum(axis=-1))


def route(logits: Array, top_k: int) -> Routing:
    """The top-``top_k`` experts of each row of ``logits`` ``(T, E)`` and their gates."""
    xp = _array.namespace(logits)
    probs = softmax(logits)
    # a stable sort of -logits: equal logits go to the lower expert index
    experts = xp.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    gates = xp.take_along_axis(probs, experts, axis=-1)
    return Routing(probs, experts, gates)


def route_backward(routing: Routing, grad_gates: Array, grad_probs: Array | None = None
                   ) -> Array:
    """d(loss)/d(logits) ``(T, E)`` from d(loss)/d(gates) ``(T, k)`` and, optionally, a
    gradient on all of ``probs`` ``(T, E)`` (the load-balancing loss's).

    The softmax Jacobian: ``dz = p * (dp - sum(dp * p))`` row by row.
    """
    p = routing.probs
    xp = _array.namespace(p)
    grad_p = xp.zeros_like(p) if grad_probs is None else grad_probs.astype(p.dtype, copy=True)
    if p.shape[0]:
        rows = xp.arange(p.shape[0])[:, None]
        grad_p[rows, routing.experts] += grad_gates  # (token, expert) pairs are distinct
    return p * (grad_p - (grad_p * p).sum(axis=-1, keepdims=True))


def balance_sums(routing: Routing, logits: Array, num_experts: int) -> Array:
    """This rank's part of the batch statistics both auxiliary losses need, as one float64
    vector to sum over every rank holding tokens: ``[counts (E), prob sums (E), tokens,
    sum of logsumexp(logits)^2]``. ``counts[i]`` is how many of this rank's tokens chose
    expert ``i`` (before any capacity drop)."""
    xp = _array.namespace(logits)
    counts = xp.bincount(routing.experts.reshape(-1), minlength=num_experts)[:num_experts]
    lse = logsumexp(logits)
    tail = xp.stack([xp.asarray(float(logits.shape[0])), (lse.astype(xp.float64) ** 2).sum()])
    return xp.concatenate([counts.astype(xp.float64), routing.probs.sum(axis=0)
                           .astype(xp.float64), tail])


@dataclass(frozen=True)
class BalanceTotals:
    """The global sums of :func:`balance_sums`, read back as named fields.

    Attributes:
        counts: ``(E,)`` float64, tokens that chose each expert, over the whole batch.
        prob_sums: ``(E,)`` float64, each expert's router probability summed over the batch.
        tokens: N, the batch's token count.
        lse_squares: ``sum_t logsumexp(z_t)^2`` over the batch.
    """

    counts: Array
    prob_sums: Array
    tokens: float
    lse_squares: float

    @classmethod
    def of(cls, summed: Array, num_experts: int) -> BalanceTotals:
        """Read ``summed`` (the all-reduced :func:`balance_sums` vector)."""
        host = _array.to_host(summed)
        e = num_experts
        return cls(host[:e], host[e:2 * e], float(host[2 * e]), float(host[2 * e + 1]))


def load_balancing_loss(totals: BalanceTotals, top_k: int, coeff: float) -> float:
    """``coeff * E * sum_i f_i P_i``: ``f_i = counts_i / (N k)`` the share of the batch's
    assignments that went to expert i, ``P_i = prob_sums_i / N`` its mean router
    probability (Switch Transformer's loss; 1 * coeff when perfectly balanced)."""
    n = totals.tokens
    if n == 0:
        return 0.0
    e = len(totals.counts)
    f = totals.counts / (n * top_k)
    return float(coeff * e * (f * totals.prob_sums / n).sum())


def load_balancing_grad(totals: BalanceTotals, top_k: int, coeff: float) -> Any:
    """d(load-balancing loss)/d(probs[t, i]) = ``coeff * E * f_i / N``, the same for every
    token (``f`` is a count, held constant): a NumPy ``(E,)`` float64 vector."""
    n = totals.tokens
    e = len(totals.counts)
    if n == 0:
        return totals.counts * 0.0
    return coeff * e * (totals.counts / (n * top_k)) / n


def z_loss(totals: BalanceTotals, coeff: float) -> float:
    """The router z-loss ``coeff / N * sum_t logsumexp(z_t)^2`` (ST-MoE): keeps the logits
    small, so the softmax stays in a range floating point rounds well."""
    return 0.0 if totals.tokens == 0 else float(coeff * totals.lse_squares / totals.tokens)


def z_loss_grad(logits: Array, probs: Array, tokens: float, coeff: float) -> Array:
    """d(z-loss)/d(logits) for this rank's rows: ``2 coeff / N * lse_t * softmax(z_t)``."""
    if tokens == 0:
        return probs * 0
    lse = logsumexp(logits)
    return (2.0 * coeff / tokens) * lse[:, None] * probs


__all__ = ["BalanceTotals", "Routing", "balance_sums", "load_balancing_grad",
           "load_balancing_loss", "logsumexp", "route", "route_backward", "softmax",
           "z_loss", "z_loss_grad"]
