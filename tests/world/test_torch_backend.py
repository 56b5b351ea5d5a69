"""What the torch backend arranges for gloo, and where it refuses, on every rank of a torchrun
world: uneven blocks padded and unpadded again, a receive of the wrong size, complex
products, torch tensors reduced in place. The torchrun world runs (tests/world/
test_torch_launch.py) run it at two and three ranks; the MPI backend's own checks are
``test_mpi_launch.py::test_mpi_backend_checks``, the mock world's test_mock_world.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import UNDER_TORCHRUN, launched_world

import axondist as ad

pytestmark = pytest.mark.skipif(
    not UNDER_TORCHRUN, reason="the torch backend's own arrangements: runs under torchrun "
                               "(tests/world/test_torch_launch.py's world runs)")


def test_the_torch_backend_pads_uneven_blocks_checks_sizes_and_reduces_in_place():
    import torch
    import torch.distributed as dist

    world = launched_world()
    n, rank = world.world_size, world.rank
    assert world.backend.name == "torch" and n == dist.get_world_size()
    assert world.node_info() == (0, rank, n)  # torchrun --standalone: one host
    # uneven blocks (gloo moves equal ones): padded and unpadded again
    rows = [r + 1 for r in range(n)]
    xs = [np.full((rows[r], 3), r, np.float32) for r in range(n)]
    np.testing.assert_array_equal(ad.all_gather(xs[rank]), np.concatenate(xs))
    big = np.arange(2 * n + 1, dtype=np.float64) + rank
    want = np.array_split(sum(np.arange(2 * n + 1.0) + r for r in range(n)), n)[rank]
    np.testing.assert_array_equal(ad.reduce_scatter(big), want)
    gathered = ad.gather_tensor(xs[rank], dst=n - 1)
    assert (gathered is None) == (rank != n - 1)
    # a receive of the wrong size raises, drops the message, and the next one arrives
    backend = world.backend
    if rank == 0:
        backend.send(np.arange(4.0), 1, tag=5)
        backend.send(np.arange(3.0), 1, tag=5)
    elif rank == 1:
        with pytest.raises(ad.CollectiveMismatchError, match="the message has 32 bytes but "
                                                             "the buffer holds 24"):
            backend.recv(np.empty(3), 0, tag=5)
        again = np.empty(3)
        backend.recv(again, 0, tag=5)
        np.testing.assert_array_equal(again, np.arange(3.0))
    # torch.distributed multiplies no complex values: our message, not torch's
    with pytest.raises(ad.UnsupportedDTypeError, match="cannot multiply complex values"):
        ad.all_reduce(np.ones(2, np.complex64), "product")
    # the torch tensor a caller passes is the one reduced, in place
    t = torch.full((3,), float(rank + 1))
    assert ad.all_reduce(t) is t
    torch.testing.assert_close(t, torch.full((3,), n * (n + 1) / 2))
    ad.barrier()


def test_a_broadcast_on_the_groups_sockets_equals_gloos():
    """A broadcast of host memory travels on the group's own sockets (the table's WIRES row)
    and gives what gloo's broadcast gives: every dtype, empty and multi-MiB buffers, every
    root, a subgroup's, and a non-blocking one."""
    import ml_dtypes

    from axondist.backends.plan import CallKey
    from axondist.backends.torch.choose import Algorithm, choose
    from axondist.backends.torch.plans import PLANS

    world = launched_world()
    n, rank, backend = world.world_size, world.rank, world.backend
    assert backend.layout.wired
    for dtype, shape in [(np.float32, (1024,)), (np.float64, (3, 5)), (np.int8, (7,)),
                         (ml_dtypes.bfloat16, (33,)), (np.complex128, (2, 2)),
                         (np.float32, (0, 4)), (np.uint8, (3 * 2**20 + 5,))]:
        for root in range(n):
            mine = (np.arange(int(np.prod(shape))) * (rank + 2)).astype(dtype).reshape(shape)
            want = (np.arange(int(np.prod(shape))) * (root + 2)).astype(dtype).reshape(shape)
            key = CallKey.of("broadcast", mine, root=root)
            assert choose(key, backend.layout) is Algorithm.WIRES
            on_wires = mine.copy()
            assert ad.broadcast(on_wires, src=root) is on_wires
            by_gloo = mine.copy()
            PLANS["broadcast", Algorithm.TORCH](backend, key).run(by_gloo)
            np.testing.assert_array_equal(on_wires, want)
            np.testing.assert_array_equal(by_gloo, want)
    # a subgroup of the ranks in reverse order: its group ranks, its own sockets
    with world.new_group(list(range(n))[::-1]) as group:
        x = np.full(5, float(rank))
        ad.broadcast(x, group, src=0)
        np.testing.assert_array_equal(x, np.full(5, float(n - 1)))
        work = ad.broadcast(np.full(4, rank, np.int64), group, src=n - 1, async_op=True)
        np.testing.assert_array_equal(work.wait(), np.zeros(4, np.int64))
    ad.barrier()


def test_a_pair_all_reduce_on_the_groups_sockets_equals_gloos():
    """A SUM or AVERAGE all-reduce or reduce-scatter of host memory in a group of two runs
    on the group's own sockets (the table's PAIR_WIRES row), each member summing the block
    it owns, and gives gloo's bits: every dtype of the row, sizes from empty and odd to
    multi-MiB, blocking and not; an all-gather of two (the WIRES row) too. At three ranks a
    two-member subgroup takes the row; the world, the rank-order sum."""
    from axondist.backends.plan import CallKey
    from axondist.backends.torch.choose import Algorithm, choose
    from axondist.backends.torch.plans import PLANS

    world = launched_world()
    n = world.world_size
    group = world if n == 2 else world.new_group([n - 1, 0])
    if group.is_member:
        backend, me = group.backend, group.rank
        assert backend.layout.wired and backend.world_size == 2
        rng = np.random.default_rng(7)
        for dtype in (np.float32, np.float64, np.int32, np.int64):
            for size in (0, 1, 7, 4096, (3 << 20) // 4 + 3):
                for op in ("sum", "avg") if np.dtype(dtype).kind == "f" else ("sum",):
                    values = rng.standard_normal((2, size)) * 1000
                    mine = values[me].astype(dtype)
                    key = CallKey.of("all_reduce", mine, reduce_op=op)
                    assert choose(key, backend.layout) is Algorithm.PAIR_WIRES
                    on_wires = mine.copy()
                    assert ad.all_reduce(on_wires, op, group) is on_wires
                    by_gloo = mine.copy()
                    PLANS["all_reduce", Algorithm.TORCH](backend, key).run(by_gloo)
                    np.testing.assert_array_equal(on_wires, by_gloo)
        for dtype in (np.float32, np.int64, np.int8):
            for rows in (0, 1, 5, (1 << 20) // 3):
                block = (rng.standard_normal((2, rows, 3)) * 100).astype(dtype)[me]
                key = CallKey.of("all_gather", block, counts=(rows, rows))
                assert choose(key, backend.layout) is Algorithm.WIRES
                gathered = ad.all_gather(block, group, sizes=[rows, rows])
                np.testing.assert_array_equal(ad.all_gather(block, group), gathered)
                by_gloo = np.empty((2 * rows, 3), dtype)
                PLANS["all_gather", Algorithm.TORCH](backend, key).run(block, by_gloo)
                np.testing.assert_array_equal(gathered, by_gloo)
                if dtype == np.int8:
                    continue
                for op in ("sum", "avg") if np.dtype(dtype).kind == "f" else ("sum",):
                    both = (rng.standard_normal((2, 2 * rows, 3)) * 100).astype(dtype)[me]
                    key = CallKey.of("reduce_scatter", both, reduce_op=op)
                    assert choose(key, backend.layout) is Algorithm.PAIR_WIRES
                    scattered = ad.reduce_scatter(both, op, group)
                    by_gloo = np.empty((rows, 3), dtype)
                    PLANS["reduce_scatter", Algorithm.TORCH](backend, key).run(both, by_gloo)
                    np.testing.assert_array_equal(scattered, by_gloo)
        work = ad.all_reduce(np.full(5, me + 1.0), "avg", group, async_op=True)
        np.testing.assert_array_equal(work.wait(), np.full(5, 1.5))
    if group is not world:
        group.destroy()
    if n > 2:
        key = CallKey.of("all_reduce", np.ones(4, np.float32), reduce_op="sum")
        assert choose(key, world.backend.layout) is not Algorithm.PAIR_WIRES
    ad.barrier()


def test_sums_in_rank_order_and_all_gathers_on_the_groups_sockets_equal_gloos():
    """A float SUM or AVERAGE all-reduce or reduce-scatter of host memory adds in rank order
    with its copies on the group's own sockets (the RANK_ORDER_WIRES row; on two ranks the
    pair's row, for float32/64) and gives the bits of NumPy's sum in rank order and, from
    three ranks, of the same sum through gloo's all-to-all (RANK_ORDER_SUM); an
    all-gather on the sockets (WIRES), of even or uneven blocks, gloo's (padded) result.
    Every dtype of the rows, blocks empty on some ranks, odd sizes and multi-MiB ones,
    blocking and not, on the world and on a subgroup of its ranks in reverse order."""
    import ml_dtypes

    from axondist.backends.plan import CallKey
    from axondist.backends.torch.choose import Algorithm, choose
    from axondist.backends.torch.plans import PLANS
    from axondist.ops import combine_into

    world = launched_world()
    n = world.world_size
    rng = np.random.default_rng(11)
    groups = [world, world.new_group(list(range(n))[::-1])]
    for group in groups:
        backend, me, size = group.backend, group.rank, group.world_size
        assert backend.layout.wired
        for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.complex64):
            for count in (0, 1, size - 1, 4099, (3 << 20) // 8 + 5):
                values = rng.standard_normal((size, count)) * 1000
                mine = values[me].astype(dtype)
                for op in ("sum", "avg"):
                    key = CallKey.of("all_reduce", mine, reduce_op=op)
                    sums = choose(key, backend.layout)
                    assert sums is Algorithm.RANK_ORDER_WIRES or (
                        size == 2 and sums is Algorithm.PAIR_WIRES)
                    on_wires = mine.copy()
                    PLANS["all_reduce", sums](backend, key).run(on_wires)
                    want = values[0].astype(dtype)
                    combine_into(want, [v.astype(dtype) for v in values],
                                 ad.ReduceOp.parse(op, "test"))
                    np.testing.assert_array_equal(on_wires, want)
                    if size > 2:
                        in_order = mine.copy()
                        PLANS["all_reduce", Algorithm.RANK_ORDER_SUM](backend, key).run(in_order)
                        np.testing.assert_array_equal(on_wires, in_order)
                    if op == "avg" and np.dtype(dtype).itemsize == 2:
                        continue  # the front door's half-precision mean is widened first
                    called = mine.copy()
                    assert ad.all_reduce(called, op, group) is called
                    np.testing.assert_array_equal(called, on_wires)
                    rows = [count // size + (r < count % size) for r in range(size)]
                    scattered = ad.reduce_scatter(mine, op, group)
                    assert scattered.shape == (rows[me],)
                    np.testing.assert_array_equal(
                        scattered, on_wires[sum(rows[:me]):sum(rows[:me + 1])])
        for dtype in (np.float32, np.int8, np.bool_, ml_dtypes.bfloat16):
            for counts in ([2] * size, [0] * (size - 1) + [5], [r + 1 for r in range(size)],
                           [(1 << 20) // 3 + r for r in range(size)]):
                every = (rng.standard_normal((sum(counts), 3)) * 100).astype(dtype)
                block = every[sum(counts[:me]):sum(counts[:me + 1])]  # the same draws on all
                key = CallKey.of("all_gather", block, counts=tuple(counts))
                assert choose(key, backend.layout) is Algorithm.WIRES
                gathered = ad.all_gather(block, group, sizes=counts)
                padded = Algorithm.TORCH if len(set(counts)) == 1 else Algorithm.PADDED
                by_gloo = np.empty((sum(counts), 3), dtype)
                PLANS["all_gather", padded](backend, key).run(block, by_gloo)
                np.testing.assert_array_equal(gathered, by_gloo)
                np.testing.assert_array_equal(gathered, every)
        work = ad.all_reduce(np.full(5, me + 1.0), "avg", group, async_op=True)
        gathered_later = ad.all_gather(np.full(2, me), group, async_op=True)
        np.testing.assert_array_equal(work.wait(), np.full(5, (size + 1) / 2))
        np.testing.assert_array_equal(gathered_later.wait(), np.repeat(np.arange(size), 2))
    groups[1].destroy()
    ad.barrier()


def test_every_reduction_on_the_groups_sockets_combines_as_the_mock_world():
    """Every all-reduce and reduce-scatter of host memory runs on the group's own sockets
    (RANK_ORDER_WIRES; on two ranks the pair's row takes its float and int sums, which
    combine the same), combined in rank order as the mock world combines: MIN and MAX keep
    NaNs wherever a rank holds one (gloo's path needs a second reduction for it,
    NAN_RESTORE: the same values), integers wrap as NumPy's and equal gloo's, booleans are
    logical, a float PRODUCT multiplies in rank order."""
    from axondist.backends.plan import CallKey
    from axondist.backends.torch.choose import Algorithm, choose
    from axondist.backends.torch.plans import PLANS
    from axondist.ops import combine_into

    world = launched_world()
    n, me, backend = world.world_size, world.rank, world.backend
    rng = np.random.default_rng(5)
    for count in (1, n + 1, 5000):
        floats = rng.standard_normal((n, count))
        floats[rng.integers(0, n, 3), rng.integers(0, count, 3)] = np.nan
        ints = rng.integers(-2**31, 2**31, (n, count))
        cases = [(floats, np.float32, "min", "NAN_RESTORE"), (floats, np.float64, "max",
                                                               "NAN_RESTORE"),
                 (ints, np.int32, "sum", "TORCH"), (ints, np.int32, "product", "TORCH"),
                 (ints, np.int8, "max", "TORCH"), (ints, np.int64, "min", "TORCH"),
                 (floats, np.float32, "product", None), (ints % 2, np.bool_, "sum", None),
                 (ints % 3, np.bool_, "min", None)]
        for values, dtype, op, gloos in cases:
            mine = values[me].astype(dtype)
            key = CallKey.of("all_reduce", mine, reduce_op=op)
            assert choose(key, backend.layout) in (Algorithm.RANK_ORDER_WIRES,
                                                   Algorithm.PAIR_WIRES)
            called = mine.copy()
            assert ad.all_reduce(called, op) is called
            want = values[0].astype(dtype)
            with np.errstate(all="ignore"):
                combine_into(want, [v.astype(dtype) for v in values],
                             ad.ReduceOp.parse(op, "test"))
            np.testing.assert_array_equal(called, want)
            if gloos is not None:
                by_gloo = mine.copy()
                PLANS["all_reduce", Algorithm[gloos]](backend, key).run(by_gloo)
                np.testing.assert_array_equal(called, by_gloo)
            rows = [count // n + (r < count % n) for r in range(n)]
            lo, hi = sum(rows[:me]), sum(rows[:me + 1])
            np.testing.assert_array_equal(ad.reduce_scatter(mine, op), want[lo:hi])
    ad.barrier()


def test_gathers_scatters_all_to_alls_and_reduces_on_the_groups_sockets_equal_gloos():
    """Gathers, scatters and all-to-alls of host memory move on the group's own sockets
    (WIRES) at every size, blocks even, uneven or empty, and give what gloo's (padded)
    calls give, to every root; a reduce runs there too (RANK_ORDER_WIRES: the root gets the
    rank-order result, the others keep their input)."""
    from axondist.backends.plan import CallKey
    from axondist.backends.torch.choose import Algorithm, choose
    from axondist.backends.torch.plans import PLANS
    from axondist.ops import combine_into

    world = launched_world()
    n, me, backend = world.world_size, world.rank, world.backend
    rng = np.random.default_rng(3)
    for counts in ([2] * n, [0] * (n - 1) + [5], [r + 1 for r in range(n)],
                   [(1 << 19) + r for r in range(n)]):
        padded = Algorithm.TORCH if len(set(counts)) == 1 else Algorithm.PADDED
        every = (rng.standard_normal(sum(counts)) * 100).astype(np.float32)
        lo = sum(counts[:me])
        block = every[lo:lo + counts[me]].copy()
        for root in range(n):
            key = CallKey.of("gather", block, root=root, counts=tuple(counts))
            assert choose(key, backend.layout) is Algorithm.WIRES
            got = backend.gather(block, np.empty(sum(counts), np.float32) if me == root
                                 else None, counts, root).wait()
            by_gloo = np.empty(sum(counts), np.float32) if me == root else None
            PLANS["gather", padded](backend, key).run(block, by_gloo)
            if me == root:
                np.testing.assert_array_equal(got, every)
                np.testing.assert_array_equal(by_gloo, every)
            else:
                assert got is None
            mine = np.empty(counts[me], np.float32)
            backend.scatter(every if me == root else None, mine, counts, root).wait()
            np.testing.assert_array_equal(mine, block)
        # all-to-all: rank r sends (r + k) % 3 rows to rank k
        sent = [(me + k) % 3 + (counts[0] if k == 0 else 0) for k in range(n)]
        came = [(r + me) % 3 + (counts[0] if me == 0 else 0) for r in range(n)]
        rows = np.random.default_rng(100 + me).standard_normal((sum(sent), 2))  # this rank's
        key = CallKey.of("all_to_all", rows.reshape(-1), counts=tuple(
            [2 * c for c in sent] + [2 * c for c in came]))
        assert choose(key, backend.layout) is Algorithm.WIRES
        got = ad.all_to_all(rows, send_sizes=sent)
        by_gloo = np.empty(2 * sum(came))
        PLANS["all_to_all", Algorithm.TORCH](backend, key).run(rows.reshape(-1), by_gloo)
        np.testing.assert_array_equal(got.reshape(-1), by_gloo)
    for dtype, op in ((np.float32, "sum"), (np.float64, "max"), (np.int64, "product")):
        values = (rng.standard_normal((n, 4099)) * 3).astype(dtype)
        values[1, 7] = np.nan if dtype != np.int64 else values[1, 7]
        want = values[0].copy()
        combine_into(want, list(values), ad.ReduceOp.parse(op, "test"))
        for root in (0, n - 1):
            x = values[me].copy()
            key = CallKey.of("reduce", x, reduce_op=op, root=root)
            assert choose(key, backend.layout) is Algorithm.RANK_ORDER_WIRES
            assert ad.reduce(x, root, op) is x
            np.testing.assert_array_equal(x, want if me == root else values[me])
    ad.barrier()


def test_a_rank_passing_a_read_only_input_still_meets_the_others():
    """A call that does not write its input accepts a read-only array; the other ranks pass
    writable ones. Every rank must still choose the same algorithm (a rank on the sockets
    and another in gloo would wait for each other until the timeout): the results arrive
    on every rank, at once."""
    world = launched_world()
    n, me = world.world_size, world.rank

    def given(x: np.ndarray) -> np.ndarray:
        if me == 0:
            x.flags.writeable = False
        return x

    rows = np.arange(3 * n * 2, dtype=np.float32).reshape(3 * n, 2) + me
    want = sum(np.arange(3 * n * 2, dtype=np.float32).reshape(3 * n, 2) + r for r in range(n))
    np.testing.assert_array_equal(ad.reduce_scatter(given(rows.copy())), want[3 * me:3 * me + 3])
    gathered = ad.all_gather(given(np.full((2, 3), me, np.int64)), sizes=[2] * n)
    np.testing.assert_array_equal(gathered, np.repeat(np.arange(n), 2)[:, None] * np.ones(3))
    at_root = ad.gather_tensor(given(np.full(2, me + 1.0)), dst=n - 1)
    if me == n - 1:
        np.testing.assert_array_equal(at_root, np.repeat(np.arange(1.0, n + 1), 2))
    swapped = ad.all_to_all(given(np.full((n, 2), me, np.int32)))
    np.testing.assert_array_equal(swapped, np.repeat(np.arange(n), 2).reshape(n, 2))
    ad.barrier()


def test_messages_of_host_memory_travel_on_the_worlds_own_connections():
    """Point-to-point messages of host memory go through the world's mailbox (one
    connection per pair of ranks, shared by the groups), matched by group and tag as gloo
    matches them: each rank sends around the ring on the world and on a subgroup, with two
    tags, and the receiver takes them in the reverse order; objects too."""
    world = launched_world()
    n, rank, backend = world.world_size, world.rank, world.backend
    assert backend.mail is not None and backend.mail.reaches((rank + 1) % n)
    sub = world.new_group(list(range(n)))
    assert sub is not None and sub.backend.mail is backend.mail
    right, left = (rank + 1) % n, (rank - 1) % n
    for tag in (1, 2):
        backend.send(np.full(3, 10 * rank + tag, np.int64), right, tag=tag)
        sub.backend.send(np.full(60_000, rank + tag, np.uint8), right, tag=tag)
    backend.send_object({"from": rank}, right, tag=1)
    for tag in (2, 1):
        got = np.empty(60_000, np.uint8)
        sub.backend.recv(got, left, tag=tag)
        assert (got == left + tag).all()
        small = np.empty(3, np.int64)
        backend.recv(small, left, tag=tag)
        np.testing.assert_array_equal(small, 10 * left + tag)
    assert backend.recv_object(left, tag=1) == {"from": left}
    # a send past the eager size waits for its receive: rank 0 receives first
    big = np.arange(100_000, dtype=np.float64)
    if rank == 0:
        got = np.empty_like(big)
        backend.recv(got, left, tag=3)
        np.testing.assert_array_equal(got, big + left)
    backend.send(big + rank, right, tag=3)
    if rank != 0:
        got = np.empty_like(big)
        backend.recv(got, left, tag=3)
        np.testing.assert_array_equal(got, big + left)
    assert not backend.outbox.unreceived(settle=5.0)  # every send was received
    sub.destroy()
    ad.barrier()
