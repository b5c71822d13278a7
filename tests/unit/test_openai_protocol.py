"""OpenAI request parsing, its translation to the shared request path, and the default
max_tokens (no cluster: the pipeline's validation runs without a scheduler)."""

from __future__ import annotations

import pytest

from pagedserve.cluster.openai_api import HTTP_STATUS, error_json, parse_body
from pagedserve.cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_input,
    completion_inputs,
    sampling_request,
)
from pagedserve.cluster.pipeline import GenerateInput, ModelInfo, RequestPipeline, SamplingRequest
from pagedserve.scheduler.errors import (
    ClusterUnavailable,
    DuplicateRequest,
    InvalidRequest,
    ModelNotFound,
    RequestRejected,
)


class _Tok:
    def get_vocab(self):
        return {"a": 0, "bb": 1}

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [0] * len(text)}  # one token per character


def _pipeline(max_model_len=100, slots=64, block_size=16) -> RequestPipeline:
    info = ModelInfo("m", max_model_len, 50, (1,), slots, block_size)
    return RequestPipeline(scheduler=None, tokenizer=_Tok(), info=info)


def test_unset_max_tokens_is_the_rest_of_the_context():
    p = _pipeline(max_model_len=100, slots=64)  # context = min(100, 64) = 64
    assert p.prepare(GenerateInput(text="x" * 10), SamplingRequest()).sampling.max_tokens == 54
    assert (
        p.prepare(GenerateInput(text="x" * 10), SamplingRequest(max_tokens=7)).sampling.max_tokens
        == 7
    )
    # beam search: 4 blocks of 16 split over 2 beams -> 32 slots each
    req = SamplingRequest(beam_width=2)
    assert p.prepare(GenerateInput(text="x" * 10), req).sampling.max_tokens == 22
    big = _pipeline(max_model_len=40, slots=640)
    assert big.prepare(GenerateInput(text="x" * 10), SamplingRequest()).sampling.max_tokens == 30
    with pytest.raises(InvalidRequest, match="no room"):
        p.prepare(GenerateInput(text="x" * 64), SamplingRequest())
    with pytest.raises(RequestRejected):
        p.prepare(GenerateInput(text="x" * 10), SamplingRequest(max_tokens=60))
    with pytest.raises(InvalidRequest, match="min_tokens"):
        p.prepare(GenerateInput(text="x" * 60), SamplingRequest(min_tokens=5))


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
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
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
