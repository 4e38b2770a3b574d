"""Fixtures of the cluster suite: a 3-node test cluster (tests/cluster/harness.py,
docs/cluster-harness.md), skipped with the reason where namespaces cannot be made."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.harness import Cluster, cannot_make_namespaces, sweep  # noqa: E402


@pytest.fixture(scope="session")
def cluster_reason():
    """Why no cluster can be made here, or None; leftovers of killed runs are swept first."""
    reason = cannot_make_namespaces()
    if reason is None:
        sweep()
    return reason


@pytest.fixture(scope="module")
def cluster3(cluster_reason):
    """Three nodes n1, n2, n3 for one test module; torn down (nothing left) after it."""
    if cluster_reason:
        pytest.skip(cluster_reason)
    with Cluster(3) as c:
        yield c


@pytest.fixture
def make_cluster(cluster_reason):
    """A factory of clusters owned by one test, all torn down at its end, even on failure."""
    if cluster_reason:
        pytest.skip(cluster_reason)
    made = []

    def make(n=3, **kw):
        c = Cluster(n, **kw)
        made.append(c)
        return c.start()
    yield make
    errors = []
    for c in made:
        try:
            c.close()
        except Exception as e:  # noqa: BLE001 - every cluster is torn down; the first error is raised
            errors.append(e)
    if errors:
        raise errors[0]
