"""The ``pagedserve`` command line: serve, generate, stats, simulate.

``pagedserve serve`` starts a cluster (embedded Ray unless ``--address``) and the gRPC
frontend; ``generate`` and ``stats`` are gRPC clients; ``simulate`` replays a workload
through the paged and the contiguous allocators.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
from typing import Any

import grpc

from pagedserve.cluster.auth import API_KEY_ENV
from pagedserve.cluster.config import (
    DEFAULT_OMP_SPIN_COUNT,
    TOOL_CALL_PARSERS,
    CacheConfig,
    ClusterConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from pagedserve.scheduler.config import (
    ADMISSION_POLICIES,
    ADMISSION_RESERVES,
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    PREEMPTION_MODES,
    PREEMPTION_VICTIMS,
    ROUTING_POLICIES,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
)
from pagedserve.scheduler.disagg import DEFAULT_KV_WAIT_TIMEOUT_S, DEFAULT_MIN_PROMPT_TOKENS
from pagedserve.worker.precision import DTYPE_CHOICES, KV_DTYPE_CHOICES


def _parse_bytes(text: str) -> int:
    """'2G', '512M', '1073741824' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="start a cluster and serve gRPC + OpenAI HTTP until Ctrl-C or SIGTERM"
    )
    p.add_argument("--model", default="default", help="'default', an HF folder or a .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="HTTP port (OpenAI-compatible /v1, /metrics, /health); 0 = free port",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the HTTP API's model name (default: the model folder's name)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=list(TOOL_CALL_PARSERS),
        default=None,
        help="the model's tool-call format on the OpenAI API (default: chosen from its chat "
        "template; hermes when the template names none)",
    )
    p.add_argument("--workers", type=int, default=1, help="worker actors (one per GPU)")
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="of --workers, how many prefill long prompts and hand their KV to the others, "
        "which decode (prefill/decode disaggregation; needs the host block store)",
    )
    p.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=DEFAULT_MIN_PROMPT_TOKENS,
        help="with --prefill-workers: prompts of at least this many tokens are prefilled on "
        "a prefill worker, shorter ones stay on the decode workers",
    )
    p.add_argument(
        "--kv-wait-timeout",
        type=float,
        default=DEFAULT_KV_WAIT_TIMEOUT_S,
        help="with --prefill-workers: seconds a handed-off request may wait for its KV on a "
        "decode worker before it is recomputed there",
    )
    p.add_argument("--block-size", type=int, default=16)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    g.add_argument(
        "--kv-cache-memory", type=_parse_bytes, default=None, help="KV bytes per worker (e.g. 1G)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="model dtype; auto: the checkpoint's 16-bit dtype where the device runs it "
        "fast; for an fp32 checkpoint bf16 on CUDA and on CPUs with native bf16 (AMX or "
        "AVX512-BF16), float32 on other CPUs (float16 on CPU runs the slower generic layers)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_DTYPE_CHOICES,
        default="auto",
        help="KV cache dtype; auto: the model's (bf16 holds twice the blocks of float32); "
        "fp8 (fp8_e4m3): 8-bit e4m3fn, scales 1.0, four times the blocks of float32; int8: "
        "one fp32 scale per token and KV head stored in the block, ~3.8x the "
        "blocks of float32 at head_dim 64",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step (default: 1024 on CPU workers, 2048 on GPUs)",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--routing",
        choices=list(ROUTING_POLICIES),
        default="prefix",
        help="which worker a request joins: longest cached prefix (unless too loaded), "
        "least loaded, or in turn",
    )
    p.add_argument(
        "--routing-load-threshold",
        type=int,
        default=8,
        help="prefix routing: use the least-loaded worker when the prefix holder has more "
        "than this many sequences more (running + queued)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=list(SCHEDULING_POLICIES),
        default="fcfs",
        help="admission/preemption order: arrival, or request priority then arrival",
    )
    p.add_argument(
        "--reserve",
        choices=ADMISSION_RESERVES,
        default="none",
        help="admit a request only when its whole reservation fits (pre-paging baseline)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM / Ctrl-C: seconds requests in flight may take to finish before "
        "they are aborted (new ones are refused at once)",
    )
    p.add_argument(
        "--max-stream-buffer",
        type=int,
        default=4096,
        help="outputs held for a client that stops reading before its request is aborted",
    )
    p.add_argument(
        "--output-transport",
        choices=["socket", "ray"],
        default="socket",
        help="how the scheduler's outputs reach this frontend: socket (one TCP connection "
        "the frontend listens on) or ray (a Ray streaming generator)",
    )
    p.add_argument(
        "--worker-max-restarts",
        type=int,
        default=3,
        help="Ray restarts of a dead worker actor (it rejoins with an empty pool); -1 = always",
    )
    p.add_argument(
        "--scheduler-max-restarts",
        type=int,
        default=3,
        help="Ray restarts of a dead scheduler actor (it restarts empty); -1 = always",
    )
    p.add_argument(
        "--preemption-mode",
        choices=list(PREEMPTION_MODES),
        default="auto",
        help="free a victim's blocks and recompute it, swap them to the host block store, "
        "or per victim whichever is estimated cheaper",
    )
    p.add_argument(
        "--swap-space",
        type=float,
        default=4.0,
        help="GiB of CPU memory in the host block store (0 = no store: recompute only; "
        "with --tensor-parallel-size T a host block holds every rank's KV heads; "
        "default: %(default)s)",
    )
    p.add_argument(
        "--no-host-prefix-cache",
        action="store_true",
        help="do not spill cached blocks evicted from the KV pool to the host block store "
        "(the host tier of the prefix cache, on whenever a store runs)",
    )
    p.add_argument(
        "--host-prefix-cache-fraction",
        type=float,
        default=0.5,
        help="share of the host block store the host tier of the prefix cache may hold "
        "(0..1]; swap preemption may take its blocks too",
    )
    p.add_argument(
        "--admission",
        choices=ADMISSION_POLICIES,
        default="fits-now",
        help="admit while the pool's projected peak (running sequences growing to their "
        "max_tokens) fits, or whatever fits now (preempting as sequences grow)",
    )
    p.add_argument(
        "--admission-growth-ratio",
        type=float,
        default=1.0,
        help="projected admission: share of the remaining max_tokens assumed (0..1]; "
        "below 1 admits more at the risk of preemptions",
    )
    p.add_argument(
        "--preemption-victim",
        choices=PREEMPTION_VICTIMS,
        default="least-waste",
        help="which younger running sequence loses its blocks: fewest computed tokens "
        "lost, or the latest arrival",
    )
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument(
        "--attach",
        default=None,
        metavar="RAY_ADDRESS",
        help="start one more gRPC + HTTP frontend of the running cluster --cluster-name on "
        "the Ray cluster at this address (its scheduler, workers and KV are shared; the "
        "model options are not used)",
    )
    p.add_argument(
        "--cluster-name",
        default="default",
        help="names this cluster's scheduler actor so that frontends can attach "
        "(Ray namespace 'pagedserve'; default: %(default)s)",
    )
    p.add_argument(
        "--step-deadline-floor",
        type=float,
        default=30.0,
        help="seconds: a step unanswered after max(this, --step-deadline-factor x the "
        "worker's mean step time) requeues the worker's sequences until it answers "
        "again; 0 disables (default: %(default)s)",
    )
    p.add_argument(
        "--step-deadline-factor",
        type=float,
        default=20.0,
        help="multiple of the worker's moving-average step time in the step deadline "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="plan each step after the previous one's answer (no overlap of scheduling "
        "and model execution)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks each worker's model is sharded over (Megatron-style; one node, "
        "--cpus-per-worker CPUs or one GPU per rank; --workers counts such groups; "
        "default: %(default)s)",
    )
    p.add_argument(
        "--speculative-method",
        choices=SPECULATIVE_METHODS,
        default=None,
        help="speculative decoding: ngram proposes the continuation of the last earlier "
        "occurrence of the sequence's trailing n-gram (prompt lookup), draft has "
        "--draft-model propose by greedy decoding; verified in one step, greedy and "
        "seeded outputs are unchanged (default: off)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="with --speculative-method draft: the draft model (a Hugging Face folder or "
        "'default'), with the model's tokenizer; its KV pool shares the model's blocks "
        "and --kv-cache-memory",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="with --speculative-method: the most tokens proposed per decode "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--ngram-min",
        type=int,
        default=1,
        help="with --speculative-method ngram: shortest n-gram matched (default: %(default)s)",
    )
    p.add_argument(
        "--ngram-max",
        type=int,
        default=3,
        help="with --speculative-method ngram: longest n-gram matched, tried first "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=DEFAULT_DISABLE_BY_BATCH_SIZE,
        help="with --speculative-method: a step whose running batch holds at least this "
        "many sequences proposes nothing; 0: always propose (default: %(default)s, where "
        "n-gram speculation stopped paying on ShareGPT prompts on CPU)",
    )
    p.add_argument(
        "--cpus-per-worker",
        type=int,
        default=None,
        help="Ray CPUs (and torch threads) of each CPU worker (default: the most that lets "
        "every worker fit the cluster's nodes, from Ray's view of them)",
    )
    p.add_argument(
        "--worker-resources",
        type=_parse_worker_resources,
        default=(),
        help="custom Ray resources that place the workers, as JSON: one object for every "
        "worker ('{\"gpu_pool\": 1}') or a list with one per worker "
        '(\'[{"node_a": 1}, {"node_b": 1}]\'); the nodes declare them with '
        "`ray start --resources`",
    )
    p.add_argument(
        "--scheduler-resources",
        type=_parse_scheduler_resources,
        default=None,
        help="custom Ray resources that place the scheduler actor (and its restarts), as "
        "JSON ('{\"sched_node\": 1}'); default: the driver's node",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds the workers may take to load the model and answer",
    )
    p.add_argument(
        "--node-wait",
        type=float,
        default=10.0,
        help="seconds to wait for nodes still joining (GPUs for --device auto/cuda, nodes "
        "holding the workers' resources); with --address only",
    )
    p.add_argument(
        "--no-adaptive-threads",
        action="store_true",
        help="keep --cpus-per-worker torch threads even while other processes busy the cores",
    )
    p.add_argument(
        "--omp-spin-count",
        type=int,
        default=DEFAULT_OMP_SPIN_COUNT,
        help="GOMP_SPINCOUNT of CPU workers: spins of an OpenMP thread waiting at a barrier "
        "before it sleeps (libgomp's default 300000); -1 leaves the environment's",
    )
    p.add_argument(
        "--step-transport",
        choices=["socket", "ray"],
        default="socket",
        help="how the scheduler sends each step to a worker: socket (a TCP step channel "
        "per worker) or ray (one actor call per step)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bitwise batch-invariant logits (fixed-shape matmuls; slower; CPU only): a "
        "seeded request gives the same tokens whatever it is batched with",
    )
    _add_server_security(p)


def _parse_worker_resources(text: str) -> tuple[dict[str, float], ...]:
    """``--worker-resources`` JSON: an object, or a list of objects, of name -> amount."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    entries = value if isinstance(value, list) else [value]
    if not all(
        isinstance(e, dict) and all(isinstance(v, (int, float)) for v in e.values())
        for e in entries
    ):
        raise argparse.ArgumentTypeError(
            'expected {"name": amount, ...} or a list of them, one per worker'
        )
    return tuple({str(k): float(v) for k, v in e.items()} for e in entries)


def _parse_scheduler_resources(text: str) -> dict[str, float]:
    """``--scheduler-resources`` JSON: one object of name -> amount."""
    entries = _parse_worker_resources(text)
    if len(entries) != 1 or text.lstrip().startswith("["):
        raise argparse.ArgumentTypeError('expected one {"name": amount, ...} object')
    return entries[0]


def _add_server_security(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        help=f"bearer token clients must send (default: ${API_KEY_ENV}); health stays open",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC and HTTP over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", default=None, help="PEM CA: require client certificates (mutual TLS)"
    )


def _add_client_security(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key", default=None, help=f"bearer token to send (default: ${API_KEY_ENV})"
    )
    p.add_argument("--tls-ca", default=None, help="PEM CA that signed the server's certificate")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")


def _client(args: argparse.Namespace) -> Any:
    """The gRPC :class:`Client` of a ``generate`` / ``stats`` invocation."""
    import os

    from pagedserve.cluster.client import Client

    return Client(
        args.address,
        timeout_s=args.timeout,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="send one request and stream the answer")
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=None, help="choices (default 1, or --beam-width)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, help="report the top N (0..20)")
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--include-stop-str-in-output", action="store_true")
    p.add_argument("--beam-width", type=int, default=None, help="> 1 = beam search")
    p.add_argument("--length-penalty", type=float, default=None)
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--priority", type=int, default=None, help="lower = more urgent (default 0)")
    so = p.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="FILE", help="output follows this JSON Schema file")
    so.add_argument("--json-object", action="store_true", help="output is a JSON object")
    so.add_argument("--regex", help="output matches this regular expression")
    so.add_argument("--choice", action="append", help="output is one of these (repeatable)")
    so.add_argument("--grammar", metavar="FILE", help="output follows this EBNF grammar file")
    p.add_argument("--request-id", default="")
    p.add_argument("--output", choices=["text", "json"], default="text")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds")
    _add_client_security(p)


def _add_stats(sub: Any) -> None:
    p = sub.add_parser("stats", help="print per-worker KV pools and queue lengths")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--output", choices=["text", "json"], default="text")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds")
    _add_client_security(p)


def _serve(args: argparse.Namespace) -> int:
    from pagedserve.cluster.launcher import serve_forever

    config = serve_config(args)
    attach = args.attach is not None
    if attach:
        config = dataclasses.replace(config, ray_address=args.attach)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve_forever(config, attach=attach))
    return 0


def _speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The ``--speculative-method`` flags as a config (None: speculation off)."""
    method = getattr(args, "speculative_method", None)
    if method is None:
        return None
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        disable_by_batch_size=args.speculative_disable_by_batch_size or None,
        draft_model=getattr(args, "draft_model", None),
    )


def serve_config(args: argparse.Namespace) -> ClusterConfig:
    """The :class:`ClusterConfig` of parsed ``serve`` arguments (also used by
    ``python -m pagedserve.cluster.job serve``)."""
    import os

    cache_kwargs: dict[str, Any] = {"num_blocks": args.num_blocks}
    if args.kv_cache_memory is not None:
        cache_kwargs["kv_cache_memory"] = args.kv_cache_memory
    cache = CacheConfig(
        block_size=args.block_size,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        **cache_kwargs,
    )
    config = ClusterConfig(
        model=ModelConfig(
            model=args.model,
            dtype=getattr(args, "dtype", "auto"),
            max_model_len=args.max_model_len,
            batch_invariant=getattr(args, "batch_invariant", False),
        ),
        cache=cache,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            routing=args.routing,
            routing_load_threshold=args.routing_load_threshold,
            scheduling_policy=args.scheduling_policy,
            admission_reserve=args.reserve,
            preemption_mode=args.preemption_mode,
            admission=args.admission,
            admission_growth_ratio=args.admission_growth_ratio,
            preemption_victim=args.preemption_victim,
            async_scheduling=not args.no_async_scheduling,
            step_deadline_floor_s=getattr(args, "step_deadline_floor", 30.0),
            step_deadline_factor=getattr(args, "step_deadline_factor", 20.0),
            host_prefix_cache=not getattr(args, "no_host_prefix_cache", False),
            host_prefix_cache_fraction=getattr(args, "host_prefix_cache_fraction", 0.5),
            speculative_config=_speculative_config(args),
        ),
        server=ServerConfig(
            host=args.host,
            port=args.port,
            http_port=args.http_port,
            served_model_name=args.served_model_name,
            tool_call_parser=getattr(args, "tool_call_parser", None),
            drain_timeout_s=args.drain_timeout,
            max_stream_buffer=args.max_stream_buffer,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            output_transport=getattr(args, "output_transport", "socket"),
        ),
        ray_address=args.address,
        num_workers=args.workers,
        cpus_per_worker=args.cpus_per_worker,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        worker_resources=getattr(args, "worker_resources", ()),
        scheduler_resources=getattr(args, "scheduler_resources", None),
        startup_timeout_s=getattr(args, "startup_timeout", 300.0),
        node_wait_s=getattr(args, "node_wait", 10.0),
        device=args.device,
        attention_backend=args.attention_backend,
        worker_max_restarts=args.worker_max_restarts,
        scheduler_max_restarts=args.scheduler_max_restarts,
        swap_space=int(args.swap_space * (1 << 30)),
        adaptive_threads=not args.no_adaptive_threads,
        omp_spin_count=(
            None
            if getattr(args, "omp_spin_count", DEFAULT_OMP_SPIN_COUNT) < 0
            else getattr(args, "omp_spin_count", DEFAULT_OMP_SPIN_COUNT)
        ),
        step_transport=getattr(args, "step_transport", "socket"),
        cluster_name=getattr(args, "cluster_name", None),
        prefill_workers=getattr(args, "prefill_workers", 0),
        disagg_min_prompt_tokens=getattr(
            args, "disagg_min_prompt_tokens", DEFAULT_MIN_PROMPT_TOKENS
        ),
        kv_wait_timeout_s=getattr(args, "kv_wait_timeout", DEFAULT_KV_WAIT_TIMEOUT_S),
    )
    return config


def _read_text(path: str | None, flag: str) -> str | None:
    """The text of the file a flag names (None when the flag is unset).

    Raises:
        ValueError: the file cannot be read or is not UTF-8 text (the message names the
            flag; ``main`` prints it as an ``error:`` and exits 2).
    """
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: not UTF-8 ({exc.reason})") from None


def _generate(args: argparse.Namespace) -> int:
    kwargs: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "n": args.n,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos or None,
        "request_id": args.request_id,
        "logprobs": args.logprobs,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "min_tokens": args.min_tokens,
        "include_stop_str_in_output": args.include_stop_str_in_output or None,
        "beam_width": args.beam_width,
        "length_penalty": args.length_penalty,
        "cache_salt": args.cache_salt,
        "priority": args.priority,
        "json_schema": _read_text(args.json_schema, "--json-schema"),
        "json_object": args.json_object or None,
        "regex": args.regex,
        "choice": args.choice,
        "grammar": _read_text(args.grammar, "--grammar"),
    }
    if args.chat:
        kwargs["chat"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    with _client(args) as client:
        if args.output == "json":
            print(json.dumps(client.generate(prompt, **kwargs).to_dict()))
            return 0
        if (args.n or args.beam_width or 1) > 1:
            # Several choices stream interleaved: print each whole, as "[i] text", when
            # it finishes.
            texts: dict[int, list[str]] = {}
            for d in client.stream(prompt, **kwargs):
                texts.setdefault(d.index, []).append(d.text)
                if d.finish_reason is not None:
                    print(f"[{d.index}] {''.join(texts.pop(d.index))}", flush=True)
            return 0
        for d in client.stream(prompt, **kwargs):
            if d.text:
                sys.stdout.write(d.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    with _client(args) as client:
        st = client.stats()
    if args.output == "json":
        print(json.dumps(st))
        return 0
    # Piped output gets a wide console, so the per-worker table's columns are not cut.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(
        f"model {st['model']}  max_model_len {st['max_model_len']}  running "
        f"{st['num_requests_running']}  waiting {st['num_requests_waiting']}  preemptions "
        f"{st['num_preemptions']}  recomputed tokens {st['num_recomputed_tokens']}"
    )
    sd = st.get("spec_decode")
    if sd and sd["num_drafts"]:
        console.print(
            f"speculative decoding  drafts {sd['num_drafts']}  draft tokens "
            f"{sd['num_draft_tokens']}  accepted {sd['num_accepted_tokens']}  acceptance rate "
            f"{sd['acceptance_rate']:.3f}  mean accepted length {sd['mean_accepted_length']:.2f}"
        )
    sw = st["swap"]
    console.print(
        f"preemption {sw['preemption_mode']}  by mode {sw['preemptions_by_mode']}  swapped "
        f"{sw['num_requests_swapped']}  host blocks {sw['host_blocks_free']} free of "
        f"{sw['host_blocks_total']}  swap-out {sw['num_swap_outs']} "
        f"({sw['swap_out_bytes']} B)  swap-in {sw['num_swap_ins']} ({sw['swap_in_bytes']} B; "
        f"from another node {sw['num_remote_swap_ins']}, {sw['remote_swap_in_bytes']} B)  "
        f"failed {sw['num_swap_failures']}"
    )
    hp = sw.get("host_prefix", {})
    if hp.get("enabled"):
        console.print(
            f"host prefix cache {hp['num_blocks']} of {hp['capacity_blocks']} blocks  hits "
            f"{hp['num_hit_blocks']} blocks ({hp['num_hit_tokens']} tokens)  spills "
            f"{hp['num_spills']} ({hp['spill_bytes']} B, {hp['spill_seconds']:.3f} s)  loads "
            f"{hp['num_loads']} "
            f"({hp['load_bytes']} B, {hp['load_seconds']:.3f} s)  failed {hp['num_failures']}"
        )
    table = Table(
        "worker",
        "blocks",
        "free",
        "used",
        "block size",
        "dtype / KV",
        "running",
        "waiting",
        "prefix hit rate",
        "preemptions",
        "recomputed",
        "alive",
    )
    for w in st["workers"]:
        table.add_row(
            str(w["worker_id"]),
            str(w["num_blocks"]),
            str(w["num_free_blocks"]),
            str(w["num_used_blocks"]),
            str(w["block_size"]),
            f"{w['dtype'] or '-'} / {w['kv_cache_dtype'] or '-'}",
            str(w["num_requests_running"]),
            str(w["num_requests_waiting"]),
            f"{w['prefix_cache_hit_rate']:.3f}",
            str(w["num_preemptions"]),
            str(w["num_recomputed_tokens"]),
            "yes" if w["alive"] else "no",
        )
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every subcommand."""
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_stats(sub)
    from pagedserve.cluster import host_store

    host_store.add_parser(sub)
    try:
        from pagedserve.sim import cli as simulate_cmd
    except ImportError:  # pragma: no cover - present in every install
        simulate_cmd = None  # type: ignore[assignment]
    if simulate_cmd is not None:
        simulate_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedserve`` console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from pagedserve.cluster import host_store

    handlers = {
        "serve": _serve,
        "generate": _generate,
        "stats": _stats,
        "host-store": host_store.run,
    }
    try:
        if args.command in handlers:
            return handlers[args.command](args)
        from pagedserve.sim import cli as simulate_cmd

        return int(simulate_cmd.run(args))
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # e.g. PortUnavailable, missing GPUs
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
