"""ClusterConfig.cluster_name: validated, and the scheduler actor's Ray name derived from it."""

from __future__ import annotations

import pytest

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.launcher import CLUSTER_NAMESPACE, scheduler_actor_name


def test_cluster_name_names_the_scheduler_actor() -> None:
    assert ClusterConfig(cluster_name="prod-1.a_b").cluster_name == "prod-1.a_b"
    assert ClusterConfig().cluster_name is None
    assert scheduler_actor_name("prod-1") == "pagedserve-scheduler-prod-1"
    assert CLUSTER_NAMESPACE == "pagedserve"


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "a/b"])
def test_bad_cluster_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="cluster_name"):
        ClusterConfig(cluster_name=bad)
