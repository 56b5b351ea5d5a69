"""HierarchicalAllReduce: the pure plan, numpy on the mock world under any node layout
(given, or detected from a faked ``node_info``), its errors, and MPI on 2 simulated hosts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import hierarchical
from axondist.backends.mock import MockBackend
from axondist.errors import InvalidBufferError, NotAMemberError, UnsupportedDTypeError
from axondist.hierarchical import HierarchicalAllReduce, hierarchy_plan
from cluster.simcluster import SimCluster

CHECKS = str(Path(__file__).resolve().parent / "slow_link_checks.py")

node_layouts = st.lists(st.integers(0, 3), min_size=1, max_size=10)
even_layouts = st.tuples(st.integers(1, 3), st.integers(1, 3), st.randoms()).map(
    lambda t: t[2].sample([k for k in range(t[0]) for _ in range(t[1])], t[0] * t[1]))


@given(nodes=node_layouts)
def test_plan_puts_each_rank_once_with_its_node(nodes: list[int]) -> None:
    plan = hierarchy_plan(nodes)
    assert sorted(r for group in plan.within for r in group) == list(range(len(nodes)))
    for group in plan.within:
        assert list(group) == sorted(group) and len({nodes[r] for r in group}) == 1
    assert [nodes[g[0]] for g in plan.within] == list(dict.fromkeys(nodes))
    assert plan.even == (len({nodes.count(k) for k in set(nodes)}) == 1)
    if plan.even:
        assert sorted(r for group in plan.across for r in group) == list(range(len(nodes)))
        for j, group in enumerate(plan.across):  # one rank per node: each node's j-th
            assert list(group) == [within[j] for within in plan.within]
    else:
        assert plan.across == () and not plan.useful


def _reduce_all(inputs: list[np.ndarray], op: str) -> np.ndarray:
    stacked = np.stack(inputs)
    return {"sum": stacked.sum(0), "max": stacked.max(0), "min": stacked.min(0),
            "product": stacked.prod(0), "average": stacked.mean(0)}[op].astype(inputs[0].dtype)


def _inputs(rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    # small integers: sums and products are exact in every dtype, so any grouping agrees
    values = np.random.default_rng(rank).integers(-3, 4, size=shape)
    return values.astype(dtype)


@settings(max_examples=30)
@given(nodes=st.one_of(even_layouts, node_layouts.filter(lambda n: len(n) <= 6)),
       shape=st.sampled_from([(), (0,), (1,), (5,), (7, 3), (2, 0, 4)]),
       dtype_op=st.sampled_from([("float64", "sum"), ("float32", "average"), ("int32", "max"),
                                 ("int64", "product"), ("float64", "min")]))
def test_equals_numpy_under_any_layout(nodes: list[int], shape: tuple[int, ...],
                                       dtype_op: tuple[str, str]) -> None:
    dtype, op = dtype_op

    def body(world: ad.World) -> tuple[bool, np.ndarray]:
        with HierarchicalAllReduce(world, nodes=nodes, min_bytes=0) as hier:
            x = _inputs(world.rank, shape, dtype)
            assert hier(x, op) is x
            return hier.is_hierarchical, x

    results = ad.spawn(body, len(nodes))
    want = _reduce_all([_inputs(r, shape, dtype) for r in range(len(nodes))], op)
    assert all(h == hierarchy_plan(nodes).useful for h, _ in results)
    for _, got in results:
        assert got.shape == shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.fixture
def round_robin_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mock world's ranks placed round-robin over two nodes (0, 2 on node 0)."""
    monkeypatch.setattr(MockBackend, "node_info",
                        lambda self: (self.rank % 2, self.rank // 2, self.world_size // 2))


def test_detects_the_layout_from_node_info(round_robin_nodes: None) -> None:
    def body(world: ad.World) -> tuple[Any, ...]:
        hier = HierarchicalAllReduce(min_bytes=0)  # the current world, nodes from node_info()
        x = np.full(6, float(world.rank + 1))
        hier(x)
        sizes = (hier._node.world_size, hier._across.world_size)  # type: ignore[union-attr]
        hier.close()
        return hier.plan.within, sizes, x.tolist()

    for within, sizes, x in ad.spawn(body, 4):
        assert within == ((0, 2), (1, 3)) and sizes == (2, 2) and x == [10.0] * 6


def test_one_node_or_one_rank_per_node_is_the_flat_all_reduce() -> None:
    def body(world: ad.World, nodes: list[int]) -> bool:
        with HierarchicalAllReduce(world, nodes=nodes) as hier:
            x = np.ones(3)
            hier(x)
            assert x.tolist() == [world.world_size] * 3
            return hier.is_hierarchical

    assert ad.spawn(body, 3, [0, 0, 0]) == [False] * 3
    assert ad.spawn(body, 3, [0, 1, 2]) == [False] * 3


def test_arrays_under_min_bytes_take_the_flat_all_reduce(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    steps: list[int] = []
    real = hierarchical.reduce_scatter

    def counted(x: Any, *args: Any) -> Any:
        steps.append(x.nbytes)
        return real(x, *args)

    monkeypatch.setattr(hierarchical, "reduce_scatter", counted)

    def body(world: ad.World) -> list[float]:
        with HierarchicalAllReduce(world, nodes=[0, 0, 1, 1], min_bytes=64) as hier:
            small, large = np.ones(7), np.ones(8)  # 56 and 64 bytes
            hier(small)
            hier(large)
            return [*small, *large]

    assert ad.spawn(body, 4) == [[4.0] * 15] * 4
    assert steps == [64] * 4, "only the 64-byte array took the three steps, on each rank"
    assert HierarchicalAllReduce.__init__.__kwdefaults__["min_bytes"] == 1 << 20


def test_uneven_nodes_fall_back_to_flat_or_are_refused() -> None:
    def body(world: ad.World, uneven: str) -> str:
        try:
            hier = HierarchicalAllReduce(world, nodes=[0, 0, 1], uneven=uneven)
        except ValueError as err:
            ad.barrier()  # still usable: no rank created a group
            return str(err)
        x = np.ones(2)
        hier(x)
        return f"{hier!r} {x.tolist()}"

    assert ad.spawn(body, 3, "flat") == ["HierarchicalAllReduce(flat, nodes=[[0, 1], [2]]) "
                                         "[3.0, 3.0]"] * 3
    errors = ad.spawn(body, 3, "error")
    assert len(set(errors)) == 1
    assert errors[0] == ("HierarchicalAllReduce: nodes hold different numbers of ranks (node: "
                         "ranks {0: 2, 1: 1}, ranks by node [(0, 1), (2,)]); launch the same "
                         "number per node, or pass uneven='flat'")


@pytest.mark.parametrize("kwargs, error, text", [
    ({"nodes": [0, 1]}, ValueError,
     r"HierarchicalAllReduce: nodes must give one node id per rank of the group \(4\), got 2"),
    ({"nodes": [0, 0, 1, "1"]}, TypeError,
     r"HierarchicalAllReduce: nodes must hold ints \(node ids\), got str '1'"),
    ({"nodes": [0, 0, 1, True]}, TypeError, r"nodes must hold ints \(node ids\), got bool"),
    ({"nodes": 3}, TypeError, r"HierarchicalAllReduce: nodes must be a list, got int 3"),
    ({"min_bytes": -1}, ValueError,
     r"HierarchicalAllReduce: min_bytes=-1 must be >= 0 \(0: every array takes the three"),
    ({"min_bytes": 1.5}, TypeError,
     r"HierarchicalAllReduce: min_bytes must be an int \(bytes\), got float 1.5"),
    ({"uneven": "ignore"}, ValueError,
     r"HierarchicalAllReduce: uneven='ignore' is not one of Uneven's names; use one of "
     r"'flat', 'error'"),
])
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], error: type[Exception],
                                         text: str) -> None:
    def body(world: ad.World) -> None:
        with pytest.raises(error, match=text):
            HierarchicalAllReduce(world, **kwargs)
        ad.barrier()

    ad.spawn(body, 4)


def test_ranks_passing_different_layouts_all_raise() -> None:
    def body(world: ad.World) -> str:
        nodes = [0, 0, 1, 1] if world.rank else [0, 1, 0, 1]
        with pytest.raises(ValueError) as err:
            HierarchicalAllReduce(world, nodes=nodes)
        return str(err.value)

    messages = ad.spawn(body, 4)
    assert len(set(messages)) == 1
    assert messages[0].startswith("HierarchicalAllReduce: ranks passed different nodes lists "
                                  "({0: [0, 1, 0, 1], 1: [0, 0, 1, 1]")
    assert messages[0].endswith("pass the same list on every rank")


def test_bad_buffers_and_a_closed_reducer_are_refused() -> None:
    def body(world: ad.World) -> None:
        hier = HierarchicalAllReduce(world, nodes=[0, 0, 1, 1], min_bytes=0)
        read_only = np.ones(4)
        read_only.flags.writeable = False
        with pytest.raises(InvalidBufferError, match="HierarchicalAllReduce: the array is "
                                                     "read-only"):
            hier(read_only)
        with pytest.raises(InvalidBufferError, match="is not C-contiguous"):
            hier(np.ones((4, 4))[:, 1])
        with pytest.raises(UnsupportedDTypeError, match="HierarchicalAllReduce: AVERAGE is "
                                                        "not defined for int32"):
            hier(np.ones(4, np.int32), "average")
        with pytest.raises(ValueError, match="median"):
            hier(np.ones(4), "median")
        hier.close()
        hier.close()  # idempotent
        assert not hier.is_hierarchical
        with pytest.raises(NotAMemberError, match=r"HierarchicalAllReduce: called after "
                                                  r"close\(\)"):
            hier(np.ones(4))

    ad.spawn(body, 4)


def test_non_members_cannot_build_one() -> None:
    def body(world: ad.World) -> None:
        group = world.new_group([0, 1])
        if not group.is_member:
            with pytest.raises(NotAMemberError, match="not a member of the group of ranks"):
                HierarchicalAllReduce(group, nodes=[0, 1])

    ad.spawn(body, 3)


@pytest.mark.parametrize("slots, n, expect, plan", [
    ([2, 2], None, "hierarchical", [[0, 1], [2, 3]]),
    ([1, 1], 4, "hierarchical", [[0, 2], [1, 3]]),  # round-robin placement
    ([2, 1], None, "flat", [[0, 1], [2]]),  # uneven 2 + 1: the documented fallback
], ids=["blocks-2x2", "interleaved-2x2", "uneven-2+1"])
def test_equals_the_flat_all_reduce_on_two_hosts(cluster: SimCluster, slots: list[int],
                                                 n: int | None, expect: str,
                                                 plan: list[list[int]]) -> None:
    run = cluster.run(slots, ["-m", "mpi4py", CHECKS, "hierarchical_equals_flat", expect],
                      n=n, timeout=120)
    assert run.returncode == 0, run.tail()
    for text in run.ranks:
        assert "hierarchical_equals_flat OK" in text, run.tail()
        line = next(ln for ln in text.splitlines() if ln.startswith("PLAN "))
        assert json.loads(line[len("PLAN "):]) == plan, run.tail()


@settings(max_examples=15)
@given(nodes=even_layouts, strategy=st.sampled_from(["synchronous", "overlapped"]),
       shapes=st.lists(st.sampled_from([(3,), (4, 5), (2, 2, 2), (40,)]), min_size=1,
                       max_size=5),
       weighted=st.booleans(), cap_bytes=st.sampled_from([8, 200, 1 << 20]))
def test_as_ddp_hook_training_equals_one_process(nodes: list[int], strategy: str,
                                                 shapes: list[tuple[int, ...]], weighted: bool,
                                                 cap_bytes: int) -> None:
    """DDP(compression=hier.hook): two SGD steps equal the full-batch steps of one process
    (the sample-weighted average too), every rank alike."""
    n = len(nodes)
    rng = np.random.default_rng(len(shapes) * 7 + n)
    start = [rng.standard_normal(s) for s in shapes]
    local = [[[rng.standard_normal(s) for s in shapes] for _ in range(n)] for _ in range(2)]
    counts = [1 + r % 3 if weighted else 1 for r in range(n)]

    def body(world: ad.World) -> list[np.ndarray]:
        params = [ad.Parameter(a.copy()) for a in start]
        with HierarchicalAllReduce(world, nodes=nodes, min_bytes=0) as hier, \
                ad.DDP(params, strategy=strategy, compression=hier.hook,
                       bucket_cap_mb=cap_bytes / 2**20) as ddp:
            for step in range(2):
                for p, g in zip(params, local[step][world.rank]):
                    p.grad = g.copy()
                ddp.sync_gradients(num_samples=counts[world.rank] if weighted else None)
                for p in params:
                    p.data -= 0.1 * p.grad
        return [p.data for p in params]

    want = [a.copy() for a in start]
    for step in range(2):
        for i in range(len(shapes)):
            avg = sum(c * local[step][r][i] for r, c in enumerate(counts)) / sum(counts)
            want[i] -= 0.1 * avg
    results = ad.spawn(body, n)
    for got in results:
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
        for g, first in zip(got, results[0]):
            np.testing.assert_array_equal(g, first)  # every rank holds the same values


def test_as_ddp_hook_refuses_another_group() -> None:
    def body(world: ad.World) -> str:
        with HierarchicalAllReduce(world, nodes=[0, 0, 1, 1]) as hier, \
                world.new_group([0, 1, 2, 3]) as other:
            try:
                hier.hook(np.zeros(4), other, False)
            except ValueError as exc:
                return str(exc)
        return "no error"

    for message in ad.spawn(body, 4):
        assert message.startswith("HierarchicalAllReduce.hook: DDP's group ProcessGroup(")
        assert "is not the group this all-reduce was built on" in message
        assert "build HierarchicalAllReduce(group) with DDP's group" in message
