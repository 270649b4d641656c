"""The high-availability PostgreSQL (tests.ha.cluster) as fixtures.

Without Patroni or etcd on the machine these tests skip with one line, except on CI
(`CI=true`), where they fail. A cluster is shared by the tests of one module (starting one
takes about ten seconds) and removed after them, so that no cluster runs beside another
module's, nor beside the rest of the suite (its WAL and checkpoints compete for the disk with
the tests' own PostgreSQL); a test that breaks it leaves it whole again (the killed node
rejoined).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.ha.cluster import MISSING, Cluster, available, make_root


def need_cluster() -> None:
    if not available():
        if os.environ.get("CI") == "true":
            pytest.fail(MISSING)
        pytest.skip(MISSING)


def start_cluster(size: int, synchronous: bool) -> Cluster:
    """A running cluster. One that elects no primary in time is removed and started anew,
    once: a bootstrap now and then stalls on a shared machine, and these tests are about the
    gateway, not Patroni's first election."""
    need_cluster()
    try:
        return _started(size, synchronous)
    except TimeoutError:
        return _started(size, synchronous)


def _started(size: int, synchronous: bool) -> Cluster:
    cluster = Cluster(make_root(), size=size, synchronous=synchronous)
    try:
        cluster.start()
    except BaseException:
        cluster.close()
        raise
    return cluster


@pytest.fixture(scope="module")
def async_cluster() -> Iterator[Cluster]:
    """Two nodes, asynchronous replication (Patroni's default)."""
    cluster = start_cluster(2, synchronous=False)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def sync_cluster() -> Iterator[Cluster]:
    """Three nodes under `synchronous_mode_strict`: a kill of the primary leaves a
    synchronous pair."""
    cluster = start_cluster(3, synchronous=True)
    yield cluster
    cluster.close()
