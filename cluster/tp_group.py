"""A logical worker of ``tensor_parallel_size`` T > 1: T rank actors in one Ray placement
group, joined in one torch.distributed group (:mod:`pagedserve.worker.parallel`).

The placement group is ``STRICT_PACK`` (all ranks on one node: NVLink between GPUs, or the
loopback for gloo on CPU), one bundle per rank with the worker's request. The rendezvous
is ``tcp://<that node's IP>:<port>``. Rank 0 is the actor the scheduler talks to (its
``WorkerHandle``); it broadcasts every step to the other ranks over the group, which sit
in ``follow()`` (one Ray call that returns when rank 0 leaves). The step travels over the
group rather than as a Ray call from rank 0 to each rank: the ranks then need no handles of
one another, the worker stays Ray-free, and a step costs one pickled broadcast instead of
T - 1 actor calls.

A death of any rank breaks the group: the next collective of every other rank raises
``GroupBroken`` and :class:`pagedserve.cluster.startup.Worker` exits the process, so rank 0
dies too and the scheduler requeues the logical worker's sequences (``WorkerDied``). The
ranks are not restarted (``max_restarts=0``): a group is rebuilt whole or not at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

from pagedserve.worker.config import ParallelConfig, WorkerConfig

# Ports the rendezvous picks from on the group's node (above the usual ephemeral range's
# start, below Ray's worker ports).
_PORTS = (20000, 29999)


@dataclasses.dataclass
class RankGroup:
    """The actors of one logical worker: ``driver`` (rank 0) and the ``followers``, their
    ``follow()`` calls in flight, and the placement group holding them."""

    driver: Any
    followers: list[Any]
    follows: list[Any]
    placement_group: Any

    def kill(self) -> None:
        """Kill every rank and remove the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in (self.driver, *self.followers):
            ray.kill(actor)
        remove_placement_group(self.placement_group)


async def start_rank_group(
    worker_cls: Any,
    config: WorkerConfig,
    size: int,
    request: dict[str, Any],
    name: str,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> RankGroup:
    """Place ``size`` ranks with ``request`` each on one node and create them (``env``:
    environment variables of their processes, through Ray's ``runtime_env``).

    Rank 0 is named ``name``, rank r ``name-rank{r}``. Returns once the actors are created
    (their constructors, which join the group, still run: wait on the driver's
    ``get_info``), with the followers' ``follow()`` already called.

    Raises:
        TimeoutError: the placement group was not placed within ``timeout_s``.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": float(request.get("num_cpus", 0)), "GPU": float(request.get("num_gpus", 0))}
    bundle.update(request.get("resources", {}))
    # NOTE: a bundle may not be empty; a rank that reserves nothing (cpus_per_worker 0)
    # holds a token byte of Ray's memory resource, which stays placeable when other
    # actors hold every CPU.
    bundle = {k: v for k, v in bundle.items() if v > 0} or {"memory": 1.0}
    pg = placement_group([dict(bundle) for _ in range(size)], strategy="STRICT_PACK")
    try:
        await asyncio.wait_for(pg.ready(), timeout=timeout_s)
    except BaseException:
        remove_placement_group(pg)
        raise
    node = ray.util.placement_group_table(pg)["bundles_to_node_id"][0]
    ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
    init = f"tcp://{ip}:{random.randint(*_PORTS)}"
    actors = []
    for rank in range(size):
        parallel = ParallelConfig(size, rank, init)
        opts = {k: v for k, v in request.items() if k not in ("num_cpus", "num_gpus", "resources")}
        actors.append(
            worker_cls.options(
                name=name if rank == 0 else f"{name}-rank{rank}",
                max_concurrency=1,
                max_restarts=0,
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0),
                memory=bundle.get("memory"),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, rank),
                **opts,
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote(dataclasses.replace(config, parallel=parallel))
        )
    follows = [a.follow.remote() for a in actors[1:]]
    return RankGroup(actors[0], actors[1:], follows, pg)
