"""Adam's block-by-block update of large NumPy parameters against its whole-array update.

A parameter larger than ``optim.BLOCK`` is updated one cache-sized block at a
time; every element's arithmetic is the same, so the result (parameters and
state) must equal the whole-array update bit for bit. The block size is made
tiny here, so small arrays cross many block boundaries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist import Parameter, optim
from axondist.optim import Adam, AdamW

SMALL_BLOCK = 8
CASES = [
    (Adam, {"lr": 0.01}),
    (Adam, {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    (AdamW, {"lr": 0.01}),
    (AdamW, {"lr": 0.03, "weight_decay": 0.2}),
]


@contextlib.contextmanager
def block(size: int) -> Iterator[None]:
    saved = optim.BLOCK
    optim.BLOCK = size
    try:
        yield
    finally:
        optim.BLOCK = saved


def train(opt_cls: type, kw: dict, init: list[np.ndarray], grads: list[list[np.ndarray]],
          block_size: int) -> tuple[list[np.ndarray], dict]:
    params = [Parameter(x.copy()) for x in init]
    with block(block_size):
        opt = opt_cls(params, **kw)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g
            opt.step()
    return [p.data for p in params], opt.state


@pytest.mark.parametrize("opt_cls,kw", CASES)
@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(1, 5 * SMALL_BLOCK + 3), min_size=1, max_size=3),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**31),
       steps=st.integers(1, 4), two_d=st.booleans())
def test_blocked_equals_whole_array_bit_for_bit(opt_cls, kw, sizes, dtype, seed, steps, two_d):
    rng = np.random.default_rng(seed)
    shapes = [(n, 2) if two_d else (n,) for n in sizes]
    init = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(steps)]
    kept = [[g.copy() for g in gs] for gs in grads]
    blocked, blocked_state = train(opt_cls, kw, init, grads, SMALL_BLOCK)
    whole, whole_state = train(opt_cls, kw, init, grads, 10**9)
    for a, b in zip(blocked, whole):
        np.testing.assert_array_equal(a, b)
    for i, state in whole_state.items():
        for name in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(blocked_state[i][name], state[name])
    for gs, ks in zip(grads, kept):  # the user's gradients are never written
        for g, k in zip(gs, ks):
            np.testing.assert_array_equal(g, k)


@pytest.mark.parametrize("opt_cls,kw", CASES)
def test_non_contiguous_parameter_takes_the_whole_array_path(opt_cls, kw):
    rng = np.random.default_rng(7)
    init = rng.standard_normal((6, 5)).astype(np.float32)
    grads = [rng.standard_normal((6, 5)).astype(np.float32) for _ in range(3)]
    fortran = Parameter(np.asfortranarray(init))
    with block(SMALL_BLOCK):
        opt = opt_cls([fortran], **kw)
        for g in grads:
            fortran.grad = np.asfortranarray(g)
            opt.step()
    expected, _ = train(opt_cls, kw, [init], [[g] for g in grads], 10**9)
    np.testing.assert_array_equal(fortran.data, expected[0])


@pytest.mark.parametrize("opt_cls,kw", CASES)
def test_scratch_is_one_block_and_reused_across_steps(opt_cls, kw):
    rng = np.random.default_rng(3)
    params = [Parameter(rng.standard_normal(n).astype(np.float32)) for n in (50, 90)]
    with block(SMALL_BLOCK):
        opt = opt_cls(params, **kw)
        seen = []
        for _ in range(3):
            for p in params:
                p.grad = rng.standard_normal(p.shape).astype(np.float32)
            opt.step()
            seen.append({k: id(v) for k, v in opt._scratch_buffers.items()})
    assert seen[0] == seen[1] == seen[2]
    for buf in opt._scratch_buffers.values():
        assert buf.size <= 2 * SMALL_BLOCK  # a block (and the L2-decayed gradient's block)
