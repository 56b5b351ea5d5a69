"""MixtureOfExperts against a one-process float64 reference, at any world size.

Every rank derives every rank's tokens and output gradients from a seed, so it can run
the dense reference (every expert applied to every token, masked by the routing) over
the whole batch and check its own outputs, input gradients, and the gathered dense
parameter gradients. The reference's own backward is checked against finite
differences. On the mock world at 1-4 ranks, and under mpiexec / torchrun at their size.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from fractions import Fraction

import numpy as np
import pytest
from harness import LAUNCHED, current_size, mock_only, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from axondist.errors import CollectiveMismatchError, InvalidBufferError, UnsupportedDTypeError
from axondist.expert_parallel import (
    MixtureOfExperts,
    combine,
    dispatch,
    expert_weights,
    pack,
    plan_dispatch,
    router_weight,
    unpack,
)
from axondist.mesh import DeviceMesh
from axondist.optim import Adam

TOL = dict(rtol=1e-10, atol=1e-12)
D, H, E = 5, 6, 12  # E divisible by 1, 2, 3 and 4 ranks
seeds = st.integers(0, 2**31 - 1)


def normal(seed: int, tag: int, shape: tuple[int, ...], rank: int = -1) -> np.ndarray:
    """A seeded float64 array; ``rank`` >= 0 makes a per-rank one."""
    return np.random.default_rng([seed, tag, rank + 1]).standard_normal(shape)


def dense_weights(seed: int, e: int = E, d: int = D, h: int = H) -> dict[str, np.ndarray]:
    per = [expert_weights(seed, i, d, h) for i in range(e)]
    out = {"router": router_weight(seed, e, d)}
    for k, name in enumerate(("w1", "b1", "w2", "b2")):
        out[name] = np.stack([p[k] for p in per])
    return out


# --- the one-process reference ---------------------------------------------------------

def gelu(h):
    c = math.sqrt(2.0 / math.pi)
    t = np.tanh(c * (h + 0.044715 * h**3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h)


def ref_capacity(tokens, k, cf, e):
    return math.ceil(Fraction(tokens * k) * Fraction(repr(float(cf))) / e)


def ref_routing(w, blocks, k, cf):
    """Per token of the concatenated blocks: chosen experts (N, k), and the dense masks
    ``chosen`` (N, E) and ``kept`` (N, E); per block: routed and kept counts per expert."""
    x = np.concatenate(blocks)
    logits = x @ w["router"].T
    e = logits.shape[1]
    top = np.array([sorted(range(e), key=lambda i: (-row[i], i))[:k] for row in logits],
                   dtype=int).reshape(-1, k)
    chosen = np.zeros(logits.shape, bool)
    kept = np.zeros(logits.shape, bool)
    routed_counts, kept_counts = [], []
    start = 0
    for b in blocks:
        t = len(b)
        cap = None if cf is None else ref_capacity(t, k, cf, e)
        used = [0] * e
        for j in range(k):          # first choices first, then token order
            for i in range(start, start + t):
                ex = top[i, j]
                chosen[i, ex] = True
                if cap is None or used[ex] < cap:
                    kept[i, ex] = True
                used[ex] += 1
        routed_counts.append(np.bincount(top[start:start + t].reshape(-1), minlength=e))
        kept_counts.append(kept[start:start + t].sum(0))
        start += t
    return logits, top, chosen, kept, routed_counts, kept_counts


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def reference(w, blocks, gy_blocks, k, cf=None, aux=0.0, zc=0.0):
    """y, dx per block, dense gradients, aux and z loss values, routing counts: every
    expert on every token, masked; the loss is ``sum(y * gy) + aux + z``."""
    x = np.concatenate(blocks).astype(np.float64)
    gy = np.concatenate(gy_blocks).astype(np.float64)
    n, e = len(x), w["router"].shape[0]
    logits, top, chosen, kept, routed, kept_counts = ref_routing(w, blocks, k, cf)
    p = softmax(logits) if n else np.zeros((0, e))
    gate = np.where(kept, p, 0.0)
    y = np.zeros_like(x)
    dx = np.zeros_like(x)
    grads = {name: np.zeros_like(v) for name, v in w.items()}
    dgate = np.zeros((n, e))
    for i in range(e):
        hid = x @ w["w1"][i].T + w["b1"][i]
        a, da = gelu(hid)
        out = a @ w["w2"][i].T + w["b2"][i]
        y += gate[:, i:i + 1] * out
        dgate[:, i] = np.where(kept[:, i], (gy * out).sum(1), 0.0)
        g = gate[:, i:i + 1] * gy
        grads["w2"][i] = g.T @ a
        grads["b2"][i] = g.sum(0)
        gh = (g @ w["w2"][i]) * da
        grads["w1"][i] = gh.T @ x
        grads["b1"][i] = gh.sum(0)
        dx += gh @ w["w1"][i]
    counts = chosen.sum(0)
    f = counts / (n * k) if n else np.zeros(e)
    aux_value = aux * e * float((f * p.mean(0)).sum()) if n else 0.0
    lse = (np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
           if n else np.zeros(0))
    z_value = zc * float((lse ** 2).mean()) if n else 0.0
    dp = dgate + (aux * e * f / n if n else 0.0)
    dz = p * (dp - (dp * p).sum(1, keepdims=True))
    if n:
        dz += (2 * zc / n) * lse[:, None] * p
    grads["router"] = dz.T @ x
    dx += dz @ w["router"]
    cuts = np.cumsum([len(b) for b in blocks])[:-1]
    return dict(y=np.split(y, cuts), dx=np.split(dx, cuts), grads=grads, aux=aux_value,
                z=z_value, routed=routed, kept=kept_counts)


def loss_of(w, blocks, gy_blocks, k, cf, aux, zc):
    r = reference(w, blocks, gy_blocks, k, cf, aux, zc)
    return sum(float((a * b).sum()) for a, b in zip(r["y"], gy_blocks)) + r["aux"] + r["z"]


@pytest.mark.parametrize("cf, aux, zc", [(None, 0.0, 0.0), (None, 0.3, 0.2), (1.0, 0.1, 0.05)])
def test_the_reference_backward_matches_finite_differences(cf, aux, zc):
    e, d, h, k = 4, 3, 4, 2
    w = dense_weights(3, e, d, h)
    blocks = [normal(1, 1, (5, d)), normal(1, 2, (3, d))]
    gys = [normal(1, 3, (5, d)), normal(1, 4, (3, d))]
    r = reference(w, blocks, gys, k, cf, aux, zc)
    if cf is not None:
        assert sum(r["routed"][0]) > sum(r["kept"][0])  # something is dropped
    eps = 1e-6
    for name, value in w.items():
        for idx in list(np.ndindex(value.shape))[:: max(1, value.size // 15)]:
            plus = {kk: v.copy() for kk, v in w.items()}
            minus = {kk: v.copy() for kk, v in w.items()}
            plus[name][idx] += eps
            minus[name][idx] -= eps
            fd = (loss_of(plus, blocks, gys, k, cf, aux, zc)
                  - loss_of(minus, blocks, gys, k, cf, aux, zc)) / (2 * eps)
            assert fd == pytest.approx(r["grads"][name][idx], rel=1e-5, abs=1e-7), (name, idx)
    for b in range(2):
        for idx in np.ndindex(blocks[b].shape):
            bp = [x.copy() for x in blocks]
            bm = [x.copy() for x in blocks]
            bp[b][idx] += eps
            bm[b][idx] -= eps
            fd = (loss_of(w, bp, gys, k, cf, aux, zc) - loss_of(w, bm, gys, k, cf, aux, zc)) \
                / (2 * eps)
            assert fd == pytest.approx(r["dx"][b][idx], rel=1e-5, abs=1e-7), (b, idx)


# --- the layer against the reference ----------------------------------------------------

def _body_layer(world, seed, tokens, k, cf, padded, aux, zc):
    n, r = world.world_size, world.rank
    blocks = [normal(seed, 1, (tokens[q], D), q) for q in range(n)]
    gys = [normal(seed, 2, (tokens[q], D), q) for q in range(n)]
    moe = MixtureOfExperts(D, H, E, k, world, capacity_factor=cf, padded=padded,
                           aux_loss_coeff=aux, z_loss_coeff=zc, seed=seed, dtype=np.float64)
    assert list(moe.local_experts) == list(range(r * E // n, (r + 1) * E // n))
    w = dense_weights(seed)
    ref = reference(w, blocks, gys, k, cf, aux, zc)
    for name, value in moe.full_weights().items():
        np.testing.assert_array_equal(value, w[name])
    y = moe.forward(blocks[r])
    np.testing.assert_allclose(y, ref["y"][r], **TOL)
    assert moe.aux_loss == pytest.approx(ref["aux"], rel=1e-12, abs=1e-15)
    assert moe.z_loss == pytest.approx(ref["z"], rel=1e-12, abs=1e-15)
    dx = moe.backward(gys[r])
    np.testing.assert_allclose(dx, ref["dx"][r], **TOL)
    for name, value in moe.full_grads().items():
        np.testing.assert_allclose(value, ref["grads"][name], **TOL, err_msg=name)
    # what was routed, kept, dropped, moved
    s = moe.stats
    assert s.routed == tuple(ref["routed"][r]) and s.kept == tuple(ref["kept"][r])
    assert s.dropped == int(ref["routed"][r].sum() - ref["kept"][r].sum())
    assert s.capacity == (None if cf is None else ref_capacity(tokens[r], k, cf, E))
    local = E // n
    rows_to = [int(ref["kept"][r][q * local:(q + 1) * local].sum()) for q in range(n)]
    rows_from = [int(ref["kept"][q][r * local:(r + 1) * local].sum()) for q in range(n)]
    if padded:
        rows_to = [local * s.capacity] * n
        rows_from = [local * ref_capacity(tokens[q], k, cf, E) for q in range(n)]
    assert s.send_rows == tuple(rows_to) and s.recv_rows == tuple(rows_from)
    assert s.received == tuple(int(sum(ref["kept"][q][i] for q in range(n)))
                               for i in moe.local_experts)
    assert s.bytes_sent == sum(rows_to) * D * 8 and s.bytes_received == sum(rows_from) * D * 8
    assert s.bytes_to_others(r) == (sum(rows_to) - rows_to[r]) * D * 8
    return y


token_lists = st.lists(st.integers(0, 7), min_size=4, max_size=4)


@given(n=world_sizes(1, 4), seed=seeds, tokens=token_lists, k=st.integers(1, 3),
       losses=st.sampled_from([(0.0, 0.0), (0.01, 0.001), (0.5, 0.3)]))
@settings(max_examples=20, deadline=None)
def test_dropless_layer_matches_the_reference(n, seed, tokens, k, losses):
    tokens = (tokens * 2)[:n]
    run_world(_body_layer, n, seed, tokens, k, None, False, *losses)


@given(n=world_sizes(1, 4), seed=seeds, tokens=token_lists, k=st.integers(1, 2),
       cf=st.sampled_from([0.5, 1.0, 1.25, 2.0]), padded=st.booleans())
@settings(max_examples=20, deadline=None)
def test_capacity_layer_matches_the_reference(n, seed, tokens, k, cf, padded):
    tokens = (tokens * 2)[:n]
    run_world(_body_layer, n, seed, tokens, k, cf, padded, 0.01, 0.001)


@pytest.mark.parametrize("tokens", [[0, 0, 0, 0], [0, 9, 0, 1], [13, 0, 2, 0]])
def test_zero_and_uneven_token_counts(tokens):
    n = current_size(4)
    run_world(_body_layer, n, 11, (tokens * 2)[:n], 2, None, False, 0.01, 0.001)
    run_world(_body_layer, n, 12, (tokens * 2)[:n], 2, 1.0, True, 0.0, 0.0)


def _body_float32(world, seed, tokens):
    """float32 parameters compute in float32 and stay near the float64 reference."""
    n, r = world.world_size, world.rank
    blocks = [normal(seed, 1, (tokens[q], D), q) for q in range(n)]
    gys = [normal(seed, 2, (tokens[q], D), q) for q in range(n)]
    ref = reference(dense_weights(seed), blocks, gys, 2, None, 0.01, 0.001)
    moe = MixtureOfExperts(D, H, E, 2, world, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                           seed=seed)
    y = moe.forward(blocks[r])  # float64 tokens are computed in the layer's float32
    dx = moe.backward(gys[r])
    assert y.dtype == dx.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in moe.parameters())
    np.testing.assert_allclose(y, ref["y"][r], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx, ref["dx"][r], rtol=1e-4, atol=1e-5)
    for name, value in moe.full_grads().items():
        np.testing.assert_allclose(value, ref["grads"][name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_float32_layer_is_near_the_float64_reference():
    n = current_size(3)
    run_world(_body_float32, n, 21, ([6, 0, 9, 4] * 2)[:n])


def _body_modes(world, seed, tokens, cf):
    """Padded and unpadded: the same outputs, input gradients and parameter gradients."""
    r = world.rank
    x = normal(seed, 1, (tokens[r], D), r)
    gy = normal(seed, 2, (tokens[r], D), r)
    out = []
    for padded in (False, True):
        moe = MixtureOfExperts(D, H, E, 2, world, capacity_factor=cf, padded=padded,
                               aux_loss_coeff=0.1, seed=seed, dtype=np.float64)
        out.append((moe.forward(x), moe.backward(gy), moe.full_grads(), moe.stats))
    (y0, dx0, g0, s0), (y1, dx1, g1, s1) = out
    np.testing.assert_allclose(y1, y0, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-13, atol=1e-14)
    for name in g0:
        np.testing.assert_allclose(g1[name], g0[name], rtol=1e-13, atol=1e-14)
    assert (s0.routed, s0.kept, s0.dropped) == (s1.routed, s1.kept, s1.dropped)
    assert sum(s1.send_rows) >= sum(s0.send_rows)


@given(n=world_sizes(1, 4), seed=seeds, tokens=token_lists,
       cf=st.sampled_from([0.25, 0.75, 1.5]))
@settings(max_examples=10, deadline=None)
def test_padded_and_unpadded_modes_agree(n, seed, tokens, cf):
    run_world(_body_modes, n, seed, (tokens * 2)[:n], cf)


def _body_messages(world, aux):
    """The collectives one forward and one backward issue, from the flight recorder:
    the count exchange, dispatch and combine forward, the two all-to-alls and the router's
    all-reduce backward, and the auxiliary losses' one all-reduce."""
    n = world.world_size
    moe = MixtureOfExperts(D, H, E, 2, world, aux_loss_coeff=aux, seed=1)
    x = normal(1, 1, (3 + world.rank, D), world.rank).astype(np.float32)

    def moving(entries):  # allgather_object is the size agreement every all_to_all makes
        return [e["op"] for e in entries if e["op"] != "allgather_object"]

    def last_seq():  # the recorder is a ring: entries are told apart by number
        return max((e["seq"] for e in ad.flight_recorder(world)), default=0)

    def since(seq):
        return [e for e in ad.flight_recorder(world) if e["seq"] > seq]

    start = last_seq()
    y = moe.forward(x)
    middle = last_seq()
    moe.backward(y)
    if not ad.flight_recorder(world):  # a backend that records nothing
        return
    forward = moving([e for e in since(start) if e["seq"] <= middle])
    backward = moving(since(middle))
    exchange = {"all_to_all", "all_gather"}  # the mock world runs all_to_all as all_gather
    reduce_forward = ["all_reduce"] if aux and n > 1 else []
    assert [op for op in forward if op not in exchange] == reduce_forward, forward
    assert sum(op in exchange for op in forward) == 3, forward
    assert sum(op in exchange for op in backward) == 2, backward
    assert [op for op in backward if op not in exchange] == (["all_reduce"] if n > 1 else [])


@pytest.mark.parametrize("aux", [0.0, 0.01])
def test_collectives_per_step_are_counted(aux):
    run_world(_body_messages, current_size(3), aux)


# --- the outputs do not depend on the world size ----------------------------------------

def _body_split(world, seed, total, k):
    """This rank's share (array_split) of one global batch: y, dx and the dense grads."""
    n, r = world.world_size, world.rank
    x = normal(seed, 1, (total, D))
    gy = normal(seed, 2, (total, D))
    mine = np.array_split(np.arange(total), n)[r]
    moe = MixtureOfExperts(D, H, E, k, world, aux_loss_coeff=0.05, z_loss_coeff=0.01,
                           seed=seed, dtype=np.float64)
    y = moe.forward(x[mine])
    dx = moe.backward(gy[mine])
    return r, y, dx, moe.full_grads(), moe.aux_loss, moe.z_loss


@given(n=world_sizes(1, 4), seed=seeds, total=st.integers(0, 14), k=st.integers(1, 3))
@settings(max_examples=15, deadline=None)
def test_outputs_and_gradients_do_not_depend_on_the_world_size(n, seed, total, k):
    got = run_world(_body_split, n, seed, total, k)
    if LAUNCHED:  # this rank's share against one process's reference
        x, gy = normal(seed, 1, (total, D)), normal(seed, 2, (total, D))
        ref = reference(dense_weights(seed), [x], [gy], k, None, 0.05, 0.01)
        one = (0, ref["y"][0], ref["dx"][0], ref["grads"], ref["aux"], ref["z"])
    else:
        one = run_world(_body_split, 1, seed, total, k)[0]
    for r, y, dx, grads, aux, z in got:
        mine = np.array_split(np.arange(total), n)[r]
        np.testing.assert_allclose(y, one[1][mine], **TOL)
        np.testing.assert_allclose(dx, one[2][mine], **TOL)
        for name in one[3]:
            np.testing.assert_allclose(grads[name], one[3][name], **TOL, err_msg=name)
        assert aux == pytest.approx(one[4], rel=1e-12, abs=1e-15)
        assert z == pytest.approx(one[5], rel=1e-12, abs=1e-15)


# --- dispatch and combine with an identity expert ---------------------------------------

def _body_identity(world, seed, tokens, k, capacity, padded):
    """combine(dispatch(x)) returns every kept row exactly; the experts' rows are exactly
    the tokens routed to them, in (source rank, queue) order."""
    n, r = world.world_size, world.rank
    rng = [np.random.default_rng([seed, q]) for q in range(n)]
    choices = [np.array([g.permutation(E)[:k] for _ in range(tokens[q])], np.int64)
               .reshape(-1, k) for q, g in enumerate(rng)]
    xs = [normal(seed, 3, (tokens[q], D), q).astype(np.float32) for q in range(n)]
    plan = plan_dispatch(choices[r], E, world, capacity=capacity, padded=padded,
                         row_bytes=D * 4)
    received = dispatch(pack(xs[r], plan), plan, world)
    back = unpack(combine(received, plan, world), plan)
    for t in range(tokens[r]):
        for j in range(k):
            want = xs[r][t] if plan.keep[t, j] else np.zeros(D, np.float32)
            np.testing.assert_array_equal(back[t, j], want)
    # what each local expert received: the reference queue over every source rank
    local = E // n
    for i, index in enumerate(plan.expert_rows):
        expert = r * local + i
        want = []
        for q in range(n):
            queue = [(j, t) for j in range(k) for t in range(tokens[q])
                     if choices[q][t, j] == expert]
            kept = queue if capacity is None else queue[:capacity]
            want += [xs[q][t] for _, t in kept]
            if padded:
                want += [np.zeros(D, np.float32)] * (capacity - len(kept))
        got = received[np.asarray(index)]
        np.testing.assert_array_equal(got, np.array(want, np.float32).reshape(-1, D))


@given(n=world_sizes(1, 4), seed=seeds, tokens=token_lists, k=st.integers(1, 3),
       capacity=st.sampled_from([None, 0, 1, 2]), padded=st.booleans())
@settings(max_examples=20, deadline=None)
def test_identity_expert_dispatch_and_combine_return_the_input_exactly(n, seed, tokens, k,
                                                                       capacity, padded):
    padded = padded and capacity is not None
    run_world(_body_identity, n, seed, (tokens * 2)[:n], k, capacity, padded)


# --- expert x data parallel from a mesh -------------------------------------------------

def _body_mesh(world, seed, ep, tokens):
    n = world.world_size
    mesh = DeviceMesh(world, (n // ep, ep), ("dp", "ep"))
    blocks = [normal(seed, 1, (tokens[q], D), q) for q in range(n)]
    gys = [normal(seed, 2, (tokens[q], D), q) for q in range(n)]
    moe = MixtureOfExperts(D, H, E, 2, mesh["ep"], data_group=mesh["dp"],
                           aux_loss_coeff=0.02, z_loss_coeff=0.01, seed=seed,
                           dtype=np.float64)
    ref = reference(dense_weights(seed), blocks, gys, 2, None, 0.02, 0.01)
    r = world.rank
    np.testing.assert_allclose(moe.forward(blocks[r]), ref["y"][r], **TOL)
    assert moe.aux_loss == pytest.approx(ref["aux"], rel=1e-12)
    np.testing.assert_allclose(moe.backward(gys[r]), ref["dx"][r], **TOL)
    for name, value in moe.full_grads().items():
        np.testing.assert_allclose(value, ref["grads"][name], **TOL, err_msg=name)
    # replicas of an expert hold the same gradient; other experts' are not mixed in
    local = E // ep
    first = mesh["ep"].rank * local
    for i, p in enumerate(moe.expert_parameters()):
        name = ("w1", "b1", "w2", "b2")[i % 4]
        np.testing.assert_allclose(p.grad, ref["grads"][name][first + i // 4], **TOL)


@pytest.mark.parametrize("tokens", [[3, 5, 0, 4], [6, 1, 2, 2]])
def test_expert_by_data_parallel_from_a_mesh(tokens):
    n = current_size(4)
    for ep in [d for d in range(1, n + 1) if n % d == 0]:
        run_world(_body_mesh, n, 5, ep, (tokens * 2)[:n])


# --- any array framework ----------------------------------------------------------------

def _body_frameworks(world, seed):
    torch = pytest.importorskip("torch")
    r = world.rank
    x = normal(seed, 1, (4 + r, D), r).astype(np.float32)
    gy = normal(seed, 2, (4 + r, D), r).astype(np.float32)
    moe = MixtureOfExperts(D, H, E, 2, world, seed=seed)
    want_y, want_dx = moe.forward(x), moe.backward(gy)
    y = moe.forward(torch.from_numpy(x.copy()).requires_grad_(True))
    assert isinstance(y, torch.Tensor)
    dx = moe.backward(torch.from_numpy(gy.copy()))
    assert isinstance(dx, torch.Tensor)
    np.testing.assert_array_equal(y.numpy(), want_y)
    np.testing.assert_array_equal(dx.numpy(), want_dx)
    jax = pytest.importorskip("jax")
    y = moe.forward(jax.numpy.asarray(x))
    assert isinstance(y, jax.Array)
    np.testing.assert_array_equal(np.asarray(y), want_y)
    assert isinstance(moe.backward(jax.numpy.asarray(gy)), jax.Array)


def test_torch_and_jax_arrays_come_back_in_their_framework():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    run_world(_body_frameworks, current_size(2), 4)


# --- checkpoints: expert shards resharded -----------------------------------------------

def _train_steps(moe, opt, world, steps, first_step):
    n, r = world.world_size, world.rank
    for step in range(first_step, first_step + steps):
        x = normal(step, 1, (12, D))
        gy = normal(step, 2, (12, D)) / 12
        mine = np.array_split(np.arange(12), n)[r]
        moe.forward(x[mine])
        moe.backward(gy[mine])
        opt.step()
        opt.zero_grad()


def _body_save(world, root):
    moe = MixtureOfExperts(D, H, E, 2, world, aux_loss_coeff=0.01, seed=9, dtype=np.float64)
    opt = Adam(moe.parameters(), lr=0.01)
    _train_steps(moe, opt, world, 2, 0)
    save_sharded_checkpoint(root, moe, opt, step=2)
    _train_steps(moe, opt, world, 1, 2)
    return moe.full_weights()


def _body_load(world, root):
    moe = MixtureOfExperts(D, H, E, 2, world, aux_loss_coeff=0.01, seed=123, dtype=np.float64)
    opt = Adam(moe.parameters(), lr=0.01)
    load_sharded_checkpoint(root, moe, opt)
    _train_steps(moe, opt, world, 1, 2)
    return moe.full_weights()


def _body_save_mesh(world, root):
    """Experts on a (dp=2, ep=2) mesh: both copies of an expert claim it, one writes it."""
    mesh = DeviceMesh(world, (2, 2), ("dp", "ep"))
    moe = MixtureOfExperts(D, H, E, 2, mesh["ep"], data_group=mesh["dp"], aux_loss_coeff=0.01,
                           seed=9, dtype=np.float64)
    opt = Adam(moe.parameters(), lr=0.01)
    _train_steps(moe, opt, world, 2, 0)
    save_sharded_checkpoint(root, moe, opt, group=world, step=2)
    _train_steps(moe, opt, world, 1, 2)
    return moe.full_weights()


@mock_only
def test_expert_shards_saved_from_a_mesh_load_in_one_process():
    root = tempfile.mkdtemp()
    try:
        want = ad.spawn(_body_save_mesh, 4, root)
        assert all(np.array_equal(w["w1"], want[0]["w1"]) for w in want)
        got = ad.spawn(_body_load, 1, root)[0]
        for name in want[0]:
            np.testing.assert_allclose(got[name], want[0][name], rtol=1e-12, atol=1e-14,
                                       err_msg=name)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@mock_only
def test_expert_shards_reshard_from_two_ranks_to_four_and_one():
    root = tempfile.mkdtemp()
    try:
        want = ad.spawn(_body_save, 2, root)[0]
        for n in (4, 1, 3):
            got = ad.spawn(_body_load, n, root)
            for rank_weights in got:
                for name in want:
                    np.testing.assert_allclose(rank_weights[name], want[name], rtol=1e-12,
                                               atol=1e-14, err_msg=f"{name} at {n} ranks")
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- bad input ---------------------------------------------------------------------------

def _body_bad(world):
    n = world.world_size
    if n > 1:
        with pytest.raises(ValueError, match=rf"num_experts={n + 1} does not split over the {n} "
                           rf"ranks of the group .* use a multiple of {n}"):
            MixtureOfExperts(D, H, n + 1, 1, world)
    with pytest.raises(ValueError, match="top_k=13 is more than num_experts=12"):
        MixtureOfExperts(D, H, E, 13, world)
    with pytest.raises(ValueError, match="padded=True needs a capacity_factor"):
        MixtureOfExperts(D, H, E, 2, world, padded=True)
    with pytest.raises(ValueError, match="capacity_factor=-1"):
        MixtureOfExperts(D, H, E, 2, world, capacity_factor=-1)
    with pytest.raises(TypeError, match="top_k=1.5 must be a positive int"):
        MixtureOfExperts(D, H, E, 1.5, world)
    with pytest.raises(UnsupportedDTypeError, match="dtype=int32 is not a floating type"):
        MixtureOfExperts(D, H, E, 2, world, dtype=np.int32)
    with pytest.raises(ValueError, match="activation='tanh' is not supported"):
        MixtureOfExperts(D, H, E, 2, world, activation="tanh")
    moe = MixtureOfExperts(D, H, E, 2, world)
    with pytest.raises(RuntimeError, match="backward: called before forward"):
        moe.backward(np.zeros((1, D)))
    with pytest.raises(InvalidBufferError, match=r"forward: x of shape \(3, 4\), expected "
                       r"\(tokens, d_model=5\); flatten the batch"):
        moe.forward(np.zeros((3, 4)))
    with pytest.raises(InvalidBufferError, match=r"x of shape \(2, 3, 5\)"):
        moe.forward(np.zeros((2, 3, 5)))
    with pytest.raises(UnsupportedDTypeError, match="x has dtype int64, not floating point"):
        moe.forward(np.zeros((3, D), dtype=np.int64))
    moe.forward(np.ones((3, D)))
    with pytest.raises(InvalidBufferError, match="grad_y has 2 rows but forward had 3 tokens"):
        moe.backward(np.ones((2, D)))
    with pytest.raises(RuntimeError, match="full_grads: router.weight has no gradient"):
        moe.full_grads()
    # ranks that disagree are told so, on every rank, instead of hanging
    if n > 1:
        with pytest.raises(CollectiveMismatchError, match=r"built different layers: seed "
                           r"differs \(rank 0: 0, rank 1: 1"):
            MixtureOfExperts(D, H, E, 2, world, seed=world.rank)


def test_bad_input_is_refused_with_our_error_text():
    run_world(_body_bad, current_size(3))
