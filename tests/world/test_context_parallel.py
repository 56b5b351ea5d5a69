"""Context-parallel attention against a one-process float64 reference, on every rank.

Every rank draws the whole sequence's q, k, v and dO from a seed, computes full
attention and its analytic backward in float64 itself, and checks its own tokens'
outputs and gradients (each method x layout x causal, uneven and empty shards,
grouped-query heads, packed documents, padding). The reference's backward is checked
against finite differences first. The ring's messages and the collectives' calls are
counted per rank, and bad inputs must raise our error on every rank.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import LAUNCHED, current_size, mock_only, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import comm
from axondist import context_parallel as cp
from axondist._array import bfloat16
from axondist.context_parallel.ring_link import GRAD_TAG, KV_TAG
from axondist.errors import CollectiveMismatchError, InvalidBufferError, UnsupportedDTypeError
from axondist.mesh import DeviceMesh

TOL = dict(rtol=1e-10, atol=1e-10)
METHODS = list(cp.METHODS)
LAYOUTS = list(cp.LAYOUTS)
SIZES = [current_size(0)] if LAUNCHED else [1, 2, 3, 4]


# --- the one-process reference ------------------------------------------------------------

def allowed_pairs(n: int, causal: bool, bounds: list[int] | None) -> np.ndarray:
    pos = np.arange(n)
    allowed = np.ones((n, n), dtype=bool)
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if bounds is not None:
        doc = np.searchsorted(bounds, pos, side="right") - 1
        doc[pos >= bounds[-1]] = -1
        allowed &= (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    return allowed


def reference(q, k, v, go, causal=True, scale=None, bounds=None):
    """Full attention's out, lse and (dq, dk, dv) in float64, grouped-query heads repeated."""
    groups = q.shape[-3] // k.shape[-3] if q.shape[:-2] != k.shape[:-2] else 1
    kk, vv = np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.where(allowed_pairs(q.shape[-2], causal, bounds), q @ np.swapaxes(kk, -1, -2) * scale,
                 -np.inf)
    top = s.max(axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0)
    p = np.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)
    p /= np.where(total > 0, total, 1)
    lse = np.where(total[..., 0] > 0, np.log(np.where(total > 0, total, 1))[..., 0] + top[..., 0],
                   -np.inf)
    out = p @ vv
    dp = go @ np.swapaxes(vv, -1, -2)
    ds = p * (dp - (go * out).sum(axis=-1, keepdims=True))
    dq = ds @ kk * scale
    dk = (np.swapaxes(ds, -1, -2) @ q * scale)
    dv = np.swapaxes(p, -1, -2) @ go

    def fold(a):  # the query heads' shares of each key head, summed
        return a.reshape(*k.shape[:-2], groups, *a.shape[-2:]).sum(axis=-3)

    return out, lse, (dq, fold(dk), fold(dv))


def problem(seed: int, n: int, heads: int = 2, kv_heads: int | None = None, batch: int = 2,
            d: int = 4, dv: int = 3):
    rng = np.random.default_rng(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    q = rng.standard_normal((batch, heads, n, d))
    k = rng.standard_normal((batch, kv_heads, n, d))
    v = rng.standard_normal((batch, kv_heads, n, dv))
    go = rng.standard_normal((batch, heads, n, dv))
    return q, k, v, go


def test_the_reference_backward_matches_finite_differences():
    q, k, v, go = problem(3, 5, heads=4, kv_heads=2)
    bounds = [0, 2, 4]
    _, _, grads = reference(q, k, v, go, causal=True, bounds=bounds)

    def loss(q_, k_, v_):
        return float((reference(q_, k_, v_, go, True, None, bounds)[0] * go).sum())

    for x, g in zip((q, k, v), grads):
        for idx in itertools.islice(np.ndindex(x.shape), 0, None, 7):
            step = np.zeros_like(x)
            step[idx] = 1e-6
            args = [q, k, v]
            i = [id(a) for a in args].index(id(x))
            plus, minus = list(args), list(args)
            plus[i], minus[i] = x + step, x - step
            numeric = (loss(*plus) - loss(*minus)) / 2e-6
            assert abs(numeric - g[idx]) < 1e-6, (idx, numeric, g[idx])


# --- against the reference on every rank ----------------------------------------------------

def check_rank(world: ad.ProcessGroup, seed: int, n: int, method: str, layout: str, causal: bool,
               heads: int = 2, kv_heads: int | None = None, bounds: list[int] | None = None,
               scale: float | None = None) -> bool:
    q, k, v, go = problem(seed, n, heads, kv_heads)
    out, lse, grads = reference(q, k, v, go, causal, scale, bounds)
    w, r = world.world_size, world.rank

    def mine(a):
        return cp.shard(a, w, r, layout)

    opts = dict(causal=causal, layout=layout, method=method, scale=scale, cu_seqlens=bounds)
    got_out, got_lse = cp.attention(mine(q), mine(k), mine(v), world, **opts)
    np.testing.assert_allclose(got_out, mine(out), **TOL)
    np.testing.assert_allclose(got_lse, cp.shard(lse, w, r, layout, axis=-1), **TOL)
    got = cp.attention_backward(mine(q), mine(k), mine(v), got_out, got_lse, mine(go), world,
                                **opts)
    for name, a, b in zip("qkv", got, grads):
        np.testing.assert_allclose(a, mine(b), err_msg=f"d{name}", **TOL)
    return True


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_and_layout_matches_the_reference(method, layout, causal):
    for w in SIZES:
        for n in (8 * w, 13):  # even shards, and uneven ones
            assert all(run_world(check_rank, w, 1, n, method, layout, causal, w))


@pytest.mark.parametrize("method", METHODS)
def test_short_sequences_leave_ranks_empty(method):
    for w in SIZES:
        for n in (0, 1, w + 1):
            assert all(run_world(check_rank, w, 2, n, method, "zigzag", True, w))


@pytest.mark.parametrize("method", METHODS)
def test_grouped_query_heads_and_packed_documents(method):
    w = SIZES[-1]
    heads, kv_heads = 4 * w, 2 * w  # divisible for Ulysses
    assert all(run_world(check_rank, w, 4, 11, method, "zigzag", True, heads, kv_heads,
                         [0, 3, 3, 7, 11]))
    assert all(run_world(check_rank, w, 5, 9, method, "contiguous", False, heads, kv_heads,
                         [0, 4, 9], 0.3))


@settings(deadline=None)
@given(w=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1), n=st.integers(0, 17),
       method=st.sampled_from(METHODS), layout=st.sampled_from(LAYOUTS), causal=st.booleans(),
       group_size=st.sampled_from([1, 2]), cuts=st.lists(st.integers(0, 17), max_size=3))
def test_any_configuration_matches_the_reference(w, seed, n, method, layout, causal,
                                                 group_size, cuts):
    kv_heads = w
    bounds = None if not cuts else [0, *sorted(min(c, n) for c in cuts)]
    assert all(run_world(check_rank, w, seed, n, method, layout, causal, kv_heads * group_size,
                         kv_heads, bounds))


def padded_rank(world: ad.ProcessGroup, method: str, layout: str, causal: bool) -> bool:
    w, r = world.world_size, world.rank
    q, k, v, go = problem(6, 7, heads=w)
    padded = [cp.pad(a, w, layout) for a in (q, k, v, go)]
    length = padded[0][1]
    assert length == 7 and padded[0][0].shape[-2] == cp.padded_length(7, w, layout)
    qp, kp, vp, gp = (cp.shard(a, w, r, layout) for a, _ in padded)
    opts = dict(causal=causal, layout=layout, method=method, cu_seqlens=[0, length])
    out, lse = cp.attention(qp, kp, vp, world, **opts)
    grads = cp.attention_backward(qp, kp, vp, out, lse, gp, world, **opts)
    pad_rows = cp.layout_indices(padded[0][0].shape[-2], w, r, layout) >= length
    for a in (out, *grads):
        assert np.all(a[..., pad_rows, :] == 0)  # exact zeros
    assert np.all(np.isneginf(lse[..., pad_rows]))
    full_out, _, full_grads = reference(q, k, v, go, causal)
    real = cp.layout_indices(padded[0][0].shape[-2], w, r, layout)[~pad_rows]
    np.testing.assert_allclose(out[..., ~pad_rows, :], full_out[..., real, :], **TOL)
    for a, b in zip(grads, full_grads):
        np.testing.assert_allclose(a[..., ~pad_rows, :], b[..., real, :], **TOL)
    return True


@pytest.mark.parametrize("method", METHODS)
def test_padded_tokens_give_exact_zeros(method):
    for w in SIZES:
        for layout, causal in itertools.product(LAYOUTS, (True, False)):
            assert all(run_world(padded_rank, w, method, layout, causal))


# --- precision and frameworks ------------------------------------------------------------------

def low_precision_rank(world: ad.ProcessGroup, dtype: str) -> bool:
    w, r = world.world_size, world.rank
    q, k, v, go = problem(8, 12, heads=w)
    out, lse, grads = reference(q, k, v, go)
    low = bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    mine = [cp.shard(a, w, r).astype(low) for a in (q, k, v, go)]
    got_out, got_lse = cp.attention(*mine[:3], world)
    assert got_out.dtype == low and got_lse.dtype == np.float32
    got = cp.attention_backward(*mine[:3], got_out, got_lse, mine[3], world)
    tol = {"float16": dict(rtol=2e-2, atol=2e-2), "bfloat16": dict(rtol=6e-2, atol=6e-2),
           "float32": dict(rtol=1e-4, atol=1e-4)}[dtype]
    np.testing.assert_allclose(got_out.astype(np.float64), cp.shard(out, w, r), **tol)
    for a, b in zip(got, grads):
        assert a.dtype == low
        np.testing.assert_allclose(a.astype(np.float64), cp.shard(b, w, r), **tol)
    return True


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_lower_precision_merges_in_float32(dtype):
    assert all(run_world(low_precision_rank, SIZES[-1], dtype))


def framework_rank(world: ad.ProcessGroup, framework: str) -> bool:
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    w, r = world.world_size, world.rank
    q, k, v, go = (cp.shard(a, w, r).astype(np.float32) for a in problem(9, 10))
    convert = torch.from_numpy if framework == "torch" else jnp.asarray
    out, lse = cp.attention(q, k, v, world, method="ring")
    f_out, f_lse = cp.attention(convert(q), convert(k), convert(v), world, method="ring")
    grads = cp.attention_backward(q, k, v, out, lse, go, world)
    f_grads = cp.attention_backward(convert(q), convert(k), convert(v), f_out, f_lse,
                                    convert(go), world)
    for a, b in zip((out, lse, *grads), (f_out, f_lse, *f_grads)):
        assert type(b).__module__.split(".")[0] in (framework, "jaxlib"), type(b)
        np.testing.assert_array_equal(np.asarray(b), a)
    return True


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_torch_and_jax_arrays_come_back_in_their_framework(framework):
    pytest.importorskip(framework)
    assert all(run_world(framework_rank, SIZES[-1], framework))


# --- what travels -----------------------------------------------------------------------------

def counted_ring(world: ad.ProcessGroup) -> tuple[int, list, list]:
    """This rank's sends (tag, bytes) in the forward and in the backward pass."""
    backend = world.backend_for("test")
    sent: list[tuple[int, int]] = []
    lock = threading.Lock()
    original = backend.send

    def send(buf, dst, tag=0):
        with lock:
            sent.append((tag, buf.nbytes))
        return original(buf, dst, tag)

    backend.send = send
    try:
        q, k, v, go = (cp.shard(a, world.world_size, world.rank) for a in problem(10, 13))
        out, lse = cp.attention(q, k, v, world)
        forward = list(sent)
        sent.clear()
        cp.attention_backward(q, k, v, out, lse, go, world)
        return world.rank, forward, sorted(sent)
    finally:
        del backend.send


def test_the_ring_sends_w_minus_1_blocks_forward_and_the_accumulators_home():
    w = current_size(SIZES[-1])
    counts = cp.token_counts(13, w)
    for rank, forward, backward in run_world(counted_ring, w):
        # step s passes on the block of rank r - s: 2 batches x 2 kv heads x (4 + 3) features
        block_bytes = [2 * 2 * counts[(rank - s) % w] * 7 * 8 for s in range(w)]
        kv = [(KV_TAG, block_bytes[s]) for s in range(w - 1)]
        assert forward == kv
        accumulators = [(GRAD_TAG, b) for b in block_bytes] if w > 1 else []
        assert backward == sorted(kv + accumulators)


def serial_queue_rank(world: ad.ProcessGroup) -> bool:
    backend = world.backend_for("test")
    backend.serial_p2p = True  # as NCCL's one stream: no worker threads, sends in order
    try:
        return check_rank(world, 15, 13, "ring", "zigzag", True, 2, 1)
    finally:
        del backend.serial_p2p


@mock_only
def test_a_backend_with_one_queue_passes_the_ring_in_order():
    for w in SIZES:
        assert all(run_world(serial_queue_rank, w))


def test_all_gather_and_ulysses_collectives_and_their_bytes(monkeypatch):
    calls: list[tuple[int, str, int]] = []
    lock = threading.Lock()
    for name in ("all_gather", "reduce_scatter_sum", "all_to_all"):
        original = getattr(comm, name)

        def counting(x, group=None, *a, _name=name, _original=original, **kw):
            with lock:
                calls.append((comm.rank(group), _name, x.nbytes))
            return _original(x, group, *a, **kw)

        monkeypatch.setattr(comm, name, counting)
    w = SIZES[-1]

    def body(world, method):
        q, k, v, go = (cp.shard(a, world.world_size, world.rank) for a in problem(11, 12, w, w))
        out, lse = cp.attention(q, k, v, world, method=method)
        cp.attention_backward(q, k, v, out, lse, go, world, method=method)
        return True

    size = current_size(w)
    counts = cp.token_counts(12, size)
    row = w * (4 + 3) * 2 * 8  # a token's keys and values: w heads x (4 + 3) x 2 batches, float64
    qkv_row = w * (4 + 4 + 3) * 2 * 8
    grads_row = w * (4 + 4 + 3) * 2 * 8
    back_row = w * (4 + 4 + 3 + 3 + 1 + 3) * 2 * 8  # q, k, v, out, lse, dO
    for method in ("all_gather", "ulysses"):
        calls.clear()
        run_world(body, w, method)
        for r in range(size) if not LAUNCHED else [ad.rank()]:
            mine = [c[1:] for c in calls if c[0] == r]
            t = counts[r]
            if method == "all_gather":  # K/V gathered twice, dK/dV padded to the longest
                expected = [("all_gather", t * row), ("all_gather", t * row),
                            ("reduce_scatter_sum", size * max(counts) * row)]
            else:  # out and lse back; then q, k, v, out, lse, dO over and dq, dk, dv back
                expected = [("all_to_all", t * qkv_row), ("all_to_all", t * w * 4 * 2 * 8),
                            ("all_to_all", t * back_row), ("all_to_all", t * grads_row)]
            assert mine == expected, (method, r, mine)


def mesh_rank(world: ad.ProcessGroup) -> bool:
    """Context x data parallel: each data-parallel replica attends over its own sequence."""
    mesh = DeviceMesh(world, (world.world_size // 2, 2), ("dp", "cp"))
    cp_group, replica = mesh.group("cp"), mesh.group("dp").rank
    q, k, v, go = problem(20 + replica, 10)
    out, lse, grads = reference(q, k, v, go)
    mine = [cp.shard(a, 2, cp_group.rank) for a in (q, k, v, go)]
    got_out, got_lse = cp.attention(*mine[:3], cp_group)
    got = cp.attention_backward(*mine[:3], got_out, got_lse, mine[3], cp_group)
    np.testing.assert_allclose(got_out, cp.shard(out, 2, cp_group.rank), **TOL)
    for a, b in zip(got, grads):
        np.testing.assert_allclose(a, cp.shard(b, 2, cp_group.rank), **TOL)
    return True


def test_context_by_data_parallel_on_a_mesh():
    size = current_size(4)
    if size % 2:
        pytest.skip("a (dp, cp=2) mesh needs an even number of ranks")
    assert all(run_world(mesh_rank, size))


# --- bad input: our error on every rank -----------------------------------------------------

def raises_on_every_rank(world: ad.ProcessGroup, case: str) -> str:
    w, r = world.world_size, world.rank
    q, k, v, go = (cp.shard(a, w, r) for a in problem(12, 8, heads=2 * w + 1, kv_heads=1))
    kwargs: dict[str, Any] = {}
    error: type[Exception] = CollectiveMismatchError
    if case == "layout differs":
        kwargs["layout"] = "zigzag" if r == 0 else "contiguous"
        if w == 1:
            return "skip"
    elif case == "heads differ":
        if w == 1:
            return "skip"
        q = q[:, : 1 + r]
    elif case == "one rank's bad shape":
        error = InvalidBufferError
        k = k[..., :2] if r == w - 1 else k
    elif case == "ulysses heads":
        error = InvalidBufferError
        kwargs["method"] = "ulysses"
        if w == 1:
            return "skip"
    elif case == "counts off the layout":
        if w == 1:
            return "skip"
        q, k, v = (a[..., :2, :] for a in (q, k, v))
        q, k, v = (np.concatenate([a, a], axis=-2) if r == w - 1 else a for a in (q, k, v))
    elif case == "integer dtype":
        error = UnsupportedDTypeError
        q, k, v = (a.astype(np.int64) for a in (q, k, v))
    elif case == "unknown method":
        error = ValueError
        kwargs["method"] = "tree"
    elif case == "cu_seqlens past the end":
        error = ValueError
        kwargs["cu_seqlens"] = [0, 3, 9]
    elif case == "cu_seqlens decreasing":
        error = ValueError
        kwargs["cu_seqlens"] = [0, 5, 3]
    elif case == "bad scale":
        error = ValueError
        kwargs["scale"] = -1.0
    with pytest.raises(error) as info:
        cp.attention(q, k, v, world, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("case", ["layout differs", "heads differ", "one rank's bad shape",
                                  "ulysses heads", "counts off the layout", "integer dtype",
                                  "unknown method", "cu_seqlens past the end",
                                  "cu_seqlens decreasing", "bad scale"])
def test_bad_input_raises_our_error_on_every_rank(case):
    messages = [m for m in run_world(raises_on_every_rank, SIZES[-1], case) if m != "skip"]
    words = {"layout differs": "layout", "heads differ": "q leading shape",
             "one rank's bad shape": "on rank", "ulysses heads": "does not divide",
             "counts off the layout": "cp.shard", "integer dtype": "floating",
             "unknown method": "ring, all_gather, ulysses",
             "cu_seqlens past the end": "past the sequence's 8 tokens",
             "cu_seqlens decreasing": "must start at 0 and not decrease",
             "bad scale": "scale=-1.0 must be a positive number"}
    for message in messages:
        assert "attention" in message
        expected = words[case].replace("cp.shard", "context_parallel.shard")
        assert expected in message, message


def backward_checks_rank(world: ad.ProcessGroup) -> str:
    q, k, v, go = (cp.shard(a, world.world_size, world.rank) for a in problem(13, 8))
    out, lse = cp.attention(q, k, v, world)
    with pytest.raises(InvalidBufferError, match="lse has shape") as info:
        cp.attention_backward(q, k, v, out, lse[..., :1], go, world)
    return str(info.value)


def test_backward_names_a_saved_array_of_the_wrong_shape():
    assert all("pass what attention returned" in m
               for m in run_world(backward_checks_rank, SIZES[-1]))


@mock_only
def test_mixed_frameworks_are_refused():
    torch = pytest.importorskip("torch")
    q = np.zeros((1, 4, 2))
    with pytest.raises(InvalidBufferError, match="mix array frameworks"):
        ad.spawn(lambda world: cp.attention(q, torch.zeros(1, 4, 2), q, world), 1)


def stand_in_rank(world: ad.ProcessGroup, method: str, causal: bool) -> bool:
    import cupy  # the stand-in's

    w, r = world.world_size, world.rank
    q, k, v, go = problem(14, 11, 2 * w, w)
    out, lse, grads = reference(q, k, v, go, causal)

    def mine(a):
        return cupy.asarray(cp.shard(a, w, r))

    opts = dict(method=method, causal=causal)
    got_out, got_lse = cp.attention(mine(q), mine(k), mine(v), world, **opts)
    got = cp.attention_backward(mine(q), mine(k), mine(v), got_out, got_lse, mine(go), world,
                                **opts)
    assert all(isinstance(a, cupy.ndarray) for a in (got_out, got_lse, *got))
    np.testing.assert_allclose(got_out.get(), cp.shard(out, w, r), **TOL)
    for a, b in zip(got, grads):
        np.testing.assert_allclose(a.get(), cp.shard(b, w, r), **TOL)
    return True


@mock_only
@pytest.mark.parametrize("method", METHODS)
def test_cupy_arrays_over_nccl_on_the_cpu_stand_in(method, monkeypatch):
    """The NCCL backend (its sends and receives paired in grouped calls) on
    tests/support/nccl_fake.py's CPU stand-in for CuPy and NCCL."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "support"))
    import nccl_fake

    nccl_fake.install(monkeypatch, device_count=4)
    from axondist.launching.worlds import spawn_on_devices

    for w, causal in itertools.product((2, 3), (True, False)):
        assert all(spawn_on_devices(stand_in_rank, list(range(w)), method, causal, timeout=30))
