"""The ranks other than 0 of a tensor-parallel worker as local processes (no Ray): what the
offline API (``pagedserve.LLM(tensor_parallel_size=T)``) runs beside its in-process rank 0.

:func:`start_local_ranks` spawns ranks ``1..T-1`` (``torch.multiprocessing``, ``spawn``),
each building its :class:`~pagedserve.worker.worker.Worker` and following rank 0
(:meth:`~pagedserve.worker.worker.Worker.follow`); the rendezvous is a free port on
127.0.0.1. The caller then builds rank 0 from :attr:`LocalRanks.config` (its constructor
completes the group) and calls :meth:`LocalRanks.close` after rank 0's ``leave()``.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from pagedserve.worker.config import ParallelConfig, WorkerConfig


def _follow(config: WorkerConfig) -> None:
    from pagedserve.worker.worker import Worker

    Worker(config).follow()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalRanks:
    """The follower processes of one group and rank 0's config (``parallel`` set)."""

    config: WorkerConfig
    processes: list[Any]

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait ``timeout_s`` for the followers to exit (after rank 0's ``leave()``), then
        kill those still alive."""
        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(5)


def start_local_ranks(config: WorkerConfig, size: int, timeout_s: float = 600.0) -> LocalRanks:
    """Spawn ranks ``1..size-1`` of ``config``'s worker; ``timeout_s`` bounds every
    collective (the rendezvous included).

    Raises:
        ValueError: ``size`` < 2.
    """
    if size < 2:
        raise ValueError(f"start_local_ranks needs size >= 2, got {size}")
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, size):
        cfg = dataclasses.replace(config, parallel=ParallelConfig(size, rank, init, timeout_s))
        p = ctx.Process(target=_follow, args=(cfg,), daemon=True)
        p.start()
        procs.append(p)
    rank0 = dataclasses.replace(config, parallel=ParallelConfig(size, 0, init, timeout_s))
    return LocalRanks(rank0, procs)
