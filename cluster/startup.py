"""Bringing the worker actors up on a Ray cluster's nodes, from Ray's view of the cluster.

The launcher asks this module what each worker requests (CPUs or a GPU, plus the custom
resources of ``ClusterConfig.worker_resources`` that place it on chosen nodes), how many
CPUs a worker gets when ``cpus_per_worker`` is None (:func:`default_cpus_per_worker`),
whether ``device="auto"`` means CUDA (:func:`decide_cuda`), and whether the requests fit the
nodes at all (:func:`check_placeable`) before it waits ``startup_timeout_s`` for the
workers. Every start-up failure becomes one :class:`StartupError` whose message is one line
naming the node (IP and node id) and the cause: the CLI prints it as ``error: ...``.

The node view is ``ray.nodes()`` (alive nodes, their total resources); the functions take
it as a list of :class:`NodeView` so tests give fakes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.cluster.config import ClusterConfig
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.step_channel import StepChannelAddress
from pagedserve.worker.parallel import GroupBroken
from pagedserve.worker.worker import Worker as _Worker

log = logging.getLogger(__name__)

__all__ = [
    "NodeView",
    "StartupError",
    "Worker",
    "WorkerStartError",
    "check_placeable",
    "check_same_weights",
    "cluster_nodes",
    "decide_cuda",
    "default_cpus_per_worker",
    "describe_actor_death",
    "placement_problem",
    "wait_workers",
    "worker_request",
]


class StartupError(RuntimeError):
    """The cluster cannot start; the message is one line naming the node and the cause."""


@dataclass(frozen=True)
class NodeView:
    """One alive Ray node: ``node_id`` (hex), ``ip`` and its total ``resources``
    (``{"CPU": 8.0, "GPU": 1.0, "node_b": 1.0, ...}``, as ``ray.nodes()`` reports them)."""

    node_id: str
    ip: str
    resources: dict[str, float]

    def label(self) -> str:
        """``ip (node id prefix)``, the name errors use."""
        return f"{self.ip} (node {self.node_id[:12]})"


def cluster_nodes() -> list[NodeView]:
    """The alive nodes of the connected Ray cluster (``ray.nodes()``)."""
    import ray

    return [
        NodeView(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {})))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def _custom(config: ClusterConfig, wid: int) -> dict[str, float]:
    if not config.worker_resources:
        return {}
    res = config.worker_resources
    return dict(res[0] if len(res) == 1 else res[wid])


def worker_request(config: ClusterConfig, wid: int, cuda: bool, cpus: int) -> dict[str, Any]:
    """Ray actor options of worker ``wid``: ``num_cpus`` (``cpus``; 1 beside a GPU),
    ``num_gpus`` (1 on CUDA) and ``resources`` (its custom resources)."""
    opts: dict[str, Any] = {"num_gpus": 1, "num_cpus": 1} if cuda else {"num_cpus": cpus}
    custom = _custom(config, wid)
    if custom:
        opts["resources"] = custom
    return opts


def _as_demand(opts: dict[str, Any]) -> dict[str, float]:
    demand = {"CPU": float(opts.get("num_cpus", 0)), "GPU": float(opts.get("num_gpus", 0))}
    demand.update(opts.get("resources", {}))
    return {k: v for k, v in demand.items() if v > 0}


def _first_fit(nodes: Sequence[NodeView], demands: Sequence[dict[str, float]]) -> int | None:
    """Index of the first demand that no node has left room for, placing them in order
    on the first node that fits (Ray itself may pack better); None when all fit."""
    left = [dict(n.resources) for n in nodes]
    for i, demand in enumerate(demands):
        for free in left:
            if all(free.get(k, 0.0) >= v for k, v in demand.items()):
                for k, v in demand.items():
                    free[k] = free.get(k, 0.0) - v
                break
        else:
            return i
    return None


def default_cpus_per_worker(config: ClusterConfig, nodes: Sequence[NodeView]) -> int:
    """CPUs per CPU worker when ``cpus_per_worker`` is None: the largest whole number
    such that every worker, with its custom resources, fits on the alive nodes together
    (first fit over the nodes' total CPUs); 1 when even one CPU each does not fit (the
    placement check then names what is missing)."""
    most = int(max((n.resources.get("CPU", 0.0) for n in nodes), default=1.0))
    for cpus in range(max(most, 1), 0, -1):
        demands = [
            _as_demand(worker_request(config, w, False, cpus))
            for w in range(config.num_workers)
            for _ in range(config.tensor_parallel_size)
        ]
        if _first_fit(nodes, demands) is None:
            return cpus
    return 1


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"


def _shown(res: dict[str, float]) -> dict[str, float]:
    # Ray's bookkeeping resources (memory, node:<ip>, accelerator labels) only add noise.
    return {k: v for k, v in res.items() if k not in ("memory", "object_store_memory")
            and not k.startswith("node:")}  # fmt: skip


def placement_problem(
    nodes: Sequence[NodeView],
    requests: Sequence[dict[str, Any]],
    labels: Sequence[str] | None = None,
) -> str | None:
    """Why ``requests`` (Ray actor options; ``labels`` name them, default ``worker k``)
    cannot all be placed on ``nodes``, as one line naming the actor, its demand and the
    nodes; None when they fit."""
    bad = _first_fit(nodes, [_as_demand(r) for r in requests])
    if bad is None:
        return None
    demand = _as_demand(requests[bad])
    have = "; ".join(f"{n.label()} {_fmt(_shown(n.resources))}" for n in nodes) or "no alive node"
    alone = _first_fit(nodes, [demand]) is None
    why = f"does not fit beside the other {'workers' if labels is None else 'actors'}"
    why = why if alone else "fits no node"
    label = f"worker {bad}" if labels is None else labels[bad]
    return f"{label} requests {_fmt(demand)}, which {why}; nodes: {have}"


def check_placeable(
    requests: Sequence[dict[str, Any]],
    wait_s: float,
    nodes_fn: Callable[[], list[NodeView]] = cluster_nodes,
    sleep: Callable[[float], None] = time.sleep,
    labels: Sequence[str] | None = None,
) -> None:
    """Wait up to ``wait_s`` seconds (nodes still joining) for the alive nodes to hold
    every request (``labels``: as :func:`placement_problem`).

    Raises:
        StartupError: they still do not (the message names the actor and its demand).
    """
    deadline = time.monotonic() + wait_s
    while True:
        problem = placement_problem(nodes_fn(), requests, labels)
        if problem is None:
            return
        if time.monotonic() >= deadline:
            what = "the workers" if labels is None else "the cluster's actors"
            raise StartupError(f"cannot place {what}: {problem}")
        sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def decide_cuda(
    config: ClusterConfig,
    wait_s: float,
    nodes_fn: Callable[[], list[NodeView]] = cluster_nodes,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Whether the workers run on CUDA, from the GPUs of the cluster's alive nodes.

    ``device="cpu"``: no. ``"cuda"`` and ``"auto"``: wait up to ``wait_s`` seconds for
    ``num_workers`` GPUs (nodes still joining); ``"auto"`` then takes CPU workers when the
    cluster has no GPU at all (with a warning when it waited). A cluster with some GPUs but
    fewer than ``num_workers`` is an error either way (silently mixing or falling back
    would hide the missing nodes).

    Raises:
        StartupError: GPUs were asked for or seen, and fewer than ``num_workers`` joined.
    """
    if config.device == "cpu":
        return False
    need = config.num_workers * config.tensor_parallel_size
    deadline = time.monotonic() + wait_s
    while True:
        nodes = nodes_fn()
        gpus = sum(n.resources.get("GPU", 0.0) for n in nodes)
        if gpus >= need:
            return True
        if time.monotonic() >= deadline:
            break
        sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if config.device == "auto" and gpus == 0:
        if wait_s > 0:
            log.warning("no GPU joined the cluster within %.0f s: CPU workers", wait_s)
        return False
    with_gpu = ", ".join(n.label() for n in nodes if n.resources.get("GPU", 0.0) > 0) or "none"
    raise StartupError(
        f"device={config.device} needs {need} GPU(s); after {wait_s:g} s the cluster has "
        f"{gpus:g} (nodes with GPUs: {with_gpu})"
    )


_IP = re.compile(r"\bip[=:]\s*([0-9A-Fa-f.:]+)")


def describe_actor_death(wid: int, exc: BaseException) -> str:
    """One line for a worker actor that died while starting: its node and the cause.

    A :class:`Worker` that failed in its constructor names its node in its own error;
    otherwise (the process or node died) the node IP comes from Ray's message."""
    text = str(exc)
    marker = f"{WorkerStartError.__name__}: "
    if marker in text:
        return text.rsplit(marker, 1)[1].strip().splitlines()[0]
    match = _IP.search(text)
    where = f" on node {match.group(1)}" if match else ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    cause = lines[-1] if lines else type(exc).__name__
    return f"worker {wid}{where} died while starting: {cause}"


class WorkerStartError(RuntimeError):
    """A worker's constructor failed; the message names the worker, its node and the cause."""


class Worker(_Worker):
    """The :class:`pagedserve.worker.worker.Worker` as a Ray actor (its processes stay
    named ``ray::Worker``): a constructor that fails raises :class:`WorkerStartError`
    naming this node (IP and node id), and :meth:`node` tells where the worker runs.

    Once constructed it freezes the process's garbage collector heap (:func:`gc.freeze`):
    the objects of the libraries and the model (torch, Ray, the modules and their
    parameters) move to the permanent generation, so the collections the steps' short-lived
    tensors start no longer walk them (the process is the actor's alone)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
            gc.collect()
            gc.freeze()
        except Exception as exc:
            wid = getattr(args[0] if args else kwargs.get("config"), "worker_id", "?")
            cause = (str(exc).strip().splitlines() or [""])[0]
            error = WorkerStartError(
                f"worker {wid} on node {self.node()}: {type(exc).__name__}: {cause}"
            )
            if isinstance(exc, ValueError):  # a model or setting refused: no traceback needed
                raise error from None
            raise error from exc

    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        """The step; a broken tensor-parallel group ends the process, so Ray reports the
        actor dead and the scheduler requeues the logical worker's sequences."""
        try:
            return super().execute_model(so)
        except GroupBroken as exc:
            _exit_broken(exc)
            raise

    def follow(self) -> None:
        """:meth:`pagedserve.worker.worker.Worker.follow`; the process ends when the group
        breaks (rank 0 or another rank died)."""
        try:
            super().follow()
        except GroupBroken as exc:
            _exit_broken(exc)
            raise

    def open_step_channel(
        self, host: str | None = None, peer_node_id: str | None = None
    ) -> StepChannelAddress:
        """:meth:`pagedserve.worker.worker.Worker.open_step_channel` on ``host``; by
        default 127.0.0.1 when the scheduler runs on this node (``peer_node_id``, its Ray
        node id, is this one's), else this node's Ray address."""
        import ray

        if host is None:
            same_node = peer_node_id == ray.get_runtime_context().get_node_id()
            host = "127.0.0.1" if same_node else ray.util.get_node_ip_address()
        return super().open_step_channel(host)

    def node(self) -> str:
        """``ip (node id prefix)`` of the node this actor runs on."""
        import ray

        ctx = ray.get_runtime_context()
        return f"{ray.util.get_node_ip_address()} (node {ctx.get_node_id()[:12]})"


def _exit_broken(exc: GroupBroken) -> None:
    log.error("tensor-parallel group broken, this rank exits: %s", exc)
    os._exit(1)


async def wait_workers(
    workers: Sequence[Any], requests: Sequence[dict[str, Any]], timeout_s: float
) -> list[Any]:
    """The workers' ``get_info`` answers, within ``timeout_s`` seconds.

    Raises:
        StartupError: a worker died while starting (its node and cause), or did not answer
            in time (its request and the cluster's free resources named).
    """
    import ray

    calls = [asyncio.ensure_future(_info(w)) for w in workers]
    done, pending = await asyncio.wait(
        calls, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION
    )
    for call in pending:
        call.cancel()
    for wid, call in enumerate(calls):
        if call in done and call.exception() is not None:
            exc = call.exception()
            if isinstance(exc, ray.exceptions.RayActorError):
                raise StartupError(describe_actor_death(wid, exc)) from None
            raise StartupError(f"worker {wid}: {type(exc).__name__}: {exc}") from exc
    if pending:
        late = [wid for wid, call in enumerate(calls) if call in pending]
        free = _fmt(_shown({k: float(v) for k, v in ray.available_resources().items()}))
        asks = ", ".join(f"worker {w} {_fmt(_as_demand(requests[w]))}" for w in late)
        raise StartupError(
            f"workers not started within {timeout_s:g} s (startup_timeout_s): {asks}; "
            f"the cluster has {free} free"
        )
    return [call.result() for call in calls]


async def _info(worker: Any) -> tuple[Any, str]:
    info, node = await asyncio.gather(worker.get_info.remote(), worker.node.remote())
    return info, node


def check_same_weights(infos: Sequence[Any], nodes: Sequence[str], driver_digest: str) -> None:
    """Every worker's ``weights_digest`` must equal the driver's (the tokenizer's model).

    Raises:
        StartupError: naming the first worker (and its node) whose weights differ.
    """
    for info, node in zip(infos, nodes, strict=True):
        if info.weights_digest != driver_digest:
            raise StartupError(
                f"worker {info.worker_id} on node {node} has other weights than the driver's "
                f"model (sha256 {info.weights_digest[:16]} vs {driver_digest[:16]}): "
                "give every node the same model files"
            )
