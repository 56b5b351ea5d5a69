"""Fixtures of the cluster tests: a simulated 2-host cluster, or a skip saying why not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from axondist.launching.worlds import launched_by_mpi
from cluster.simcluster import SimCluster, why_no_cluster


@pytest.fixture(scope="session")
def cluster_ready() -> None:
    """Skip (with the reason) where namespaces cannot be made, or under mpiexec."""
    if launched_by_mpi():
        pytest.skip("already under mpiexec: the cluster tests start their own jobs")
    reason = why_no_cluster()
    if reason is not None:
        pytest.skip(f"no simulated cluster: {reason}")


@pytest.fixture(scope="session")
def cluster(cluster_ready: None) -> Iterator[SimCluster]:
    """Two hosts, node0 and node1, built once and shared by every test of the session that
    asks for it (they must not break it: a test that cuts a link, refuses logins or kills a
    launcher builds its own, :func:`fresh_cluster`)."""
    with SimCluster(hosts=2) as built:
        yield built


@pytest.fixture
def fresh_cluster(cluster_ready: None) -> Iterator[SimCluster]:
    """Two hosts of the test's own, for tests that break links or kill ranks."""
    with SimCluster(hosts=2) as built:
        yield built
