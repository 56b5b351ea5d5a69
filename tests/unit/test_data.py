"""DistributedSampler: coverage, equal lengths, padding, dropping, shuffling, defaults."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist.data import DistributedSampler

lengths = st.integers(0, 200)
replicas = st.integers(1, 9)
seeds = st.integers(0, 2**32 - 1)
epochs = st.integers(0, 1000)


def all_ranks(length: int, n: int, **kw) -> list[np.ndarray]:
    epoch = kw.pop("epoch", 0)
    out = []
    for r in range(n):
        s = DistributedSampler(length, num_replicas=n, rank=r, **kw)
        s.set_epoch(epoch)
        out.append(s.indices())
    return out


@given(lengths, replicas, seeds, epochs, st.booleans())
def test_padded_epoch_covers_every_index_and_repeats_only_the_padding(length, n, seed, epoch,
                                                                       shuffle):
    parts = all_ranks(length, n, seed=seed, epoch=epoch, shuffle=shuffle)
    per_rank = -(-length // n)
    assert [len(p) for p in parts] == [per_rank] * n
    counts = Counter(np.concatenate(parts).tolist())
    assert set(counts) == set(range(length))
    padding = per_rank * n - length
    assert sum(c - 1 for c in counts.values()) == padding
    if length >= n:  # padding < n <= length: no index is seen three times
        assert max(counts.values(), default=1) <= 2


@given(lengths, replicas, seeds, epochs, st.booleans())
def test_drop_last_sees_each_index_at_most_once(length, n, seed, epoch, shuffle):
    parts = all_ranks(length, n, seed=seed, epoch=epoch, shuffle=shuffle, drop_last=True)
    assert [len(p) for p in parts] == [length // n] * n
    flat = np.concatenate(parts).tolist()
    assert len(set(flat)) == len(flat) == (length // n) * n
    assert all(0 <= i < length for i in flat)


@given(st.integers(1, 200), replicas, seeds, epochs)
def test_padding_repeats_from_the_start_of_the_shuffled_order(length, n, seed, epoch):
    s = DistributedSampler(length, num_replicas=n, rank=0, seed=seed)
    s.set_epoch(epoch)
    order = s.epoch_order()
    perm = np.random.default_rng([seed, epoch]).permutation(length)
    reference = np.concatenate([perm] * (-(-s.total_size // length)))[:s.total_size]
    np.testing.assert_array_equal(order, reference)
    for r in range(n):
        rs = DistributedSampler(length, num_replicas=n, rank=r, seed=seed)
        rs.set_epoch(epoch)
        np.testing.assert_array_equal(rs.indices(), order[r::n])  # strided, as torch


@given(lengths, replicas, st.booleans())
def test_no_shuffle_is_in_order(length, n, drop_last):
    parts = all_ranks(length, n, shuffle=False, drop_last=drop_last)
    total = (length // n if drop_last else -(-length // n)) * n
    expected = np.resize(np.arange(length), total) if length else np.arange(0)
    for r, p in enumerate(parts):
        np.testing.assert_array_equal(p, expected[r::n])


@given(st.integers(2, 200), replicas, seeds)
def test_epochs_shuffle_differently_and_deterministically(length, n, seed):
    a = DistributedSampler(length, num_replicas=n, rank=0, seed=seed)
    b = DistributedSampler(length, num_replicas=n, rank=0, seed=seed)
    first = a.indices()
    np.testing.assert_array_equal(first, b.indices())
    orders = set()
    for epoch in range(6):
        a.set_epoch(epoch)
        orders.add(tuple(a.epoch_order()[:length].tolist()))
    # 6 epochs of a >= 2-element permutation: a real shuffle repeats rarely; all-same is a bug.
    assert len(orders) > 1


def test_iter_len_and_indices_agree():
    s = DistributedSampler(10, num_replicas=3, rank=2, seed=4)
    assert len(s) == 4 == s.num_samples
    assert list(s) == s.indices().tolist()
    assert all(isinstance(i, int) for i in s)
    assert s.indices().dtype == np.int64


def test_sized_dataset_and_repr():
    s = DistributedSampler(list(range(7)), num_replicas=2, rank=1, shuffle=False)
    assert s.dataset_len == 7 and len(s) == 4
    assert "rank=1 of 2" in repr(s)



def test_explicit_rank_and_size_need_no_world():
    s = DistributedSampler(5, num_replicas=4, rank=3, shuffle=False)
    assert s.indices().tolist() == [3, 2]  # 0 1 2 3 4 | 0 1 2 -> rank 3: positions 3, 7


@pytest.mark.parametrize("kwargs, match", [
    ({"dataset_len": -1, "num_replicas": 2, "rank": 0}, "dataset_len"),
    ({"dataset_len": 4, "num_replicas": 0, "rank": 0}, "num_replicas"),
    ({"dataset_len": 4, "num_replicas": 2, "rank": 2}, r"rank=2 is not in 0..1"),
    ({"dataset_len": 4, "num_replicas": 2, "rank": -1}, "rank=-1"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(**kwargs)


def test_bad_types_and_epochs():
    with pytest.raises(TypeError, match="dataset_len"):
        DistributedSampler(3.5, num_replicas=1, rank=0)  # type: ignore[arg-type]
    s = DistributedSampler(4, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-1)



@pytest.mark.parametrize("seed", ["a", 1.5, None, True])
def test_a_seed_that_is_not_an_int_is_named(seed):
    with pytest.raises(TypeError, match=rf"DistributedSampler: seed must be an int .*got "
                                        rf"{type(seed).__name__}"):
        DistributedSampler(10, 2, 0, seed=seed)


def test_a_negative_seed_is_refused_and_numpy_ints_are_accepted():
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        DistributedSampler(10, 2, 0, seed=-1)
    a = DistributedSampler(10, 2, 0, seed=np.int64(3))
    b = DistributedSampler(10, 2, 0, seed=3)
    np.testing.assert_array_equal(a.indices(), b.indices())
