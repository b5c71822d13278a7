"""Configuration of the serving cluster: the frontend and the whole-cluster composition.

Each layer owns its config (:mod:`pagedserve.worker.config`: model, KV pool, worker;
:mod:`pagedserve.scheduler.config`: batching policy); :class:`ClusterConfig` composes them
with the launcher's own settings. Frozen dataclasses validated in ``__post_init__``
(``ValueError`` naming the field).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.disagg import (
    DEFAULT_KV_WAIT_TIMEOUT_S,
    DEFAULT_MIN_PROMPT_TOKENS,
    DisaggConfig,
)
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig

# GOMP_SPINCOUNT of CPU workers (ClusterConfig.omp_spin_count): measured on the 2-core EPYC
# VM, benchmarks/RESULTS.md "OpenMP barriers on shared cores".
DEFAULT_OMP_SPIN_COUNT = 1000

__all__ = ["CacheConfig", "ClusterConfig", "ModelConfig", "SchedulerConfig", "ServerConfig"]

# The formats of pagedserve.cluster.openai_tools.PARSERS (tested equal).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


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
        tool_call_parser: the served model's tool-call format on the OpenAI-compatible API
            (``hermes``, ``llama3_json``, ``mistral``; :mod:`pagedserve.cluster.openai_tools`);
            ``None`` picks it from the chat template.
        drain_timeout_s: on SIGTERM / Ctrl-C, how long requests in flight may run to
            completion before they are aborted (seconds); new requests are refused at once.
        max_stream_buffer: most outputs held for one stream whose client is not reading;
            past it the request is aborted with RESOURCE_EXHAUSTED.
        api_key: bearer token every client call must carry (gRPC metadata / HTTP header
            ``authorization: Bearer <key>``; the health checks stay open); ``None`` = no
            authentication. Never printed (``repr=False``). See :mod:`pagedserve.cluster.auth`.
            The host block store the cluster starts takes the same key (or a random one
            without it) and serves TLS when the frontends do (:mod:`pagedserve.cluster.host_store`).
        tls_cert: PEM certificate (chain) of the server; with ``tls_key`` gRPC and HTTP
            are served over TLS.
        tls_key: PEM private key of ``tls_cert``.
        tls_client_ca: PEM CA bundle; when set, clients must present a certificate signed
            by it (mutual TLS). Needs ``tls_cert``.
        output_transport: how the scheduler's outputs reach this frontend: ``"socket"``,
            one TCP connection the frontend listens on (127.0.0.1 when the scheduler
            shares its node, else its node's address;
            :mod:`pagedserve.scheduler.output_channel`), or ``"ray"``, a Ray streaming
            generator (a couple of milliseconds more CPU per step across both processes).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 16 << 20
    http_port: int | None = None
    served_model_name: str | None = None
    max_http_body_bytes: int = 16 << 20
    tool_call_parser: str | None = None
    drain_timeout_s: float = 30.0
    max_stream_buffer: int = 4096
    api_key: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    output_transport: str = "socket"

    def __post_init__(self) -> None:
        if self.output_transport not in ("socket", "ray"):
            raise ValueError(
                f"output_transport must be 'socket' or 'ray', got {self.output_transport!r}"
            )
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_stream_buffer < 1:
            raise ValueError(f"max_stream_buffer must be >= 1, got {self.max_stream_buffer}")
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
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"
            )
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ValueError("api_key must be non-empty, without surrounding whitespace")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")

    @property
    def tls(self) -> bool:
        """True when the frontends serve TLS."""
        return self.tls_cert is not None


def _check_custom_resources(field_name: str, entry: dict[str, float], why: str) -> None:
    """Only custom Ray resources, each amount > 0 (``why``: the error's reason for that)."""
    for name, amount in entry.items():
        if not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(f"{field_name} names {name!r}: only custom resources ({why})")
        if not amount > 0:
            raise ValueError(f"{field_name}[{name!r}] must be > 0, got {amount}")


@dataclass(frozen=True)
class ClusterConfig:
    """The whole serving cluster: Ray, scheduler, workers and frontend.

    Attributes:
        ray_address: ``None`` starts an embedded local Ray cluster; otherwise the address
            of an existing cluster to join (``"auto"`` or ``host:port``).
        num_workers: worker actors (one per GPU; CPU workers when none).
        cpus_per_worker: Ray CPUs reserved by each CPU worker (and its torch threads);
            None: the most that lets every worker fit the cluster's alive nodes (Ray's view,
            :func:`pagedserve.cluster.startup.default_cpus_per_worker`).
        worker_resources: custom Ray resources each worker requests, which place it on the
            nodes that have them (``ray start --resources '{"node_b": 1}'``): empty for none,
            one mapping for every worker, or one per worker (worker ``k`` gets entry ``k``).
            CPU and GPU come from ``cpus_per_worker`` and ``device``, not from here.
        scheduler_resources: custom Ray resources the scheduler actor requests, which place
            it (and its restarts) on the nodes that have them; None pins it to the driver's
            node (the default: its output streams go to the driver's frontend).
        startup_timeout_s: how long to wait for the workers to load their model and answer
            (seconds); past it start-up fails naming the late workers' requests.
        node_wait_s: how long to wait for nodes still joining (seconds): for the GPUs
            ``device`` auto/cuda looks for, and for nodes that hold the workers' requests.
        worker_max_restarts: how often Ray restarts a worker actor that died (Ray's
            ``max_restarts``); a restarted worker rejoins with an empty pool.
        scheduler_max_restarts: the same for the scheduler actor; a restarted scheduler
            starts empty (requests in flight at its death fail with UNAVAILABLE).
        swap_space: bytes of CPU memory of the host block store that swap preemption
            uses (``scheduler.preemption_mode`` swap or auto); 0 starts no store and
            preempts by recompute only.
        adaptive_threads: CPU workers use fewer torch threads while other processes keep
            cores busy (see :mod:`pagedserve.worker.cpu_threads`).
        omp_spin_count: ``GOMP_SPINCOUNT`` of the CPU workers' processes: how many times
            an OpenMP thread waiting at a barrier spins before it sleeps (libgomp's default
            is 300,000). Short: a thread whose partner was preempted by another process
            sleeps soon, its core turns idle and the kernel moves the preempted thread
            there, instead of both cores stalling (see docs/architecture.md, "OpenMP
            barriers on shared cores"). None leaves the environment's (or libgomp's).
        step_transport: how the scheduler sends each step to a worker: ``"socket"``, a
            TCP step channel per worker (on 127.0.0.1 when the scheduler shares its node,
            else on its node's address; :mod:`pagedserve.scheduler.step_channel`), or ``"ray"``, one actor call per
            step (about a millisecond of CPU more on each side).
        tensor_parallel_size: ranks each worker's model is sharded over (Megatron-style,
            :mod:`pagedserve.worker.sharding`): a worker is then that many rank actors on
            one node (:mod:`pagedserve.cluster.tp_group`), each with ``cpus_per_worker``
            CPUs or one GPU; ``num_workers`` counts such groups. 1: no sharding. Swap
            shards too: each rank swaps its own KV heads, so a host block holds T chunks
            (``swap_space`` then holds 1/T as many host blocks).
        cluster_name: names the scheduler actor (``pagedserve-scheduler-NAME`` in the Ray
            namespace ``pagedserve``) so that more frontends can attach to this cluster
            (``pagedserve serve --attach``); None leaves it anonymous. Letters, digits,
            ``.``, ``_`` and ``-``, at most 64.
        prefill_workers: workers ``0 .. P-1`` prefill the long prompts and hand their KV
            to the other workers, which decode (prefill/decode disaggregation,
            :mod:`pagedserve.scheduler.disagg`); 0: every worker does both. Needs fewer
            than ``num_workers``, a host block store (``swap_space`` > 0) and
            ``tensor_parallel_size`` 1.
        disagg_min_prompt_tokens: with ``prefill_workers``, prompts of at least this
            many tokens go to a prefill worker; shorter ones are routed among the
            decode workers.
        kv_wait_timeout_s: with ``prefill_workers``, how long (seconds) a handed-off
            request may wait for its KV on a decode worker before it is recomputed there.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    ray_address: str | None = None
    num_workers: int = 1
    cpus_per_worker: int | None = 1
    worker_resources: tuple[dict[str, float], ...] = ()
    scheduler_resources: dict[str, float] | None = None
    startup_timeout_s: float = 300.0
    node_wait_s: float = 10.0
    device: str = "auto"
    attention_backend: str = "auto"
    worker_max_restarts: int = 3
    scheduler_max_restarts: int = 3
    swap_space: int = 0
    adaptive_threads: bool = True
    omp_spin_count: int | None = DEFAULT_OMP_SPIN_COUNT
    step_transport: str = "socket"
    cluster_name: str | None = None
    tensor_parallel_size: int = 1
    prefill_workers: int = 0
    disagg_min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS
    kv_wait_timeout_s: float = DEFAULT_KV_WAIT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.scheduler.speculative_config is not None:
            raise ValueError("speculative decoding needs tensor_parallel_size 1")
        if self.worker_max_restarts < -1 or self.scheduler_max_restarts < -1:
            raise ValueError("worker_max_restarts / scheduler_max_restarts must be >= -1")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.step_transport not in ("socket", "ray"):
            raise ValueError(
                f"step_transport must be 'socket' or 'ray', got {self.step_transport!r}"
            )
        if self.omp_spin_count is not None and self.omp_spin_count < 0:
            raise ValueError(f"omp_spin_count must be >= 0 or None, got {self.omp_spin_count}")
        if self.cpus_per_worker is not None and self.cpus_per_worker < 0:
            raise ValueError(f"cpus_per_worker must be >= 0, got {self.cpus_per_worker}")
        if self.cluster_name is not None and not re.fullmatch(
            r"[A-Za-z0-9._-]{1,64}", self.cluster_name
        ):
            raise ValueError(
                "cluster_name must be 1-64 letters, digits, '.', '_' or '-', "
                f"got {self.cluster_name!r}"
            )
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if not self.node_wait_s >= 0:
            raise ValueError(f"node_wait_s must be >= 0, got {self.node_wait_s}")
        self._check_worker_resources()
        self._check_disagg()

    def _check_disagg(self) -> None:
        if self.prefill_workers < 0:
            raise ValueError(f"prefill_workers must be >= 0, got {self.prefill_workers}")
        if self.prefill_workers and self.prefill_workers >= self.num_workers:
            raise ValueError(
                f"prefill_workers ({self.prefill_workers}) must be < num_workers "
                f"({self.num_workers}): at least one worker decodes"
            )
        if self.prefill_workers and self.swap_space == 0:
            raise ValueError(
                "prefill_workers move the KV through the host block store: swap_space must be > 0"
            )
        self.disagg_config()  # validates the threshold and the timeout

    def disagg_config(self) -> DisaggConfig | None:
        """The scheduler's disaggregation (prefill workers ``0 .. P-1``); None without
        ``prefill_workers``.

        Raises:
            ValueError: see :class:`DisaggConfig`.
        """
        if not self.prefill_workers:
            return None
        return DisaggConfig(
            frozenset(range(self.prefill_workers)),
            self.disagg_min_prompt_tokens,
            self.kv_wait_timeout_s,
        )

    def _check_worker_resources(self) -> None:
        res = self.worker_resources
        if len(res) not in (0, 1, self.num_workers):
            raise ValueError(
                f"worker_resources has {len(res)} entries: give one for every worker or "
                f"one per worker ({self.num_workers})"
            )
        for entry in res:
            _check_custom_resources(
                "worker_resources", entry, "CPU and GPU come from cpus_per_worker and device"
            )
        if self.scheduler_resources is not None:
            if not self.scheduler_resources:
                raise ValueError("scheduler_resources must name at least one resource (or be None)")
            _check_custom_resources(
                "scheduler_resources", self.scheduler_resources, "the scheduler takes no CPU or GPU"
            )

    def worker_env(self, device: str) -> dict[str, str]:
        """Environment variables of a worker process on ``device`` (``"cpu"`` /
        ``"cuda"``), set through Ray's ``runtime_env`` (libgomp reads them as torch loads,
        before the worker's code runs): ``GOMP_SPINCOUNT`` on CPU (``omp_spin_count``)."""
        if device != "cpu" or self.omp_spin_count is None:
            return {}
        return {"GOMP_SPINCOUNT": str(self.omp_spin_count)}

    def worker_config(self, worker_id: int) -> WorkerConfig:
        """The :class:`WorkerConfig` of worker ``worker_id`` (with the draft model of
        ``--speculative-method draft``, in the model's settings)."""
        spec = self.scheduler.speculative_config
        draft = None
        if spec is not None and spec.draft_model is not None:
            draft = dataclasses.replace(self.model, model=spec.draft_model)
        return WorkerConfig(
            worker_id=worker_id,
            model=self.model,
            cache=self.cache,
            device=self.device,
            num_threads=self.cpus_per_worker or 0,
            attention_backend=self.attention_backend,
            adaptive_threads=self.adaptive_threads,
            draft_model=draft,
        )
