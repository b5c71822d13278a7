"""Configuration of the serving cluster: the frontend and the whole-cluster composition.

Each layer owns its config (:mod:`pagedserve.worker.config`: model, KV pool, worker;
:mod:`pagedserve.scheduler.config`: batching policy); :class:`ClusterConfig` composes them
with the launcher's own settings. Frozen dataclasses validated in ``__post_init__``
(``ValueError`` naming the field).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig

__all__ = ["CacheConfig", "ClusterConfig", "ModelConfig", "SchedulerConfig", "ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    """The frontends: gRPC, and HTTP (``/metrics``, ``/health``) on the same host.

    Attributes:
        host: interface to bind (127.0.0.1 by default; never 0.0.0.0 unless asked).
        port: gRPC TCP port; 0 picks a free one.
        max_message_bytes: gRPC send/receive limit.
        http_port: HTTP TCP port; 0 picks a free one; None serves no HTTP (the library
            default, so embedded clusters take no fixed port; ``pagedserve serve`` defaults
            to 8000).
        served_model_name: the ``model`` name of the OpenAI-compatible API (``None``: the
            model folder's name); the model path is accepted too.
        max_http_body_bytes: largest HTTP request body (larger ones get 400, code payload_too_large).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 16 << 20
    http_port: int | None = None
    served_model_name: str | None = None
    max_http_body_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.http_port is not None:
            if not (0 <= self.http_port <= 65535):
                raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
            if self.http_port == self.port != 0:
                raise ValueError(f"http_port and port are both {self.port}")
        if self.served_model_name == "":
            raise ValueError("served_model_name must not be empty")
        if self.max_http_body_bytes < 1:
            raise ValueError(f"max_http_body_bytes must be >= 1, got {self.max_http_body_bytes}")


@dataclass(frozen=True)
class ClusterConfig:
    """The whole serving cluster: Ray, scheduler, workers and frontend.

    Attributes:
        ray_address: ``None`` starts an embedded local Ray cluster; otherwise the address
            of an existing cluster to join (``"auto"`` or ``host:port``).
        num_workers: worker actors (one per GPU; CPU workers when none).
        cpus_per_worker: Ray CPUs reserved by each CPU worker (and its torch threads).
        adaptive_threads: CPU workers use fewer torch threads while other processes keep
            cores busy (see :mod:`pagedserve.worker.cpu_threads`).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    ray_address: str | None = None
    num_workers: int = 1
    cpus_per_worker: int = 1
    device: str = "auto"
    attention_backend: str = "auto"
    adaptive_threads: bool = True

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.cpus_per_worker < 0:
            raise ValueError(f"cpus_per_worker must be >= 0, got {self.cpus_per_worker}")

    def worker_config(self, worker_id: int) -> WorkerConfig:
        """The :class:`WorkerConfig` of worker ``worker_id``."""
        return WorkerConfig(
            worker_id=worker_id,
            model=self.model,
            cache=self.cache,
            device=self.device,
            num_threads=self.cpus_per_worker,
            attention_backend=self.attention_backend,
            adaptive_threads=self.adaptive_threads,
        )
