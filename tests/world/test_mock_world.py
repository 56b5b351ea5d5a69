"""Behaviour of the in-process mock world that MPI cannot share: timeouts, failures, checks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from harness import mock_only

import axondist as ad
from axondist.backends import MockBackend

pytestmark = mock_only


def test_mismatched_shapes_raise_on_every_rank_naming_them():
    def body(world):
        ad.all_reduce(np.ones(world.rank + 1))

    with pytest.raises(ad.CollectiveMismatchError,
                       match=r"all_reduce: ranks disagree on shape "
                             r"\(rank 0: \(1,\), rank 1: \(2,\)"):
        ad.spawn(body, 3)


def test_mismatched_dtypes_and_ops_are_refused():
    def dtypes(world):
        ad.broadcast(np.ones(2, dtype=np.float32 if world.rank else np.float64))

    with pytest.raises(ad.CollectiveMismatchError, match="disagree on dtype"):
        ad.spawn(dtypes, 2)

    def ops(world):
        ad.all_reduce(np.ones(2), "sum" if world.rank else "max")

    with pytest.raises(ad.CollectiveMismatchError, match="disagree on reduce_op"):
        ad.spawn(ops, 2)

    def calls(world):
        if world.rank == 0:
            ad.barrier()
        else:
            ad.all_reduce(np.ones(1))

    with pytest.raises(ad.CollectiveMismatchError, match="different collectives"):
        ad.spawn(calls, 2)

    def gathers(world):
        ad.all_gather(np.ones((1, world.rank + 1)))

    with pytest.raises(ad.CollectiveMismatchError, match="trailing shape"):
        ad.spawn(gathers, 2)


def test_missing_rank_times_out_naming_operation_and_ranks():
    def body(world):
        if world.rank != 2:
            ad.all_reduce(np.ones(4))
        else:
            time.sleep(1.0)  # busy in its own code, past the timeout

    start = time.monotonic()
    with pytest.raises(ad.CollectiveTimeoutError,
                       match=r"all_reduce .*ranks \[2\] of 4 did not join.*rank 2 .*not in any "
                             r"axondist call"):
        ad.spawn(body, 4, timeout=0.3)
    assert time.monotonic() - start < 10


def test_rank_that_returned_fails_its_peers_at_once():
    def body(world):
        if world.rank != 2:
            ad.all_reduce(np.ones(4))

    start = time.monotonic()
    with pytest.raises(ad.RankExitedError,
                       match=r"all_reduce #1 on world .*rank 2 left before making any call "
                             r"\(its function returned\): it will never join"):
        ad.spawn(body, 4, timeout=30)
    assert time.monotonic() - start < 10


def test_recv_without_send_times_out():
    def body(world):
        if world.rank == 1:
            ad.recv(0)
        else:
            time.sleep(1.0)

    with pytest.raises(ad.CollectiveTimeoutError, match="rank 0 sent nothing"):
        ad.spawn(body, 2, timeout=0.3)


def test_recv_from_a_rank_that_returned_fails_at_once():
    def body(world):
        if world.rank == 1:
            ad.recv(0)

    with pytest.raises(ad.RankExitedError, match=r"recv on rank 1 from rank 0 .*rank 0 left"):
        ad.spawn(body, 2, timeout=30)


def test_failing_rank_releases_the_others_and_is_named():
    def body(world):
        if world.rank == 2:
            raise KeyError("bad batch")
        ad.barrier()  # would wait forever for rank 2

    start = time.monotonic()
    with pytest.raises(KeyError, match="bad batch") as info:
        ad.spawn(body, 4, timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.axondist_rank == 2
    if hasattr(info.value, "__notes__"):
        assert "raised on rank 2 of 4" in info.value.__notes__[-1]


def test_spawn_returns_results_in_rank_order_and_passes_args():
    assert ad.spawn(lambda w, a, b=0: (w.rank, a, b), 3, "x", b=5) == [
        (0, "x", 5), (1, "x", 5), (2, "x", 5)]
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        ad.spawn(lambda w: None, 0)


def test_spawn_returns_once_every_ranks_thread_has_ended():
    """A rank's thread-local state is destroyed as its thread ends, after its function
    returned (a JAX rank's, in C++): spawn waits for that end, or a program that exits
    right after spawn meets it in the interpreter's finalization (an abort)."""
    ended = []

    class TornDownSlowly:
        def __del__(self):
            time.sleep(0.3)
            ended.append(True)

    mine = threading.local()

    def body(world):
        mine.state = TornDownSlowly()

    ad.spawn(body, 2)
    assert ended == [True, True], "spawn returned before its ranks' threads ended"


def test_async_ops_complete_out_of_issue_order():
    def body(world):
        big = np.full(300_000, float(world.rank))
        work = ad.all_reduce(big, async_op=True)
        small = ad.all_reduce(np.array([1.0]))  # a blocking op issued after the async one
        assert work.wait() is big
        return small[0], big[0]

    assert ad.spawn(body, 3) == [(3.0, 3.0)] * 3


def test_create_world_gives_one_backend_per_rank():
    backends = MockBackend.create_world(3, timeout=5)
    assert [b.rank for b in backends] == [0, 1, 2]
    assert {b.world_size for b in backends} == {3}
    world = ad.World(backends[1])
    assert world.rank == 1 and world.world_size == 3 and world.default_group is world
    assert world.ranks == (0, 1, 2) and world.contains(2) and not world.contains(3)


def test_world_mock_is_a_single_rank():
    world = ad.World.mock()
    x = np.arange(3.0)
    ad.all_reduce(x, group=world)
    np.testing.assert_array_equal(x, np.arange(3.0))
    assert world.world_size == 1 and world.rank == 0


def test_subgroups_of_subgroups_map_world_ranks():
    def body(world):
        evens = world.new_group(range(0, world.world_size, 2))
        if not evens.is_member:
            return None
        inner = evens.new_group([evens.size - 1])
        return evens.ranks, (inner.ranks if inner.is_member else None)

    res = ad.spawn(body, 5)
    assert res[0] == ((0, 2, 4), None)
    assert res[4] == ((0, 2, 4), (4,))
    assert res[1] is None


def test_new_group_must_get_the_same_ranks_everywhere():
    def body(world):
        world.new_group([0, 1] if world.rank == 0 else [0, 2])

    with pytest.raises(ad.CollectiveMismatchError, match="new_group: ranks disagree"):
        ad.spawn(body, 3)


def test_init_defaults_to_a_one_rank_mock_world(monkeypatch):
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "AXONDIST_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    world = ad.init()
    try:
        assert world.backend.name == "mock" and world.world_size == 1
        with pytest.raises(ValueError, match=r"unknown backend 'gloo'; choose one of \['mock'"):
            ad.init("gloo")
    finally:
        world.destroy()
