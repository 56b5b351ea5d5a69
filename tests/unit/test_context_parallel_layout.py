"""Context-parallel layouts and the attention kernel's pieces, without communication.

Every layout must hand out each position exactly once, sorted per rank, with counts the
padding rounds to equal; zigzag must give every rank the same causal work. Merging blocks
by log-sum-exp, in any split and order, must equal one softmax over all keys.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist import context_parallel as cp
from axondist.context_parallel.kernel import MaskRule, block_forward, block_mask, merge
from axondist.errors import InvalidBufferError, RankError

lengths = st.integers(0, 200)
sizes = st.integers(1, 9)
layouts = st.sampled_from(sorted(cp.LAYOUTS))


def test_zigzag_examples():
    assert cp.zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp.zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp.zigzag_indices(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert cp.contiguous_indices(8, 2, 1).tolist() == [4, 5, 6, 7]


@given(n=lengths, w=sizes, layout=layouts)
def test_every_position_is_held_once_and_sorted(n, w, layout):
    held = [cp.layout_indices(n, w, r, layout) for r in range(w)]
    assert sorted(np.concatenate(held).tolist()) == list(range(n))
    for idx in held:
        assert np.all(np.diff(idx) > 0)
    assert cp.token_counts(n, w, layout) == [len(i) for i in held]
    spread = max(map(len, held)) - min(map(len, held))
    assert spread <= (2 if layout == "zigzag" else 1)


@given(chunk=st.integers(0, 20), w=sizes)
def test_zigzag_gives_every_rank_the_same_causal_work(chunk, w):
    n = 2 * w * chunk
    work = [int((cp.zigzag_indices(n, w, r) + 1).sum()) for r in range(w)]  # keys each sees
    assert len(set(work)) == 1


@given(n=lengths, w=sizes, layout=layouts, seed=st.integers(0, 2**32 - 1))
def test_shard_and_unshard_are_inverse(n, w, layout, seed):
    x = np.random.default_rng(seed).standard_normal((2, n, 3))
    shards = [cp.shard(x, w, r, layout) for r in range(w)]
    assert [s.shape[-2] for s in shards] == cp.token_counts(n, w, layout)
    np.testing.assert_array_equal(cp.unshard(shards, layout), x)
    lse = x[..., 0]
    np.testing.assert_array_equal(
        cp.unshard([cp.shard(lse, w, r, layout, axis=-1) for r in range(w)], layout, axis=-1),
        lse)


@given(n=lengths, w=sizes, layout=layouts)
def test_padding_rounds_up_to_even_shards(n, w, layout):
    x = np.ones((n, 2))
    padded, length = cp.pad(x, w, layout, axis=0)
    m = padded.shape[0]
    assert length == n and m == cp.padded_length(n, w, layout) and n <= m
    step = cp.LAYOUTS[layout].multiple * w
    assert m % step == 0 and m - n < step
    assert len(set(cp.token_counts(m, w, layout))) == 1
    assert np.all(padded[n:] == 0) and np.all(padded[:n] == 1)


def test_bad_layout_arguments_name_what_to_pass():
    with pytest.raises(RankError, match="rank=2 is outside the group of 2"):
        cp.zigzag_indices(8, 2, 2)
    with pytest.raises(ValueError, match="seq_len=-1"):
        cp.contiguous_indices(-1, 2, 0)
    with pytest.raises(ValueError, match="world_size=0"):
        cp.zigzag_indices(8, 0, 0)
    with pytest.raises(ValueError, match="layout='spiral' is not one of zigzag, contiguous"):
        cp.token_counts(8, 2, "spiral")
    with pytest.raises(InvalidBufferError, match="gives \\[4, 4\\]"):
        cp.unshard([np.zeros((1, 5, 2)), np.zeros((1, 3, 2))])
    with pytest.raises(InvalidBufferError, match="no axis 3"):
        cp.shard(np.zeros((4, 2)), 2, 0, axis=3)


@given(n=st.integers(1, 12), cuts=st.lists(st.integers(0, 12), max_size=4), causal=st.booleans(),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_merged_blocks_equal_one_softmax(n, cuts, causal, seed, data):
    """Keys split into blocks, in any order: the merged (out, lse) is the whole softmax's."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 1, n, 3)) for _ in range(3))
    pos = np.arange(n)
    rule = MaskRule(causal)
    whole = block_mask(rule, pos, pos, np)
    expected = np.zeros((2, 1, n, 3)), np.full((2, 1, n), -np.inf)
    o, lse = block_forward(q[..., whole.rows, :], k[..., whole.cols, :], v[..., whole.cols, :],
                           whole, 0.7)
    expected[0][..., whole.rows, :], expected[1][..., whole.rows] = o, lse
    order = data.draw(st.permutations(np.split(pos, sorted({min(c, n) for c in cuts}))))
    out, lse = np.zeros((2, 1, n, 3)), np.full((2, 1, n), -np.inf)
    for keys in order:
        mask = block_mask(rule, pos, keys, np)
        if mask.empty:
            continue
        kb, vb = k[..., keys, :][..., mask.cols, :], v[..., keys, :][..., mask.cols, :]
        bo, bl = block_forward(q[..., mask.rows, :], kb, vb, mask, 0.7)
        merge(out[..., mask.rows, :], lse[..., mask.rows], bo, bl)
    np.testing.assert_allclose(out, expected[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, expected[1], rtol=1e-12, atol=1e-12)


def test_torch_and_jax_sequences_are_sharded_in_their_framework():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    x = np.arange(24.0).reshape(2, 6, 2)
    for convert, kind in ((torch.from_numpy, torch.Tensor), (jnp.asarray, type(jnp.ones(1)))):
        shards = [cp.shard(convert(x), 3, r) for r in range(3)]
        assert all(isinstance(s, kind) for s in shards)
        whole = cp.unshard(shards)
        padded, length = cp.pad(convert(x), 4)
        assert isinstance(whole, kind) and isinstance(padded, kind) and length == 6
        np.testing.assert_array_equal(np.asarray(whole), x)


@given(chunk=st.integers(1, 6), w=st.integers(2, 6))
def test_zigzag_ring_steps_cost_every_rank_the_same(chunk, w):
    """Under a causal mask the ring's trimmed blocks: with zigzag, at every step after the
    first every rank computes half a block; contiguous leaves some ranks idle."""
    n = 2 * w * chunk
    t = 2 * chunk

    def areas(layout, step):
        found = []
        for r in range(w):
            mine, theirs = (cp.layout_indices(n, w, x % w, layout) for x in (r, r - step))
            mask = block_mask(MaskRule(True), mine, theirs, np)
            found.append(0 if mask.empty else (mask.rows.stop - mask.rows.start)
                         * (mask.cols.stop - mask.cols.start))
        return found

    for step in range(1, w):
        assert areas("zigzag", step) == [t * t // 2] * w
        assert 0 in areas("contiguous", step)
