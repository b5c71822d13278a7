"""The OpenAI-compatible HTTP API through the real server, driven by the official openai client."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import ray

from pagedserve.cluster.client import Client

NUM_BLOCKS = 192  # must match tests/cluster/conftest.py
BLOCK_SIZE = 16

pytestmark = [pytest.mark.slow, pytest.mark.model]

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def base_url(cluster) -> str:
    return f"http://{cluster[0].http_address}/v1"


@pytest.fixture(scope="module")
def oai(base_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def wait_all_free(cluster, timeout_s: float = 30.0) -> None:
    """Every KV block free, nothing running or waiting, and the integrity check passes."""
    handle = cluster[0]
    deadline = time.monotonic() + timeout_s
    with Client(handle.address) as c:
        while True:
            st = c.stats()
            w = st["workers"][0]
            idle = st["num_requests_running"] == 0 and st["num_requests_waiting"] == 0
            if idle and w["num_free_blocks"] == w["num_blocks"] == NUM_BLOCKS:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks not freed: {st}")
            time.sleep(0.1)
    assert ray.get(handle.scheduler.check_integrity.remote(), timeout=30) is True


def test_models_lists_the_served_model(oai, cluster):
    models = oai.models.list().data
    assert len(models) == 1
    assert models[0].id == "SmolLM2-135M-Instruct"
    assert models[0].owned_by == "pagedserve"
    assert models[0].model_extra["max_model_len"] == cluster[0].info.max_model_len


def test_completion_greedy_equals_grpc_with_logprobs(oai, model, cluster):
    prompt = "The three primary colors are"
    with Client(cluster[0].address, timeout_s=300) as c:
        ref = c.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    r = oai.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.model == model
    assert choice.model_extra["token_ids"] == ref.choices[0].token_ids
    assert choice.text == ref.choices[0].text
    assert choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == pytest.approx(
        [lp["logprob"] for lp in ref.choices[0].logprobs]
    )
    assert len(choice.logprobs.tokens) == 8
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0
    prompt_len = len(choice.model_extra["prompt_token_ids"])
    assert r.usage.prompt_tokens == prompt_len == ref.usage["prompt_tokens"]
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == prompt_len + 8
    assert r.usage.prompt_tokens_details.cached_tokens % BLOCK_SIZE == 0


def test_chat_streaming_equals_non_streaming(oai, model):
    full = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert msg.role == "assistant"
    assert msg.content.startswith("The capital of France is Paris.")
    stream = oai.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_text_parts_and_developer_role_render_like_strings(oai, model):
    plain = oai.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, *CHAT],
        max_tokens=4,
        temperature=0,
    )
    parts = oai.chat.completions.create(
        model=model,
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]},
        ],
        max_tokens=4,
        temperature=0,
    )
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_n2_with_seed_and_streaming_completions(oai, model):
    kw = dict(model=model, prompt="My favourite animal is", max_tokens=6, temperature=1.0, n=2)
    a = oai.completions.create(seed=7, extra_body={"ignore_eos": True}, **kw)
    b = oai.completions.create(seed=7, extra_body={"ignore_eos": True}, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert all(c.finish_reason == "length" for c in a.choices)
    assert a.usage.completion_tokens == 12
    stream = oai.completions.create(
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **kw,
    )
    texts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.text for c in a.choices]
    assert usage.completion_tokens == 12


def test_list_of_prompts_gives_choices_in_prompt_order(oai, model):
    prompts = ["The capital of Italy is", "Two plus two equals"]
    singles = [
        oai.completions.create(model=model, prompt=p, max_tokens=4, temperature=0).choices[0].text
        for p in prompts
    ]
    r = oai.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == singles


def test_stop_string_and_max_tokens_length(oai, model):
    r = oai.chat.completions.create(
        model=model, messages=CHAT, max_tokens=32, temperature=0, stop="Paris"
    )
    assert r.choices[0].message.content == "The capital of France is "
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "Paris"
    chunks = list(
        oai.chat.completions.create(
            model=model, messages=CHAT, max_tokens=32, temperature=0, stop=["Paris"], stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is "
    short = oai.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=3, temperature=0
    )
    assert short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 3


def test_chat_logprobs_follow_openai_shape(oai, model):
    r = oai.chat.completions.create(
        model=model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content).startswith("The capital")
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: best first
        assert bytes(t.bytes).decode() == t.token


def test_unset_max_tokens_means_the_rest_of_the_context(base_url, model, cluster):
    # The context of one sequence is min(max_model_len 4096, the pool's 3072 slots); a
    # prompt of 3056 tokens without max_tokens gets exactly the remaining 16 (the old
    # fixed default of 64 made this request unservable).
    ids = [(i % 500) + 100 for i in range(3056)]
    r = httpx.post(
        f"{base_url}/completions",
        json={"model": model, "prompt": ids, "temperature": 0, "ignore_eos": True},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 3056
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "length"
    wait_all_free(cluster)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=5), "temperature"),
        (dict(n=0), "n"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(extra_body={"priority": 2**40}), "priority"),
        (dict(extra_body={"min_tokens": 9}, max_tokens=8), "min_tokens"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(echo=True), "echo"),
        (dict(extra_body={"cache_salt": ""}), "cache_salt"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(oai, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model=model, prompt="hi", **{"max_tokens": 4, **kwargs})
    err = ei.value.response.json()["error"]
    assert ei.value.status_code == 400
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert param in err["message"]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (
            dict(
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            ),
            "messages[0].content[0].type",
        ),
        (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema",
        ),
        (dict(top_logprobs=2), "top_logprobs"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(oai, model, kwargs, param):
    args = {"model": model, "messages": CHAT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(**args)
    assert ei.value.response.json()["error"]["param"] == param


def test_raw_http_errors_keep_the_server_serving(base_url, model, cluster, oai):
    with httpx.Client(timeout=60) as h:
        cases = [
            (dict(content=b"{not json"), 400, None),
            (dict(content=b"[1, 2]"), 400, None),
            (dict(json={"prompt": "hi"}), 400, "model"),
            (dict(json={"model": model}), 400, "prompt"),
            (dict(json={"model": model, "prompt": "x" * (17 << 20)}), 400, None),
            (dict(json={"model": model, "prompt": "hi", "max_tokens": 3500}), 400, "max_tokens"),
        ]
        for kw, status, param in cases:
            r = h.post(
                f"{base_url}/completions", headers={"content-type": "application/json"}, **kw
            )
            assert r.status_code == status, (kw.keys(), r.text[:200])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["message"]
            assert err["param"] == param
        missing = h.post(f"{base_url}/chat/completions", json={"model": "gpt-4o", "messages": CHAT})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        # Unknown fields are ignored, as OpenAI does.
        ok = h.post(
            f"{base_url}/completions",
            json={"model": model, "prompt": "hi", "max_tokens": 2, "no_such_field": [1]},
        )
        assert ok.status_code == 200, ok.text
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="hi", max_tokens=2)
    wait_all_free(cluster)


def test_client_disconnect_mid_stream_frees_blocks(base_url, model, cluster):
    body = {
        "model": model,
        "prompt": "Tell me a very long story about a dragon.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=120) as h,
        h.stream("POST", f"{base_url}/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        chunk = json.loads(first[len("data: ") :])
        assert chunk["object"] == "text_completion"
        with Client(cluster[0].address) as c:
            assert c.stats()["workers"][0]["num_free_blocks"] < NUM_BLOCKS
    # Leaving the block closes the connection mid-stream.
    wait_all_free(cluster)
