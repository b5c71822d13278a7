"""Worker start-up on a Ray cluster (cluster/startup.py): CPUs and device from Ray's view
of the nodes, placement checks, and one-line errors naming the node (fake nodes)."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest

from pagedserve.cluster.cli import build_parser, serve_config
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.startup import (
    NodeView,
    StartupError,
    check_placeable,
    check_same_weights,
    decide_cuda,
    default_cpus_per_worker,
    describe_actor_death,
    placement_problem,
    worker_request,
)

A = NodeView("a" * 56, "10.0.0.1", {"CPU": 1.0, "node_a": 1.0, "memory": 1e9})
B = NodeView("b" * 56, "10.0.0.2", {"CPU": 1.0, "node_b": 1.0})
BIG = NodeView("c" * 56, "10.0.0.3", {"CPU": 5.0})
MID = NodeView("d" * 56, "10.0.0.4", {"CPU": 3.0})
GPU = NodeView("e" * 56, "10.0.0.5", {"CPU": 8.0, "GPU": 2.0})


def _cfg(**kw: object) -> ClusterConfig:
    return ClusterConfig(cpus_per_worker=None, **kw)  # type: ignore[arg-type]


def test_cpus_per_worker_comes_from_the_nodes_not_this_machine() -> None:
    assert default_cpus_per_worker(_cfg(num_workers=1), [A, B]) == 1
    assert default_cpus_per_worker(_cfg(num_workers=1), [BIG, MID]) == 5
    # 5 + 3 CPUs, two workers: 4 each would not fit on the 3-CPU node; 3 each does.
    assert default_cpus_per_worker(_cfg(num_workers=2), [BIG, MID]) == 3
    assert default_cpus_per_worker(_cfg(num_workers=3), [BIG, MID]) == 2
    # Placed by custom resource: only node_b's CPUs count for a worker pinned there.
    pinned = _cfg(num_workers=1, worker_resources=({"node_b": 1},))
    assert default_cpus_per_worker(pinned, [BIG, B]) == 1


def test_worker_request_carries_cpus_gpu_and_custom_resources() -> None:
    cfg = _cfg(num_workers=2, worker_resources=({"node_a": 1}, {"node_b": 0.5}))
    assert worker_request(cfg, 1, cuda=False, cpus=3) == {
        "num_cpus": 3,
        "resources": {"node_b": 0.5},
    }
    assert worker_request(cfg, 0, cuda=True, cpus=3) == {
        "num_gpus": 1,
        "num_cpus": 1,
        "resources": {"node_a": 1},
    }
    assert worker_request(_cfg(), 0, cuda=False, cpus=2) == {"num_cpus": 2}


def test_infeasible_request_is_named_with_the_nodes() -> None:
    problem = placement_problem([A, B], [{"num_cpus": 2}])
    assert problem is not None
    assert "worker 0 requests {CPU: 2}, which fits no node" in problem
    assert "10.0.0.1 (node aaaaaaaaaaaa) {CPU: 1, node_a: 1}" in problem  # memory hidden
    together = placement_problem([A], [{"num_cpus": 1}, {"num_cpus": 1}])
    assert together is not None and "worker 1" in together and "beside the other" in together
    assert placement_problem([A, B], [{"num_cpus": 1, "resources": {"node_b": 1}}]) is None
    missing = placement_problem([A, B], [{"num_cpus": 1, "resources": {"node_c": 1}}])
    assert missing is not None and "node_c: 1" in missing


def test_check_placeable_waits_for_joining_nodes_then_fails() -> None:
    views = [[A], [A], [A, B]]
    slept: list[float] = []

    def nodes() -> list[NodeView]:
        return views.pop(0) if len(views) > 1 else views[0]

    check_placeable([{"num_cpus": 1, "resources": {"node_b": 1}}], 30, nodes, slept.append)
    assert len(slept) == 2
    with pytest.raises(StartupError, match="cannot place the workers: worker 0 requests"):
        check_placeable([{"num_cpus": 4}], 0, lambda: [A, B], slept.append)


def test_device_auto_decides_from_the_cluster_gpus() -> None:
    never = lambda _s: None  # noqa: E731
    assert decide_cuda(_cfg(num_workers=2), 0, lambda: [A, GPU], never) is True
    assert decide_cuda(_cfg(num_workers=1), 0, lambda: [A, B], never) is False
    assert decide_cuda(_cfg(device="cpu"), 0, lambda: [GPU], never) is False
    with pytest.raises(StartupError, match=r"needs 3 GPU\(s\).*has 2 .*10\.0\.0\.5"):
        decide_cuda(_cfg(num_workers=3), 0, lambda: [GPU], never)
    with pytest.raises(StartupError, match="device=cuda needs 1 GPU"):
        decide_cuda(_cfg(device="cuda"), 0, lambda: [A], never)


def test_device_auto_waits_for_gpu_nodes_still_joining() -> None:
    views = [[A], [A], [A, GPU]]
    slept: list[float] = []

    def nodes() -> list[NodeView]:
        return views.pop(0) if len(views) > 1 else views[0]

    assert decide_cuda(_cfg(num_workers=2), 60, nodes, slept.append) is True
    assert len(slept) == 2


def test_actor_death_becomes_one_line_naming_the_node() -> None:
    init_failed = RuntimeError(
        "The actor died because of an error raised in its creation task, ray::Worker."
        "__init__() (pid=1, ip=10.0.0.2, actor_id=ab)\n  File x, line 1\n"
        "pagedserve.cluster.startup.WorkerStartError: worker 0 on node 10.0.0.2 (node bbbb): "
        "ModelStoreError: model '/m' does not exist\n"
    )
    assert describe_actor_death(0, init_failed) == (
        "worker 0 on node 10.0.0.2 (node bbbb): ModelStoreError: model '/m' does not exist"
    )
    died = RuntimeError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: Worker\n"
        "\tip: 10.0.0.2\nThe actor is dead because its node has died."
    )
    assert describe_actor_death(1, died) == (
        "worker 1 on node 10.0.0.2 died while starting: "
        "The actor is dead because its node has died."
    )


def test_workers_with_other_weights_are_refused() -> None:
    infos = [
        types.SimpleNamespace(worker_id=w, weights_digest=d)
        for w, d in [(0, "x" * 64), (1, "y" * 64)]
    ]
    check_same_weights(infos[:1], ["10.0.0.1 (node a)"], "x" * 64)
    with pytest.raises(StartupError, match=r"worker 1 on node 10\.0\.0\.2 \(node b\) has other"):
        check_same_weights(infos, ["10.0.0.1 (node a)", "10.0.0.2 (node b)"], "x" * 64)


def test_config_validates_worker_resources_and_time_limits() -> None:
    with pytest.raises(ValueError, match="one per worker"):
        ClusterConfig(num_workers=3, worker_resources=({"a": 1}, {"b": 1}))
    with pytest.raises(ValueError, match="only custom resources"):
        ClusterConfig(worker_resources=({"CPU": 1},))
    with pytest.raises(ValueError, match="must be > 0"):
        ClusterConfig(worker_resources=({"a": 0},))
    with pytest.raises(ValueError, match="startup_timeout_s"):
        ClusterConfig(startup_timeout_s=0)
    with pytest.raises(ValueError, match="node_wait_s"):
        ClusterConfig(node_wait_s=-1)
    cfg = ClusterConfig(cpus_per_worker=None)
    assert dataclasses.replace(cfg, cpus_per_worker=3).worker_config(0).num_threads == 3


def test_serve_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--workers", "2", "--worker-resources", '[{"node_a": 1}, {"node_b": 1}]',
         "--startup-timeout", "45", "--node-wait", "3"]
    )  # fmt: skip
    cfg = serve_config(args)
    assert cfg.worker_resources == ({"node_a": 1.0}, {"node_b": 1.0})
    assert (cfg.startup_timeout_s, cfg.node_wait_s, cfg.cpus_per_worker) == (45.0, 3.0, None)
    one = serve_config(build_parser().parse_args(["serve", "--worker-resources", '{"pool": 2}']))
    assert one.worker_resources == ({"pool": 2.0},)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--worker-resources", "[1]"])


class _Method:
    def __init__(self, fn: object) -> None:
        self.fn = fn

    def remote(self) -> object:
        return self.fn()  # type: ignore[operator]


class _FakeWorker:
    """An actor handle whose ``get_info`` / ``node`` calls are coroutines."""

    def __init__(self, wid: int, delay_s: float = 0.0, error: BaseException | None = None) -> None:
        async def info() -> object:
            await asyncio.sleep(delay_s)
            if error is not None:
                raise error
            return types.SimpleNamespace(worker_id=wid, weights_digest="d")

        async def node() -> str:
            return f"10.0.0.{wid + 1} (node {wid})"

        self.get_info, self.node = _Method(info), _Method(node)


def test_wait_workers_names_late_workers_and_dead_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from pagedserve.cluster.startup import wait_workers

    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 1.0, "memory": 5.0})
    requests = [{"num_cpus": 1}, {"num_cpus": 2, "resources": {"node_b": 1}}]
    answers = asyncio.run(wait_workers([_FakeWorker(0), _FakeWorker(1)], requests, 5))
    assert [node for _, node in answers] == ["10.0.0.1 (node 0)", "10.0.0.2 (node 1)"]
    with pytest.raises(StartupError) as late:
        asyncio.run(wait_workers([_FakeWorker(0), _FakeWorker(1, delay_s=30)], requests, 0.2))
    assert str(late.value) == (
        "workers not started within 0.2 s (startup_timeout_s): worker 1 {CPU: 2, node_b: 1}; "
        "the cluster has {CPU: 1} free"
    )
    died = ray.exceptions.ActorDiedError()
    slow_then_dead = [_FakeWorker(0, delay_s=30), _FakeWorker(1, error=died)]
    with pytest.raises(StartupError, match=r"^worker 1 died while starting: The actor died"):
        asyncio.run(wait_workers(slow_then_dead, requests, 20))


def test_the_scheduler_resources_are_checked_with_the_workers() -> None:
    labels = ["worker 0", "the scheduler"]
    fits = [{"num_cpus": 1}, {"num_cpus": 0, "resources": {"node_b": 1}}]
    assert placement_problem([A, B], fits, labels) is None
    absent = [{"num_cpus": 1}, {"num_cpus": 0, "resources": {"sched": 1}}]
    problem = placement_problem([A, B], absent, labels)
    assert problem is not None and problem.startswith("the scheduler requests {sched: 1}")
    with pytest.raises(StartupError, match="cannot place the cluster's actors: the scheduler"):
        check_placeable(absent, 0, lambda: [A, B], lambda _s: None, labels=labels)


def test_config_and_cli_validate_scheduler_resources() -> None:
    from pagedserve.cluster.cli import build_parser, serve_config

    with pytest.raises(ValueError, match="scheduler_resources names 'CPU'"):
        ClusterConfig(scheduler_resources={"CPU": 1})
    with pytest.raises(ValueError, match=r"scheduler_resources\['s'\] must be > 0"):
        ClusterConfig(scheduler_resources={"s": 0})
    with pytest.raises(ValueError, match="at least one"):
        ClusterConfig(scheduler_resources={})
    args = build_parser().parse_args(["serve", "--scheduler-resources", '{"node_b": 1}'])
    assert serve_config(args).scheduler_resources == {"node_b": 1.0}
    assert serve_config(build_parser().parse_args(["serve"])).scheduler_resources is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--scheduler-resources", '[{"a": 1}]'])


def test_swap_space_defaults_to_4_gib_under_tensor_parallelism_too() -> None:
    from pagedserve.cluster.cli import build_parser, serve_config

    def config(*argv: str) -> ClusterConfig:
        return serve_config(build_parser().parse_args(["serve", *argv]))

    assert config().swap_space == 4 << 30
    tp = config("--tensor-parallel-size", "2")
    assert tp.swap_space == 4 << 30 and tp.tensor_parallel_size == 2
    assert tp.scheduler.preemption_mode == "auto"
    assert config("--swap-space", "1").swap_space == 1 << 30
    assert config("--tensor-parallel-size", "2", "--swap-space", "1").swap_space == 1 << 30
    assert config("--tensor-parallel-size", "2", "--swap-space", "0").swap_space == 0
