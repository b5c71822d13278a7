"""OpenAI request parsing, its translation to the shared request path, and the default
max_tokens (no cluster: the pipeline's validation runs without a scheduler); the HTTP app's
refusals through ASGI (the app of ``build_http_app`` over a pipeline without a scheduler)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.launcher import build_http_app
from pagedserve.cluster.openai_api import parse_body
from pagedserve.cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_input,
    completion_inputs,
    sampling_request,
)
from pagedserve.cluster.openai_render import HTTP_STATUS, error_json
from pagedserve.cluster.pipeline import ChoiceDelta, RequestPipeline, Usage
from pagedserve.cluster.request_prep import GenerateInput, ModelInfo, SamplingRequest
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.errors import (
    ClusterUnavailable,
    DuplicateRequest,
    InvalidRequest,
    ModelNotFound,
    RequestRejected,
)
from pagedserve.scheduler.request import FinishReason


class _Tok:
    def get_vocab(self):
        return {"a": 0, "bb": 1}

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [0] * len(text)}  # one token per character

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in messages) + "|"

    def decode(self, ids):
        return "a" * len(ids)


def _pipeline(max_model_len=100, slots=64, block_size=16) -> RequestPipeline:
    info = ModelInfo("m", max_model_len, 50, (1,), slots, block_size)
    return RequestPipeline(scheduler=None, tokenizer=_Tok(), info=info)


def test_unset_max_tokens_is_the_rest_of_the_context():
    p = _pipeline(max_model_len=100, slots=64)  # context = min(100, 64) = 64
    assert (
        p.preparer.prepare(GenerateInput(text="x" * 10), SamplingRequest()).sampling.max_tokens
        == 54
    )
    assert (
        p.preparer.prepare(
            GenerateInput(text="x" * 10), SamplingRequest(max_tokens=7)
        ).sampling.max_tokens
        == 7
    )
    # beam search: 4 blocks of 16 split over 2 beams -> 32 slots each
    req = SamplingRequest(beam_width=2)
    assert p.preparer.prepare(GenerateInput(text="x" * 10), req).sampling.max_tokens == 22
    big = _pipeline(max_model_len=40, slots=640)
    assert (
        big.preparer.prepare(GenerateInput(text="x" * 10), SamplingRequest()).sampling.max_tokens
        == 30
    )
    with pytest.raises(InvalidRequest, match="no room"):
        p.preparer.prepare(GenerateInput(text="x" * 64), SamplingRequest())
    with pytest.raises(RequestRejected):
        p.preparer.prepare(GenerateInput(text="x" * 10), SamplingRequest(max_tokens=60))
    with pytest.raises(InvalidRequest, match="min_tokens"):
        p.preparer.prepare(GenerateInput(text="x" * 60), SamplingRequest(min_tokens=5))


def test_completion_body_maps_to_the_shared_sampling_request():
    body = parse_body(
        {
            "model": "m",
            "prompt": ["ab", "c"],
            "stop": "\n",
            "max_tokens": 5,
            "temperature": 0,
            "n": 2,
            "seed": 3,
            "logprobs": 2,
            "top_k": 4,
            "min_tokens": 1,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "cache_salt": "s",
            "surprise": {"ignored": True},
        },
        CompletionRequest,
    )
    body.check_supported()
    s = sampling_request(body)
    assert (s.max_tokens, s.temperature, s.n, s.seed, s.logprobs, s.top_k) == (5, 0, 2, 3, 2, 4)
    assert (s.stop, s.min_tokens, s.repetition_penalty, s.ignore_eos) == (("\n",), 1, 1.1, True)
    assert s.cache_salt == "s" and s.beam_width is None
    assert completion_inputs(body) == [GenerateInput(text="ab"), GenerateInput(text="c")]
    ids = parse_body({"model": "m", "prompt": [1, 2]}, CompletionRequest)
    assert completion_inputs(ids) == [GenerateInput(token_ids=(1, 2))]
    beam = parse_body(
        {"model": "m", "prompt": "a", "n": 3, "use_beam_search": True}, CompletionRequest
    )
    assert sampling_request(beam).beam_width == 3


def test_chat_body_maps_messages_and_logprobs():
    body = parse_body(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "sys"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            "max_tokens": 9,
            "max_completion_tokens": 4,
            "logprobs": True,
            "top_logprobs": 3,
        },
        ChatCompletionRequest,
    )
    body.check_supported()
    assert chat_input(body).messages == (("system", "sys"), ("user", "a\nb"), ("assistant", ""))
    s = sampling_request(body)
    assert (s.max_tokens, s.logprobs) == (4, 3)
    no_lp = parse_body(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}, ChatCompletionRequest
    )
    assert sampling_request(no_lp).logprobs is None


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 1}, "top_logprobs"),
        ({"modalities": ["audio"]}, "modalities"),
    ],
)
def test_unsupported_chat_fields_name_the_field(extra, param):
    body = parse_body(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra},
        ChatCompletionRequest,
    )
    with pytest.raises(InvalidRequest) as ei:
        body.check_supported()
    assert ei.value.param == param


def test_parse_errors_name_the_field():
    with pytest.raises(InvalidRequest) as ei:
        parse_body({"prompt": "x"}, CompletionRequest)
    assert ei.value.param == "model"
    with pytest.raises(InvalidRequest) as ei:
        parse_body({"model": "m", "prompt": "x", "temperature": "hot"}, CompletionRequest)
    assert ei.value.param == "temperature"
    body = parse_body(
        {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, ChatCompletionRequest
    )
    with pytest.raises(InvalidRequest) as ei:
        chat_input(body)
    assert ei.value.param == "messages[0].role"


def test_errors_map_to_http_statuses_by_one_lookup():
    fields = frozenset(CompletionRequest.model_fields)
    assert error_json(InvalidRequest("temperature must be in [0, 2]"), fields) == (
        400,
        {
            "error": {
                "message": "temperature must be in [0, 2]",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": "invalid_argument",
            }
        },
    )
    assert error_json(ModelNotFound("no", "model"))[0] == 404
    assert error_json(ModelNotFound("no", "model"))[1]["error"]["code"] == "model_not_found"
    assert error_json(RequestRejected("too big"))[0] == 400
    assert error_json(DuplicateRequest("dup"))[0] == 409
    assert error_json(ClusterUnavailable("down"))[0] == 503
    assert set(HTTP_STATUS) >= {"INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE", "INTERNAL"}


# ---------------------------------------------------------------------- through the HTTP app
MODEL = "m"  # the name build_http_app serves for ModelInfo "m"


def _app(pipeline: RequestPipeline | None = None) -> Any:
    return build_http_app(ClusterConfig(), pipeline or _pipeline())


def _request(method: str, path: str, body: Any = None, app: Any = None) -> httpx.Response:
    """One request to the app; ``body`` a dict (sent as JSON) or raw bytes."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app or _app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            content = body if isinstance(body, bytes) or body is None else json.dumps(body)
            headers = {"content-type": "application/json"}
            return await client.request(method, path, content=content, headers=headers)

    return asyncio.run(go())


def _error(r: httpx.Response, status: int, param: str | None, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    return err


def _completion(**fields: Any) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


LONE = "\ud800"  # a lone surrogate; json.dumps writes it as the escape \ud800


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", _completion(prompt=f"{LONE} hi"), "prompt"),
        ("/v1/completions", _completion(prompt=f"{LONE} hi", stream=True), "prompt"),
        ("/v1/completions", _completion(prompt=["ok", LONE]), "prompt"),
        ("/v1/completions", _completion(stop=["a", LONE]), "stop"),
        ("/v1/completions", _completion(cache_salt=LONE), "cache_salt"),
        ("/v1/completions", _completion(user="\udfff"), "user"),
        ("/v1/completions", _completion(model=LONE), "model"),
        ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": LONE}]), "messages"),
        (
            "/v1/chat/completions",
            _chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
            "messages",
        ),
        ("/v1/chat/completions", _chat(logit_bias={LONE: 1}), "logit_bias"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(path, body, param):
    r = _request("POST", path, json.dumps(body).encode())
    err = _error(r, 400, param, "invalid_argument")
    assert "not valid Unicode" in err["message"] and "U+D" in err["message"]


def test_a_surrogate_pair_is_valid_text():
    pipeline = _pipeline()
    _fake_generate(pipeline)
    body = b'{"model": "m", "prompt": "\\ud83d\\ude00 \\\\ud800", "max_tokens": 2}'
    ok = _request("POST", "/v1/completions", body, _app(pipeline))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "prompt, req, field",
    [
        (GenerateInput(text="a\ud800"), SamplingRequest(), "text"),
        (GenerateInput(messages=(("user", "\udc00"),)), SamplingRequest(), "chat"),
        (GenerateInput(text="a"), SamplingRequest(stop=("\ud800",)), "stop"),
        (GenerateInput(text="a"), SamplingRequest(cache_salt="\ud800"), "cache_salt"),
    ],
)
def test_pipeline_refuses_lone_surrogates_naming_the_field(prompt, req, field):
    with pytest.raises(InvalidRequest, match="not valid Unicode") as ei:
        _pipeline().preparer.prepare(prompt, req)
    assert ei.value.param == field


def test_deeply_nested_json_is_the_invalid_json_400():
    deep = b'{"model":"m","prompt":"Hi","max_tokens":2,"x":' + b"[" * 100_000 + b"]" * 100_000
    err = _error(_request("POST", "/v1/completions", deep + b"}"), 400, None, "invalid_argument")
    assert err["message"].startswith("the body is not valid JSON")
    bad = _error(_request("POST", "/v1/completions", b"{not json"), 400, None, "invalid_argument")
    assert bad["message"].startswith("the body is not valid JSON")


@pytest.mark.parametrize(
    "path, body, param, code",
    [
        ("/v1/completions", _completion(prompt=""), "prompt", "invalid_argument"),
        ("/v1/completions", _completion(prompt=[[]]), "prompt", "invalid_argument"),
        ("/v1/completions", _completion(prompt=[-1]), "prompt", "invalid_argument"),
        ("/v1/completions", _completion(prompt=[[1], [99]]), "prompt", "invalid_argument"),
        # prompt 2 + 70 fits max_model_len 100, not the 64-slot pool
        ("/v1/completions", _completion(max_tokens=70), "max_tokens", "resource_exhausted"),
        ("/v1/chat/completions", _chat(max_tokens=70), "max_tokens", "resource_exhausted"),
        (
            "/v1/chat/completions",
            _chat(max_tokens=2, max_completion_tokens=70),
            "max_completion_tokens",
            "resource_exhausted",
        ),
        ("/v1/completions", _completion(use_beam_search=True, n=17), "n", "invalid_argument"),
        ("/v1/completions", _completion(stop=["x"] * 17), "stop", "invalid_argument"),
        (
            "/v1/chat/completions",
            _chat(logprobs=True, top_logprobs=21),
            "top_logprobs",
            "invalid_argument",
        ),
    ],
)
def test_pipeline_refusals_name_the_http_field(path, body, param, code):
    err = _error(_request("POST", path, body), 400, param, code)
    assert "beam_width" not in err["message"]


def test_error_param_maps_pipeline_names_to_the_bodys():
    fields = frozenset(CompletionRequest.model_fields)
    body = parse_body({"model": "m", "prompt": "x"}, CompletionRequest)
    cases = [
        (InvalidRequest("token_ids: token id 99 is out of range"), "prompt"),
        (InvalidRequest("the prompt text is empty", "text"), "prompt"),
        (InvalidRequest("beam_width must be in [1, 16], got 17"), "n"),
        (RequestRejected("max_tokens: a sequence needs 72 KV slots"), "max_tokens"),
        (InvalidRequest("request_id is longer than 256 characters"), None),
        (ClusterUnavailable("max_tokens: not a refusal of the request"), None),
    ]
    for exc, param in cases:
        assert error_json(exc, fields, body.http_param)[1]["error"]["param"] == param, exc


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", _completion(prompt=[True, False]), "prompt"),
        ("/v1/completions", _completion(prompt=[[1, True]]), "prompt"),
        ("/v1/completions", _completion(max_tokens="2"), "max_tokens"),
        ("/v1/completions", _completion(max_tokens=True), "max_tokens"),
        ("/v1/completions", _completion(max_tokens=2.0), "max_tokens"),
        ("/v1/completions", _completion(stream="yes"), "stream"),
        ("/v1/completions", _completion(temperature="0.5"), "temperature"),
        ("/v1/completions", _completion(temperature=True), "temperature"),
        ("/v1/completions", _completion(n="2"), "n"),
        ("/v1/completions", _completion(ignore_eos="true"), "ignore_eos"),
        ("/v1/chat/completions", _chat(logprobs=1), "logprobs"),
        (
            "/v1/chat/completions",
            _chat(stream=True, stream_options={"include_usage": "yes"}),
            "stream_options.include_usage",
        ),
    ],
)
def test_loosely_typed_fields_are_400_naming_the_field(path, body, param):
    _error(_request("POST", path, body), 400, param, "invalid_argument")


def test_a_value_of_no_union_type_names_the_types():
    with pytest.raises(InvalidRequest) as ei:
        parse_body(_completion(prompt=[True, False]), CompletionRequest)
    assert str(ei.value) == "prompt: Input should be one of str | list[str] | list[int] | " + (
        "list[list[int]]"
    )
    assert ei.value.param == "prompt"


def test_floats_still_take_integers():
    body = parse_body(_completion(temperature=0, top_p=1, presence_penalty=-2), CompletionRequest)
    assert (body.temperature, body.top_p, body.presence_penalty) == (0.0, 1.0, -2.0)


def test_unknown_routes_and_methods_get_the_openai_error_shape():
    err = _error(_request("GET", "/v1/nope"), 404, None, "not_found")
    assert "/v1/nope" in err["message"]
    r = _request("GET", "/v1/completions")
    _error(r, 405, None, "method_not_allowed")
    assert r.headers["allow"] == "POST"
    _error(_request("POST", "/v1/models", {}), 405, None, "method_not_allowed")
    err = _error(_request("GET", "/v1/models/gpt-4o"), 404, "model", "model_not_found")
    assert "gpt-4o" in err["message"]


def _fake_generate(pipeline: RequestPipeline) -> None:
    """Every choice of a request: one token "a", then LENGTH."""

    async def generate(req: EngineRequest, flight: Any):
        for i in range(req.sampling.n):
            usage = Usage(len(req.prompt_token_ids), 1, 0)
            yield ChoiceDelta(i, (0,), "a", finish_reason=FinishReason.LENGTH, usage=usage)

    pipeline._generate = generate  # type: ignore[method-assign]


def test_the_openai_client_still_works_with_strict_types():
    pipeline = _pipeline()
    _fake_generate(pipeline)
    app = _app(pipeline)

    async def go() -> None:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with openai.AsyncOpenAI(
            base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0
        ) as client:
            card = await client.models.retrieve(MODEL)
            listed = (await client.models.list()).data[0]
            assert card.model_dump() == listed.model_dump()
            assert (card.id, card.object, card.owned_by) == (MODEL, "model", "pagedserve")
            with pytest.raises(openai.NotFoundError) as ei:
                await client.models.retrieve("nope")
            assert ei.value.response.json()["error"]["code"] == "model_not_found"
            r = await client.completions.create(
                model=MODEL,
                prompt=["ab", "c"],
                max_tokens=3,
                temperature=0,
                top_p=1,
                n=2,
                seed=7,
                stop=["x"],
                presence_penalty=0,
                frequency_penalty=0.5,
                user="u",
                extra_body={"top_k": 4, "ignore_eos": True, "return_token_ids": True},
            )
            assert [c.index for c in r.choices] == [0, 1, 2, 3]
            stream = await client.completions.create(
                model=MODEL,
                prompt=[1, 2],
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert chunks[-1].usage.completion_tokens == 1
            assert all(c.usage is None for c in chunks[:-1])
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "q"}],
                max_tokens=3,
                n=2,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            )
            chunks = [c async for c in stream]
            prompt = chunks[-1].usage.prompt_tokens
            assert prompt > 0
            # vLLM's continuous usage: each chunk carries its choice's usage so far (the
            # role chunks 0 tokens, each "a" 1), then the request's total.
            seen = [(c.choices[0].index, c.usage.completion_tokens) for c in chunks[:-1]]
            assert seen == [(0, 0), (1, 0), (0, 1), (1, 1)]
            assert all(c.usage.prompt_tokens == prompt for c in chunks[:-1])
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
            chat = await client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": [{"type": "text", "text": "q"}]},
                ],
                max_completion_tokens=3,
                temperature=0.5,
                logprobs=False,
                n=1,
            )
            assert chat.choices[0].message.content == "a"

    asyncio.run(go())
