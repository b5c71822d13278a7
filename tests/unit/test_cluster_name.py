"""ClusterConfig.cluster_name (validated; the scheduler actor's Ray name derived from it) and
the serve flags for attaching and step deadlines."""

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


def test_serve_flags_for_attach_and_step_deadlines_parse() -> None:
    from pagedserve.cluster.cli import build_parser, serve_config

    parser = build_parser()
    args = parser.parse_args(["serve"])
    cfg = serve_config(args)
    assert args.attach is None and cfg.cluster_name == "default"
    assert (cfg.scheduler.step_deadline_floor_s, cfg.scheduler.step_deadline_factor) == (30, 20)
    args = parser.parse_args(
        [
            "serve",
            "--attach",
            "10.0.0.1:6379",
            "--cluster-name",
            "prod",
            "--step-deadline-floor",
            "5",
            "--step-deadline-factor",
            "0",
        ]
    )
    cfg = serve_config(args)
    assert (args.attach, cfg.cluster_name) == ("10.0.0.1:6379", "prod")
    assert (cfg.scheduler.step_deadline_floor_s, cfg.scheduler.step_deadline_factor) == (5, 0)
    with pytest.raises(ValueError, match="step_deadline_floor_s"):
        serve_config(parser.parse_args(["serve", "--step-deadline-floor", "-1"]))
