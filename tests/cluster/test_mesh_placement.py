"""make_mesh keeps tensor-parallel groups on one host: the pure ordering, the mock world
with a simulated node layout, and a real 2-host placement on the simulated cluster."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist.backends.mock import MockBackend
from axondist.mesh import groups_across_nodes, make_mesh, mesh_layout, node_order
from cluster.simcluster import SimCluster

CHECKS = str(Path(__file__).resolve().parent / "rank_checks.py")

node_layouts = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@given(nodes=node_layouts)
def test_node_order_groups_each_nodes_ranks_in_rank_order(nodes: list[int]) -> None:
    order = node_order(nodes)
    assert sorted(order) == list(range(len(nodes)))
    runs = [nodes[r] for r in order]
    assert [k for i, k in enumerate(runs) if i == 0 or runs[i - 1] != k] == list(
        dict.fromkeys(nodes)), "each node's ranks are contiguous, nodes by lowest rank"
    for node in set(nodes):
        mine = [r for r in order if nodes[r] == node]
        assert mine == sorted(mine)


@given(nodes=node_layouts)
def test_node_order_keeps_a_placement_by_blocks(nodes: list[int]) -> None:
    blocks = sorted(nodes)
    assert node_order(blocks) == list(range(len(blocks)))


@given(per_node=st.lists(st.integers(1, 3), min_size=1, max_size=4), tp=st.integers(1, 3),
       data=st.data())
def test_tp_groups_stay_on_a_node_whenever_tp_divides_every_node(
        per_node: list[int], tp: int, data: st.DataObject) -> None:
    nodes = [k for k, count in enumerate(per_node) for _ in range(count * tp)]
    nodes = data.draw(st.permutations(nodes))  # any placement of those ranks
    order = node_order(nodes)
    groups = [[order[p] for p in g] for g in mesh_layout(len(nodes), tp).tp_groups]
    assert groups_across_nodes(groups, nodes) == []


@given(nodes=node_layouts, data=st.data())
def test_groups_across_nodes_names_exactly_the_mixed_groups(nodes: list[int],
                                                            data: st.DataObject) -> None:
    ranks = data.draw(st.permutations(range(len(nodes))))
    cut = data.draw(st.integers(1, len(nodes)))
    groups = [list(ranks[i:i + cut]) for i in range(0, len(ranks), cut)]
    found = groups_across_nodes(groups, nodes)
    assert [g for g, _ in found] == [g for g in groups if len({nodes[r] for r in g}) > 1]
    for group, spans in found:
        assert spans == list(dict.fromkeys(nodes[r] for r in group))


@pytest.fixture
def round_robin_nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The mock world's ranks placed round-robin over two nodes (0, 2 on node 0)."""
    monkeypatch.setattr(MockBackend, "node_info",
                        lambda self: (self.rank % 2, self.rank // 2, self.world_size // 2))
    yield


def _mesh_and_sum(world: ad.World, **options: str) -> tuple[list[list[int]], float]:
    mesh = make_mesh(world, 2, **options)
    total = ad.all_reduce(np.array([float(world.rank)]), group=mesh.group("tp"))
    return mesh.groups("tp"), float(total[0])


def test_make_mesh_keeps_tp_on_a_node_by_default(round_robin_nodes: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: no group crosses nodes
        results = ad.spawn(_mesh_and_sum, 4)
    assert all(groups == [[0, 2], [1, 3]] for groups, _ in results)
    assert [total for _, total in results] == [2.0, 4.0, 2.0, 4.0]


def test_make_mesh_warns_when_rank_order_crosses_nodes(round_robin_nodes: None) -> None:
    with pytest.warns(RuntimeWarning) as caught:
        results = ad.spawn(_mesh_and_sum, 4, placement="rank")
    assert all(groups == [[0, 1], [2, 3]] for groups, _ in results)
    text = str(caught[0].message)
    assert re.search(r"make_mesh: 2 tensor-parallel group\(s\) of tp_size=2 cross hosts "
                     r"\(\[0, 1\] spans node 0 \(.+\), node 1 \(.+\); \[2, 3\] spans", text), text
    assert "placement='node'" in text


def test_make_mesh_refuses_crossing_groups_on_request(round_robin_nodes: None) -> None:
    def body(world: ad.World) -> str:
        with pytest.raises(ValueError, match="cross_hosts='error' refused the mesh") as err:
            make_mesh(world, 2, placement="rank", cross_hosts="error")
        ad.barrier()  # still usable: no rank created a group
        return str(err.value)

    assert len(set(ad.spawn(body, 4))) == 1


def test_make_mesh_allows_crossing_groups_silently(round_robin_nodes: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = ad.spawn(_mesh_and_sum, 4, placement="rank", cross_hosts="allow")
    assert results[0][0] == [[0, 1], [2, 3]]


def test_make_mesh_rejects_unknown_choices() -> None:
    def body(world: ad.World) -> None:
        with pytest.raises(ValueError, match=r"make_mesh: placement='host' is not one of "
                                             r"Placement's names; use one of 'node', 'rank'"):
            make_mesh(world, 1, placement="host")
        with pytest.raises(ValueError, match=r"make_mesh: cross_hosts='never' .*'warn', "
                                             r"'error', 'allow'"):
            make_mesh(world, 1, cross_hosts="never")

    ad.spawn(body, 2)


@pytest.mark.parametrize("slots, n, tp, want, warns", [
    ([1, 1], 4, "2", "[[0, 2], [1, 3]]", False),  # round-robin placement: TP by host
    ([2, 1], None, "3", "[[0, 1, 2]]", True),  # uneven 2 + 1: one group must cross
], ids=["round-robin-2x2", "uneven-2+1"])
def test_make_mesh_on_two_hosts(cluster: SimCluster, slots: list[int], n: int | None, tp: str,
                                want: str, warns: bool) -> None:
    run = cluster.run(slots, ["-m", "mpi4py", CHECKS, "mesh_placement", tp], n=n, timeout=60)
    assert run.returncode == 0, run.tail()
    for text in run.ranks:
        assert f"TP GROUP {want}" in text, run.tail()
        warned = "WARNING RuntimeWarning: make_mesh: 1 tensor-parallel group(s)" in text
        assert warned == warns, run.tail()
        if warns:
            assert "spans node 0 (node0), node 1 (node1)" in text, run.tail()
