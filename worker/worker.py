"""The worker: the object each Ray worker actor wraps (kept Ray-free for direct use in tests).

The cluster launcher creates it with ``ray.remote(num_cpus=...)(Worker).remote(config)``;
tests construct it directly. All model and cache work is delegated to
:class:`~pagedserve.worker.model_runner.ModelRunner`.

Under tensor parallelism (``config.parallel``) a logical worker is ``T`` of these, one per
rank: rank 0 is the one the scheduler talks to, and it broadcasts each call that touches
the model or the sequences (:meth:`Worker.execute_model`, :meth:`Worker.reset`) over the
group before running it; the other ranks sit in :meth:`Worker.follow`, running what rank 0
broadcasts, until :meth:`Worker.leave`. The swap set-up is broadcast too: every rank connects
its own client to the host block store (:meth:`Worker.connect_host_store`) and takes part in
the probes (:meth:`Worker.measure_swap_costs`, :meth:`Worker.measure_pull_bandwidth`).

The scheduler sends the steps on the worker's step channel (:meth:`Worker.open_step_channel`,
a TCP connection the model thread serves) and every other call through Ray. Every
call that touches the model or the sequences runs on the worker's model thread
(:class:`~pagedserve.worker.model_thread.ModelThread`, where the model was built), one at
a time, whichever thread it came on.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.step_channel import StepChannelAddress
from pagedserve.worker.config import WorkerConfig
from pagedserve.worker.kv_swap import SwapError
from pagedserve.worker.model_runner import ModelRunner, WorkerInfo
from pagedserve.worker.model_thread import ModelThread
from pagedserve.worker.step_channel import StepChannelServer

log = logging.getLogger(__name__)


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
        self.model_thread = ModelThread()
        try:
            self.runner = self.model_thread.call(ModelRunner, config)
        except BaseException:
            self.model_thread.close()
            raise
        self._channel: StepChannelServer | None = None

    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        """Run one scheduler step (on the model thread) and return the sampled tokens.

        Raises:
            GroupBroken: under tensor parallelism, a rank of the group is gone.
        """
        return self.model_thread.call(self._execute_model, so)

    def _execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        self._tell_followers("execute", so)
        return self.runner.execute_model(so)

    def open_step_channel(self, host: str = "127.0.0.1") -> StepChannelAddress:
        """Serve :meth:`execute_model` on a new step channel listening on ``host``
        (:mod:`pagedserve.worker.step_channel`), ending the previous one; returns its
        address and secret.

        Raises:
            OSError: ``host`` cannot be bound.
        """
        if self._channel is None:
            self._channel = StepChannelServer(self.execute_model, host, self.model_thread)
        return self._channel.open(host)

    def close(self) -> None:
        """End the step channel and stop the model thread once its calls have run;
        every model call raises RuntimeError after (idempotent)."""
        if self._channel is not None:
            self._channel.close()
        self.model_thread.close()

    def follow(self) -> None:
        """On a rank other than 0: run the calls rank 0 broadcasts, in order, until it
        leaves. A step refused with ``ValueError`` is refused on rank 0 too (the same
        checks on the same state), and a swap probe's ``SwapError`` fails rank 0's too (the
        ranks agree on it), so the loop goes on.

        Raises:
            RuntimeError: called on rank 0.
            GroupBroken: rank 0 (or another rank) is gone.
        """
        self.model_thread.call(self._follow)

    def _follow(self) -> None:
        group = self.runner.group
        if group.is_driver:
            raise RuntimeError("follow() runs on the ranks other than 0")
        while True:
            method, *args = group.broadcast_object(None)
            if method == "leave":
                group.leave()
                return
            try:
                if method == "execute":
                    self.runner.execute_model(*args)
                elif method == "reset":
                    self.runner.seqs.clear()
                elif method == "connect":
                    self.runner.connect_host_store(*args)
                elif method == "measure_swap":
                    self._measure_swap_costs(*args)
                elif method == "measure_pull":
                    self.runner.measure_pull_bandwidth(*args)
            except (ValueError, SwapError) as exc:
                log.warning("rank %d: %s failed: %s", group.rank, method, exc)

    def leave(self) -> None:
        """On rank 0: release the other ranks from :meth:`follow` and leave the group
        (nothing without tensor parallelism)."""
        self.model_thread.call(self._leave)

    def _leave(self) -> None:
        self._tell_followers("leave")
        self.runner.group.leave()

    def _tell_followers(self, method: str, *args: object) -> None:
        if self.runner.group.size > 1:
            self.runner.group.broadcast_object((method, *args))

    def get_info(self) -> WorkerInfo:
        """Pool size, block size, context length, vocabulary, EOS ids, device, dtype and
        the Ray node it runs on (:func:`ray_node_id`)."""
        return dataclasses.replace(self.runner.get_info(), node_id=ray_node_id())

    def reset(self) -> None:
        """Forget every sequence's state (the KV pool's contents become garbage): a
        restarted scheduler starts empty and reuses none of them."""
        self.model_thread.call(self._reset)

    def _reset(self) -> None:
        if self._channel is not None:
            self._channel.invalidate()  # steps of the previous scheduler's view: dropped
        self._tell_followers("reset")
        self.runner.seqs.clear()

    def connect_host_store(self, address: str) -> None:
        """Swap to and from the host block store at ``address`` (``host:port``); under
        tensor parallelism every rank connects (the ranks of a group share one node)."""
        self.model_thread.call(self._connect_host_store, address)

    def _connect_host_store(self, address: str) -> None:
        self._tell_followers("connect", address)
        self.runner.connect_host_store(address)

    def measure_swap_costs(self, prefill_tokens: int = 128) -> tuple[float, float]:
        """``(swap bandwidth in bytes/s, prefill seconds per token)`` measured on this
        worker's model and hardware (before serving; see
        :meth:`ModelRunner.measure_swap_bandwidth` and
        :meth:`ModelRunner.measure_prefill_s_per_token`); under tensor parallelism the
        group's, every rank taking part.

        Raises:
            SwapError: the host store is not connected or fails (on any rank).
            GroupBroken: under tensor parallelism, a rank of the group is gone.
        """
        return self.model_thread.call(self._tell_and_measure_swap_costs, prefill_tokens)

    def _tell_and_measure_swap_costs(self, prefill_tokens: int) -> tuple[float, float]:
        self._tell_followers("measure_swap", prefill_tokens)
        return self._measure_swap_costs(prefill_tokens)

    def _measure_swap_costs(self, prefill_tokens: int) -> tuple[float, float]:
        bandwidth = self.runner.measure_swap_bandwidth()
        return bandwidth, self.runner.measure_prefill_s_per_token(prefill_tokens)

    def measure_pull_bandwidth(self, address: str) -> float:
        """Bytes/s of this worker's transfers through another node's store at ``address``
        (before serving; :meth:`ModelRunner.measure_pull_bandwidth`; the group's under
        tensor parallelism).

        Raises:
            SwapError: that store cannot be reached, or it fails (on any rank).
            GroupBroken: under tensor parallelism, a rank of the group is gone.
        """
        return self.model_thread.call(self._measure_pull_bandwidth, address)

    def _measure_pull_bandwidth(self, address: str) -> float:
        self._tell_followers("measure_pull", address)
        return self.runner.measure_pull_bandwidth(address)

    def ping(self) -> str:
        """Liveness check; returns ``"pong"``."""
        return "pong"
