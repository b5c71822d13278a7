"""Python client of the pagedserve gRPC API (``pagedserve.v1.Generation``).

Example::

    from pagedserve.cluster.client import Client

    with Client("127.0.0.1:50051") as c:
        for delta in c.stream(chat=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(delta.text, end="", flush=True)
        result = c.generate("Once upon a time", max_tokens=16, temperature=0)
        print(result.choices[0].token_ids)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc as pb_grpc

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class Delta:
    """One stream item: new tokens/text of choice ``index``; ``finish_reason`` on the last.

    ``logprobs`` (one dict ``{token_id, logprob, top_logprobs: [{token_id, logprob}]}`` per
    token) and ``cumulative_logprob`` are set when the request asked for logprobs;
    ``score`` for beam search; ``stop_reason`` (the matched stop string or stop token id)
    on a last item ended by one.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    usage: dict[str, int] | None
    logprobs: tuple[dict[str, Any], ...] = ()
    cumulative_logprob: float | None = None
    score: float | None = None
    stop_reason: str | int | None = None


@dataclass
class Choice:
    """A finished choice: all token ids and text, why it ended, and its logprobs/score."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[str, Any]] | None = None
    cumulative_logprob: float | None = None
    score: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form; logprob and score keys only when the request produced them."""
        out: dict[str, Any] = {
            "index": self.index,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
        if self.cumulative_logprob is not None:
            out["cumulative_logprob"] = self.cumulative_logprob
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.score is not None:
            out["score"] = self.score
        return out


@dataclass
class Result:
    """A whole response (``generate``); ``usage`` sums completion tokens over choices."""

    request_id: str
    choices: list[Choice]
    usage: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape printed by ``pagedserve generate --output json``."""
        return {
            "request_id": self.request_id,
            "choices": [c.to_dict() for c in self.choices],
            "usage": self.usage,
        }


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    chat: Sequence[dict[str, str]] | None = None,
    request_id: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    n: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool | None = None,
    return_token_ids: bool = True,
    logprobs: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_tokens: int | None = None,
    include_stop_str_in_output: bool | None = None,
    cache_salt: str | None = None,
    beam_width: int | None = None,
    length_penalty: float | None = None,
    priority: int | None = None,
    json_schema: str | dict[str, Any] | None = None,
    json_object: bool | None = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    strict: bool | None = None,
) -> Any:
    """Build a ``GenerateRequest``; exactly one of prompt / token_ids / chat.

    At most one structured-output constraint: ``json_schema`` (JSON text or a dict;
    ``strict`` goes with it), ``json_object``, ``regex``, ``choice`` or ``grammar`` (EBNF).

    Raises:
        ValueError: when not exactly one input is given, several constraints are, or a
            value does not fit its protobuf field (a negative or > 2**32 - 1 count, a wrong
            type, text with a lone surrogate); the message starts with the field's name.
    """
    if sum(x is not None for x in (prompt, token_ids, chat)) != 1:
        raise ValueError("give exactly one of prompt, token_ids or chat")
    with _field("request_id"):
        req = pb.GenerateRequest(request_id=request_id, return_token_ids=return_token_ids)
    if prompt is not None:
        with _field("prompt"):
            req.text = prompt
    elif token_ids is not None:
        with _field("token_ids"):
            req.token_ids.ids.extend(token_ids)
    else:
        assert chat is not None
        with _field("chat"):
            for m in chat:
                req.chat.messages.add(role=m["role"], content=m["content"])
    s = req.sampling
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("n", n),
        ("ignore_eos", ignore_eos),
        ("logprobs", logprobs),
        ("repetition_penalty", repetition_penalty),
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
        ("min_tokens", min_tokens),
        ("include_stop_str_in_output", include_stop_str_in_output),
        ("cache_salt", cache_salt),
        ("beam_width", beam_width),
        ("length_penalty", length_penalty),
        ("priority", priority),
    ):
        if value is not None:
            with _field(name):
                setattr(s, name, value)
    with _field("stop"):
        s.stop.extend(stop)
    with _field("stop_token_ids"):
        s.stop_token_ids.extend(stop_token_ids)
    constraints: dict[str, Any] = {
        "json_schema": json.dumps(json_schema) if isinstance(json_schema, dict) else json_schema,
        "json_object": json_object or None,
        "regex": regex,
        "choice": choice,
        "grammar": grammar,
    }
    given = {k: v for k, v in constraints.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"structured_outputs: give at most one of {sorted(given)}")
    for name, value in given.items():
        with _field(name):
            if name == "choice":
                s.structured_outputs.choice.choices.extend(value)
            else:
                setattr(s.structured_outputs, name, value)
            if strict is not None:
                s.structured_outputs.strict = strict
    return req


@contextlib.contextmanager
def _field(name: str) -> Iterator[None]:
    """Re-raise protobuf's range, type and encoding errors as ``ValueError("name: ...")``."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}: {exc}") from exc


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror}") from exc


def delta_from_message(msg: Any) -> Delta:
    """One ``GenerateResponse`` message as a :class:`Delta`."""
    usage = None
    if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        usage = {
            "prompt_tokens": msg.usage.prompt_tokens,
            "completion_tokens": msg.usage.completion_tokens,
            "cached_tokens": msg.usage.cached_tokens,
            "num_preemptions": msg.usage.num_preemptions,
        }
    kind = msg.stop_reason.WhichOneof("kind")
    return Delta(
        request_id=msg.request_id,
        index=msg.index,
        token_ids=tuple(msg.delta_token_ids),
        text=msg.delta_text,
        finish_reason=FINISH_REASONS[msg.finish_reason],
        usage=usage,
        logprobs=tuple(
            {
                "token_id": lp.token_id,
                "logprob": lp.logprob,
                "top_logprobs": [
                    {"token_id": t.token_id, "logprob": t.logprob} for t in lp.top_logprobs
                ],
            }
            for lp in msg.logprobs
        ),
        cumulative_logprob=(msg.cumulative_logprob if msg.HasField("cumulative_logprob") else None),
        score=msg.score if msg.HasField("score") else None,
        stop_reason=getattr(msg.stop_reason, kind) if kind else None,
    )


class _ResultBuilder:
    """Collects a request's deltas into a :class:`Result` (both clients' ``generate``)."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.choices: dict[int, Choice] = {}
        self.request_id = kwargs.get("request_id", "")
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self.usage["num_preemptions"] = 0
        self.want_logprobs = kwargs.get("logprobs") is not None

    def add(self, d: Delta) -> None:
        self.request_id = d.request_id
        c = self.choices.setdefault(d.index, Choice(index=d.index))
        c.token_ids.extend(d.token_ids)
        c.text += d.text
        if self.want_logprobs:
            c.logprobs = (c.logprobs or []) + list(d.logprobs)
        if d.cumulative_logprob is not None:
            c.cumulative_logprob = d.cumulative_logprob
        if d.score is not None:
            c.score = d.score
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
            c.stop_reason = d.stop_reason
            assert d.usage is not None
            usage = self.usage
            usage["prompt_tokens"] = d.usage["prompt_tokens"]
            usage["cached_tokens"] = max(usage["cached_tokens"], d.usage["cached_tokens"])
            usage["completion_tokens"] += d.usage["completion_tokens"]
            usage["num_preemptions"] += d.usage["num_preemptions"]

    def result(self) -> Result:
        ordered = [self.choices[i] for i in sorted(self.choices)]
        return Result(self.request_id, ordered, self.usage)


def stats_to_dict(r: Any) -> dict[str, Any]:
    """A ``GetStatsResponse`` as the dict ``pagedserve stats`` prints."""
    return {
        "model": r.model,
        "max_model_len": r.max_model_len,
        "num_requests_running": r.num_requests_running,
        "num_requests_waiting": r.num_requests_waiting,
        "num_preemptions": r.num_preemptions,
        "swap": {
            "preemption_mode": r.swap.preemption_mode,
            "num_requests_swapped": r.swap.num_requests_swapped,
            "host_blocks_total": r.swap.host_blocks_total,
            "host_blocks_free": r.swap.host_blocks_free,
            "swap_out_bytes": r.swap.swap_out_bytes,
            "swap_in_bytes": r.swap.swap_in_bytes,
            "num_swap_outs": r.swap.num_swap_outs,
            "num_swap_ins": r.swap.num_swap_ins,
            "num_swap_failures": r.swap.num_swap_failures,
            "num_remote_swap_ins": r.swap.num_remote_swap_ins,
            "remote_swap_in_bytes": r.swap.remote_swap_in_bytes,
            "preemptions_by_mode": dict(r.swap.preemptions_by_mode),
            "host_prefix": {
                f.name: getattr(r.swap.host_prefix, f.name)
                for f in r.swap.host_prefix.DESCRIPTOR.fields
            },
        },
        "num_recomputed_tokens": r.num_recomputed_tokens,
        "spec_decode": {
            "num_drafts": r.spec_decode.num_drafts,
            "num_draft_tokens": r.spec_decode.num_draft_tokens,
            "num_accepted_tokens": r.spec_decode.num_accepted_tokens,
            "acceptance_rate": r.spec_decode.acceptance_rate,
            "mean_accepted_length": r.spec_decode.mean_accepted_length,
        },
        "workers": [
            {
                "worker_id": w.worker_id,
                "num_blocks": w.num_blocks,
                "num_free_blocks": w.num_free_blocks,
                "num_used_blocks": w.num_used_blocks,
                "block_size": w.block_size,
                "dtype": w.dtype,
                "kv_cache_dtype": w.kv_cache_dtype,
                "num_requests_running": w.num_requests_running,
                "num_requests_waiting": w.num_requests_waiting,
                "prefix_cache_hit_rate": w.prefix_cache_hit_rate,
                "num_preemptions": w.num_preemptions,
                "num_recomputed_tokens": w.num_recomputed_tokens,
                "can_swap": w.can_swap,
                "num_swap_outs": w.num_swap_outs,
                "num_swap_ins": w.num_swap_ins,
                "num_swap_failures": w.num_swap_failures,
                "num_remote_swap_ins": w.num_remote_swap_ins,
                "remote_swap_in_bytes": w.remote_swap_in_bytes,
                "alive": w.alive,
            }
            for w in r.workers
        ],
    }


_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


class _Connection:
    """One channel, its stub and the per-call deadline and metadata: what :class:`Client`
    and :class:`AsyncClient` share (see :class:`Client` for the arguments and errors)."""

    _grpc: Any = grpc  # the module whose channels the class uses: grpc or grpc.aio

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout_s: float | None = None,
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if tls_ca is not None or tls_cert is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca, "tls_ca"),
                private_key=_read(tls_key, "tls_key"),
                certificate_chain=_read(tls_cert, "tls_cert"),
            )
            self._channel = self._grpc.secure_channel(address, creds, options=_CHANNEL_OPTIONS)
        else:
            self._channel = self._grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._timeout = timeout_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None


class Client(_Connection):
    """Blocking client over one gRPC channel.

    Args:
        address: ``host:port`` of a pagedserve frontend.
        timeout_s: per-call deadline in seconds (None = no deadline).
        api_key: sent as ``authorization: Bearer <key>`` metadata on every call (servers
            started with ``--api-key`` refuse calls without it: UNAUTHENTICATED).
        tls_ca: PEM file of the CA that signed the server's certificate; any of
            ``tls_ca`` / ``tls_cert`` connects over TLS (without ``tls_ca``: the system roots).
        tls_cert: PEM client certificate, for servers that require one (mutual TLS).
        tls_key: PEM private key of ``tls_cert``.

    Raises:
        ValueError: a TLS file cannot be read, or only one of tls_cert / tls_key is given.
    """

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the channel connects. Raises grpc.FutureTimeoutError."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Delta]:
        """Stream deltas of one request (see :func:`build_request` for arguments).

        Raises:
            grpc.RpcError: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ... with the server's message.
        """
        req = build_request(prompt, **kwargs)
        call = self._stub.Generate(req, timeout=self._timeout, metadata=self._metadata)
        try:
            for msg in call:
                yield delta_from_message(msg)
        finally:
            call.cancel()  # no-op when finished; frees the server side when abandoned

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """Run one request to completion and collect its choices."""
        builder = _ResultBuilder(kwargs)
        for d in self.stream(prompt, **kwargs):
            builder.add(d)
        return builder.result()

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight; True when it was."""
        return self._stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=self._timeout, metadata=self._metadata
        ).aborted

    def stats(self) -> dict[str, Any]:
        """Cluster statistics as a dict (the JSON of ``pagedserve stats``)."""
        r = self._stub.GetStats(
            pb.GetStatsRequest(), timeout=self._timeout, metadata=self._metadata
        )
        return stats_to_dict(r)


class AsyncClient(_Connection):
    """asyncio client over one ``grpc.aio`` channel: many concurrent streams share it (a
    load generator or an async web app needs no thread per request).

    Same arguments, errors and results as :class:`Client`; use it as
    ``async with AsyncClient(address) as c:`` from a running event loop.

    Example::

        async with AsyncClient("127.0.0.1:50051") as c:
            async for delta in c.stream("Once upon a time", max_tokens=16):
                print(delta.text, end="")
            results = await asyncio.gather(*(c.generate(p, max_tokens=8) for p in prompts))
    """

    _grpc = grpc.aio

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the channel connects. Raises asyncio.TimeoutError."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout_s)

    async def stream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[Delta]:
        """Stream deltas of one request (see :func:`build_request` for arguments).

        Raises:
            grpc.aio.AioRpcError: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ... with the
                server's message.
        """
        req = build_request(prompt, **kwargs)
        call = self._stub.Generate(req, timeout=self._timeout, metadata=self._metadata)
        try:
            async for msg in call:
                yield delta_from_message(msg)
        finally:
            call.cancel()  # no-op when finished; frees the server side when abandoned

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """Run one request to completion and collect its choices."""
        builder = _ResultBuilder(kwargs)
        async for d in self.stream(prompt, **kwargs):
            builder.add(d)
        return builder.result()

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight; True when it was."""
        r = await self._stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=self._timeout, metadata=self._metadata
        )
        return bool(r.aborted)

    async def stats(self) -> dict[str, Any]:
        """Cluster statistics as a dict (the JSON of ``pagedserve stats``)."""
        r = await self._stub.GetStats(
            pb.GetStatsRequest(), timeout=self._timeout, metadata=self._metadata
        )
        return stats_to_dict(r)
