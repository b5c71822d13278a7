"""The worker: the object each Ray worker actor wraps (kept Ray-free for direct use in tests).

The cluster launcher creates it with ``ray.remote(num_cpus=...)(Worker).remote(config)``;
tests construct it directly. All model and cache work is delegated to
:class:`~pagedserve.worker.model_runner.ModelRunner`.
"""

from __future__ import annotations

import dataclasses
import sys

from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.worker.config import WorkerConfig
from pagedserve.worker.model_runner import ModelRunner, WorkerInfo


def ray_node_id() -> str:
    """The Ray node id (hex) of this process when it runs inside Ray, else ``""`` (Ray is
    not imported here: a worker constructed directly stays Ray-free)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return ""
    return str(ray.get_runtime_context().get_node_id())


class Worker:
    """One model replica with its paged KV pool.

    Args:
        config: worker settings; the model is resolved (downloaded/converted if needed),
            loaded, and the KV pool allocated in the constructor.

    Raises:
        ValueError: see :class:`ModelRunner`.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)

    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        """Run one scheduler step and return the sampled tokens."""
        return self.runner.execute_model(so)

    def get_info(self) -> WorkerInfo:
        """Pool size, block size, context length, vocabulary, EOS ids, device, dtype and
        the Ray node it runs on (:func:`ray_node_id`)."""
        return dataclasses.replace(self.runner.get_info(), node_id=ray_node_id())

    def reset(self) -> None:
        """Forget every sequence's state (the KV pool's contents become garbage): a
        restarted scheduler starts empty and reuses none of them."""
        self.runner.seqs.clear()

    def connect_host_store(self, address: str) -> None:
        """Swap to and from the host block store at ``address`` (``host:port``)."""
        self.runner.connect_host_store(address)

    def measure_swap_costs(self, prefill_tokens: int = 128) -> tuple[float, float]:
        """``(swap bandwidth in bytes/s, prefill seconds per token)`` measured on this
        worker's model and hardware (before serving; see
        :meth:`ModelRunner.measure_swap_bandwidth` and
        :meth:`ModelRunner.measure_prefill_s_per_token`).

        Raises:
            SwapError: the host store is not connected or fails.
        """
        bandwidth = self.runner.measure_swap_bandwidth()
        return bandwidth, self.runner.measure_prefill_s_per_token(prefill_tokens)

    def measure_pull_bandwidth(self, address: str) -> float:
        """Bytes/s of this worker's transfers through another node's store at ``address``
        (before serving; :meth:`ModelRunner.measure_pull_bandwidth`).

        Raises:
            SwapError: that store cannot be reached, or it fails.
        """
        return self.runner.measure_pull_bandwidth(address)

    def ping(self) -> str:
        """Liveness check; returns ``"pong"``."""
        return "pong"
