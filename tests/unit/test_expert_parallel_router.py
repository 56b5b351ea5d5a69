"""The mixture-of-experts router and the dispatch arithmetic, without communication:
top-k gating, the softmax backward, the load-balancing and z losses and their gradients
(against finite differences), capacity and each assignment's place in its expert's queue."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist.expert_parallel import assignment_positions, expert_capacity
from axondist.expert_parallel import router as rt

seeds = st.integers(0, 2**31 - 1)


def logits_of(seed: int, t: int, e: int, scale: float = 1.0) -> np.ndarray:
    return scale * np.random.default_rng(seed).standard_normal((t, e))


@given(seed=seeds, t=st.integers(0, 6), e=st.integers(1, 7))
def test_softmax_and_logsumexp_match_float64_formulas(seed, t, e):
    z = logits_of(seed, t, e, 3.0)
    p = rt.softmax(z)
    np.testing.assert_allclose(p, np.exp(z) / np.exp(z).sum(1, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(rt.logsumexp(z), np.log(np.exp(z).sum(1)), rtol=1e-12)


def test_softmax_and_logsumexp_do_not_overflow():
    z = np.array([[1000.0, 999.0, -1000.0]])
    np.testing.assert_allclose(rt.softmax(z), [[1 / (1 + np.exp(-1)), 1 / (1 + np.e), 0.0]],
                               rtol=1e-12, atol=1e-300)
    assert rt.logsumexp(z)[0] == pytest.approx(1000 + np.log1p(np.exp(-1)), rel=1e-15)


@given(seed=seeds, t=st.integers(0, 6), e=st.integers(1, 7), data=st.data())
def test_route_picks_the_largest_logits_with_their_probabilities(seed, t, e, data):
    k = data.draw(st.integers(1, e))
    z = logits_of(seed, t, e)
    routing = rt.route(z, k)
    assert routing.experts.shape == (t, k) and routing.gates.shape == (t, k)
    for row in range(t):
        want = sorted(range(e), key=lambda i: (-z[row, i], i))[:k]
        assert routing.experts[row].tolist() == want
        np.testing.assert_array_equal(routing.gates[row], routing.probs[row, want])


def test_equal_logits_go_to_the_lower_expert():
    routing = rt.route(np.zeros((2, 5)), 3)
    assert routing.experts.tolist() == [[0, 1, 2], [0, 1, 2]]
    routing = rt.route(np.array([[0.0, 2.0, 1.0, 2.0]]), 2)
    assert routing.experts.tolist() == [[1, 3]]


def numeric_grad(f, z: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(z)
    for idx in np.ndindex(z.shape):
        zp, zm = z.copy(), z.copy()
        zp[idx] += eps
        zm[idx] -= eps
        g[idx] = (f(zp) - f(zm)) / (2 * eps)
    return g


@given(seed=seeds, t=st.integers(1, 4), e=st.integers(2, 5), k=st.integers(1, 2))
@settings(max_examples=30)
def test_route_backward_matches_finite_differences(seed, t, e, k):
    k = min(k, e)
    z = logits_of(seed, t, e)
    rng = np.random.default_rng(seed + 1)
    weight_gates, weight_probs = rng.standard_normal((t, k)), rng.standard_normal((t, e))
    chosen = rt.route(z, k).experts

    def loss(zz):  # the selection held fixed, as the router's backward holds it
        p = rt.softmax(zz)
        return float((np.take_along_axis(p, chosen, 1) * weight_gates).sum()
                     + (p * weight_probs).sum())

    got = rt.route_backward(rt.route(z, k), weight_gates, weight_probs)
    np.testing.assert_allclose(got, numeric_grad(loss, z), rtol=1e-6, atol=1e-8)
    alone = rt.route_backward(rt.route(z, k), weight_gates)
    np.testing.assert_allclose(alone, numeric_grad(
        lambda zz: float((np.take_along_axis(rt.softmax(zz), chosen, 1) * weight_gates).sum()),
        z), rtol=1e-6, atol=1e-8)


def totals_of(z: np.ndarray, k: int) -> rt.BalanceTotals:
    routing = rt.route(z, k)
    return rt.BalanceTotals.of(rt.balance_sums(routing, z, z.shape[1]), z.shape[1])


@given(seed=seeds, t=st.integers(0, 8), e=st.integers(1, 6), data=st.data())
def test_balance_sums_and_the_load_balancing_loss(seed, t, e, data):
    k = data.draw(st.integers(1, e))
    z = logits_of(seed, t, e)
    totals = totals_of(z, k)
    routing = rt.route(z, k)
    counts = np.bincount(routing.experts.reshape(-1), minlength=e)
    np.testing.assert_array_equal(totals.counts, counts)
    np.testing.assert_allclose(totals.prob_sums, routing.probs.sum(0), rtol=1e-12)
    assert totals.tokens == t
    assert totals.lse_squares == pytest.approx(float((rt.logsumexp(z) ** 2).sum()), rel=1e-12)
    want = 0.0 if t == 0 else 0.3 * e * sum(
        counts[i] / (t * k) * routing.probs[:, i].mean() for i in range(e))
    assert rt.load_balancing_loss(totals, k, 0.3) == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_a_perfectly_balanced_batch_costs_the_coefficient():
    # every expert chosen equally often with equal probability: E * sum (1/E)(1/E) = 1
    totals = rt.BalanceTotals(np.full(4, 6.0), np.full(4, 6.0), 24.0, 0.0)
    assert rt.load_balancing_loss(totals, 1, 0.01) == pytest.approx(0.01, rel=1e-15)
    empty = rt.BalanceTotals(np.zeros(4), np.zeros(4), 0.0, 0.0)
    assert rt.load_balancing_loss(empty, 2, 0.01) == 0.0 and rt.z_loss(empty, 1.0) == 0.0
    np.testing.assert_array_equal(rt.load_balancing_grad(empty, 2, 0.01), np.zeros(4))


@given(seed=seeds, t=st.integers(1, 5), e=st.integers(2, 5), k=st.integers(1, 2))
@settings(max_examples=30)
def test_aux_and_z_loss_gradients_match_finite_differences(seed, t, e, k):
    k = min(k, e)
    z = logits_of(seed, t, e)
    fixed = totals_of(z, k)  # the counts are held fixed; the probabilities are not

    def aux(zz):
        p = rt.softmax(zz)
        return rt.load_balancing_loss(rt.BalanceTotals(fixed.counts, p.sum(0), t, 0.0), k, 0.7)

    def zl(zz):
        return rt.z_loss(rt.BalanceTotals(fixed.counts, fixed.prob_sums, t,
                                          float((rt.logsumexp(zz) ** 2).sum())), 0.4)

    routing = rt.route(z, k)
    per_expert = rt.load_balancing_grad(fixed, k, 0.7)
    got = rt.route_backward(routing, np.zeros((t, k)), np.broadcast_to(per_expert, (t, e)))
    np.testing.assert_allclose(got, numeric_grad(aux, z), rtol=1e-6, atol=1e-9)
    got_z = rt.z_loss_grad(z, routing.probs, t, 0.4)
    np.testing.assert_allclose(got_z, numeric_grad(zl, z), rtol=1e-6, atol=1e-9)
    assert rt.z_loss(fixed, 0.4) == pytest.approx(0.4 * float((rt.logsumexp(z) ** 2).mean()))


# --- capacity and queues ---------------------------------------------------------------

def test_capacity_reads_the_factor_as_the_decimal_it_prints_as():
    assert expert_capacity(10, 1, 1.1, 11) == 1  # 10 * 1.1 / 11 is exactly 1
    assert expert_capacity(0, 2, 1.25, 8) == 0
    assert expert_capacity(7, 2, 1.0, 4) == 4
    assert expert_capacity(16, 2, 1.25, 8) == 5


@given(t=st.integers(0, 200), k=st.integers(1, 4), e=st.integers(1, 64),
       cf=st.sampled_from([0.1, 0.5, 1.0, 1.1, 1.25, 1.5, 2.0, 3.3]))
def test_capacity_is_the_ceiling_of_the_exact_quotient(t, k, e, cf):
    assert expert_capacity(t, k, cf, e) == math.ceil(Fraction(t * k) * Fraction(str(cf)) / e)


@given(seed=seeds, t=st.integers(0, 9), e=st.integers(1, 6), data=st.data())
def test_assignment_positions_follow_first_choices_then_token_order(seed, t, e, data):
    k = data.draw(st.integers(1, e))
    experts = rt.route(logits_of(seed, t, e), k).experts
    got = assignment_positions(experts, e)
    assert got.shape == (t, k)
    queue_length = [0] * e
    for j in range(k):
        for row in range(t):
            assert got[row, j] == queue_length[experts[row, j]]
            queue_length[experts[row, j]] += 1
