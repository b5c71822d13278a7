"""End to end through the real gRPC server, Ray actors and SmolLM2 (greedy = HF greedy)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.cluster.client import AsyncClient, Client, build_request
from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc as pb_grpc

NUM_BLOCKS = 192  # must match tests/cluster/conftest.py

pytestmark = [pytest.mark.slow, pytest.mark.model]

CHAT = "What is the capital of France?"


@pytest.fixture(scope="module")
def hf(served_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served_model_dir)
    model = AutoModelForCausalLM.from_pretrained(served_model_dir, torch_dtype=torch.float32)
    model.eval()

    def greedy(prompt_ids: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.eos_token_id,
            )
        return out[0, len(prompt_ids) :].tolist()

    return tok, greedy


def wait_all_free(client: Client, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.stats()
        w = st["workers"][0]
        idle = st["num_requests_running"] == 0 and st["num_requests_waiting"] == 0
        if idle and w["num_free_blocks"] == w["num_blocks"]:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks not freed: {st}")
        time.sleep(0.1)


def test_chat_capital_of_france_matches_hf(address, hf):
    tok, greedy = hf
    with Client(address, timeout_s=300) as c:
        r = c.generate(chat=[{"role": "user", "content": CHAT}], max_tokens=32, temperature=0)
    choice = r.choices[0]
    assert choice.text.startswith("The capital of France is Paris.")
    text = tok.apply_chat_template(
        [{"role": "user", "content": CHAT}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    ref = greedy(prompt_ids, 32)
    if tok.eos_token_id in ref:
        ref = ref[: ref.index(tok.eos_token_id) + 1]
    assert choice.token_ids == ref
    assert r.usage["prompt_tokens"] == len(prompt_ids)
    assert r.usage["completion_tokens"] == len(ref)
    assert choice.text == tok.decode(ref, skip_special_tokens=True)


def test_raw_token_ids_and_concurrent_requests_match_hf(address, hf):
    tok, greedy = hf
    prompts = [
        "The three primary colors are",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "Water boils at a temperature of",
    ]
    ids = [tok(p)["input_ids"] for p in prompts]
    refs = [greedy(p, 24) for p in ids[:2]]

    def one(p):
        with Client(address, timeout_s=300) as c:
            return c.generate(token_ids=p, max_tokens=24, temperature=0, ignore_eos=True)

    with ThreadPoolExecutor(len(ids)) as ex:
        results = list(ex.map(one, ids))
    for r, ref in zip(results[:2], refs):
        assert r.choices[0].token_ids == ref
        assert r.choices[0].finish_reason == "length"
    # The same prompt alone gives the same tokens as inside a busy batch.
    alone = one(ids[3])
    assert alone.choices[0].token_ids == results[3].choices[0].token_ids
    with Client(address) as c:
        wait_all_free(c)


def test_async_client_streams_concurrently_on_one_channel(address, hf):
    """AsyncClient: 4 streams at once over one grpc.aio channel give HF's greedy tokens,
    the same deltas as the blocking client, stats, and server errors as AioRpcError."""
    import asyncio

    tok, greedy = hf
    prompts = ["The three primary colors are", "def fibonacci(n):", "Water boils at", "Hi"]
    ids = [tok(p)["input_ids"] for p in prompts]
    refs = [greedy(p, 12) for p in ids[:2]]

    async def main():
        async with AsyncClient(address, timeout_s=300) as c:
            await c.wait_ready()
            results = await asyncio.gather(
                *(c.generate(token_ids=p, max_tokens=12, temperature=0, ignore_eos=True)
                  for p in ids)
            )  # fmt: skip
            deltas = [d async for d in c.stream(token_ids=ids[0], max_tokens=12, temperature=0)]
            st = await c.stats()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.generate(token_ids=ids[0], max_tokens=4, temperature=-1.0)
            aborted = await c.abort("no-such-request")
        return results, deltas, st, err.value, aborted

    results, deltas, st, err, aborted = asyncio.run(main())
    for r, ref in zip(results[:2], refs):
        assert r.choices[0].token_ids == ref and r.choices[0].finish_reason == "length"
        assert r.usage["completion_tokens"] == 12
    assert [t for d in deltas for t in d.token_ids] == refs[0][
        : sum(len(d.token_ids) for d in deltas)
    ]
    assert deltas[-1].finish_reason is not None and deltas[-1].usage is not None
    assert st["workers"][0]["num_blocks"] == NUM_BLOCKS
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.details()
    assert aborted is True  # never seen: its Generate may be on the way (remembered)
    with Client(address) as c:
        assert (
            c.generate(token_ids=ids[1], max_tokens=12, temperature=0, ignore_eos=True)
            .choices[0]
            .token_ids
            == results[1].choices[0].token_ids
        )
        wait_all_free(c)


def test_prefix_cache_hit_is_reported_and_identical(address):
    long_prompt = "You are a helpful assistant. " * 8 + "Name a fruit:"
    with Client(address, timeout_s=300) as c:
        first = c.generate(long_prompt, max_tokens=8, temperature=0)
        second = c.generate(long_prompt, max_tokens=8, temperature=0)
    assert second.usage["cached_tokens"] >= 16
    assert second.usage["cached_tokens"] % 16 == 0
    assert second.choices[0].token_ids == first.choices[0].token_ids


def test_seeded_sampling_is_reproducible(address):
    kw = dict(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    with Client(address, timeout_s=300) as c:
        a = c.generate("My favourite animal is", **kw)
        b = c.generate("My favourite animal is", **kw)
        d = c.generate("My favourite animal is", **{**kw, "seed": 99})
    assert a.choices[0].token_ids == b.choices[0].token_ids
    assert len(a.choices[0].token_ids) == 12
    assert a.choices[0].token_ids != d.choices[0].token_ids


def test_stop_string_cuts_text(address):
    with Client(address, timeout_s=300) as c:
        r = c.generate(
            chat=[{"role": "user", "content": CHAT}], max_tokens=32, temperature=0, stop=["Paris"]
        )
    assert r.choices[0].text == "The capital of France is "
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=10**6), "max_tokens"),
        (dict(n=0), "n must"),
        (dict(stop=[""]), "stop"),
        (dict(logprobs=21), "logprobs"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(min_tokens=9, max_tokens=8), "min_tokens"),
        (dict(cache_salt=""), "cache_salt"),
        (dict(beam_width=17), "beam_width"),
        (dict(beam_width=2, n=3), "beam_width"),
        (dict(beam_width=2, length_penalty=float("inf")), "length_penalty"),
    ],
)
def test_bad_sampling_values_are_invalid_argument(address, kwargs, fragment):
    with Client(address) as c, pytest.raises(grpc.RpcError) as ei:
        c.generate("hello", **kwargs)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in ei.value.details()


def test_bad_inputs(address):
    with Client(address) as c:
        for kwargs, code in [
            (dict(token_ids=[10**6]), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(chat=[{"role": "wizard", "content": "x"}]), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(prompt="hi " * 6000, max_tokens=8), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(prompt="hi", max_tokens=3500), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ]:
            with pytest.raises(grpc.RpcError) as ei:
                prompt = kwargs.pop("prompt", None)
                c.generate(prompt, **kwargs)
            assert ei.value.code() == code, (kwargs, ei.value.details())
            assert ei.value.details()
        # A request with no input at all (raw stub).
        stub = pb_grpc.GenerationStub(c._channel)
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(pb.GenerateRequest()))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        wait_all_free(c)


def test_cancel_and_abort_free_blocks(address, cluster):
    handle, _lt = cluster
    with Client(address, timeout_s=300) as c:
        it = c.stream(
            "Tell me a long story.",
            max_tokens=400,
            temperature=0,
            ignore_eos=True,
            request_id="to-cancel",
        )
        first = next(it)
        assert first.request_id == "to-cancel"
        it.close()  # cancels the RPC: the server aborts the request
        # Abort through the API while streaming in another thread.
        got: list = []

        def consume():
            for d in c.stream(
                "Count to one hundred:",
                max_tokens=400,
                ignore_eos=True,
                temperature=0,
                request_id="to-abort",
            ):
                got.append(d)

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.abort("to-abort") is True
        t.join(timeout=60)
        assert got[-1].finish_reason == "abort"
        assert c.abort("to-abort") is False
        wait_all_free(c)
    import ray

    assert ray.get(handle.scheduler.check_integrity.remote(), timeout=30) is True


def test_abort_that_overtakes_its_generate_ends_it_at_once(address):
    """Abort, then Generate with the same id (the order two RPCs may reach the server in):
    the Abort is answered True, the Generate ends at once with ABORT, no block is used."""
    with Client(address, timeout_s=120) as c:
        assert c.abort("overtaken") is True
        r = c.generate("Tell me a long story.", max_tokens=200, n=2, request_id="overtaken")
        assert [(ch.finish_reason, ch.token_ids) for ch in r.choices] == [("abort", [])] * 2
        st = c.stats()  # at once: the request never reached the scheduler
        w = st["workers"][0]
        assert (st["num_requests_running"], st["num_requests_waiting"]) == (0, 0)
        assert w["num_free_blocks"] == w["num_blocks"]
        assert c.abort("overtaken") is False  # it had finished


def test_stats_health_and_reflection(address):
    with Client(address) as c:
        st = wait_all_free(c)
    assert st["workers"][0]["num_blocks"] == NUM_BLOCKS
    assert st["workers"][0]["block_size"] == 16
    assert st["workers"][0]["num_used_blocks"] == 0
    with grpc.insecure_channel(address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"), timeout=10
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        names = [
            s.name
            for r in stub.ServerReflectionInfo(iter([req]), timeout=10)
            for s in r.list_services_response.service
        ]
    assert "pagedserve.v1.Generation" in names
    assert "grpc.health.v1.Health" in names


def test_build_request_requires_one_input():
    with pytest.raises(ValueError):
        build_request("a", token_ids=[1])


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_tokens": -3}, "max_tokens: Value out of range: -3"),
        ({"n": 2**32}, "n: Value out of range"),
        ({"temperature": "hot"}, "temperature: "),
        ({"stop": ["ok", "\ud800"]}, "stop: 'utf-8' codec can't encode"),
        ({"prompt": "\ud800 hi"}, "prompt: 'utf-8' codec can't encode"),
        ({"prompt": None, "token_ids": [5, -1]}, "token_ids: Value out of range: -1"),
    ],
)
def test_build_request_names_the_field_a_value_does_not_fit(kwargs, fragment):
    args = {"prompt": "hi", **kwargs}
    if args["prompt"] is None:
        del args["prompt"]
    prompt = args.pop("prompt", None)
    with pytest.raises(ValueError) as info:
        build_request(prompt, **args)
    assert str(info.value).startswith(fragment)


def test_cli_prints_each_of_n_choices_whole_and_names_bad_fields(address, capsys):
    from pagedserve.cluster.cli import main

    argv = ["generate", "--address", address, "--max-tokens", "6", "--ignore-eos"]
    argv += ["--temperature", "0.9", "--seed", "5", "--n", "3", "A pet goldfish name:"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    with Client(address, timeout_s=120) as c:
        ref = c.generate(
            "A pet goldfish name:", max_tokens=6, ignore_eos=True, temperature=0.9, seed=5, n=3
        )
    blocks = [f"[{ch.index}] {ch.text}\n" for ch in ref.choices]  # in finishing order
    assert all(b in out for b in blocks) and len(out) == sum(map(len, blocks))
    assert main(["generate", "--address", address, "--max-tokens", "-3", "Hi"]) == 2
    assert "max_tokens: Value out of range: -3" in capsys.readouterr().err


def test_huge_text_prompt_is_refused_before_tokenizing(address):
    with Client(address, timeout_s=60) as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            c.generate("lorem ipsum " * 400_000, max_tokens=4)  # 4.8 MB
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot fit" in ei.value.details()
        assert time.monotonic() - t0 < 5.0


def test_request_id_reuse_after_cancel(address):
    with Client(address, timeout_s=120) as c:
        for attempt in range(3):
            it = c.stream(
                "Write a long essay.",
                max_tokens=200,
                ignore_eos=True,
                temperature=0,
                request_id="reused",
            )
            next(it)
            it.close()
            for _ in range(50):  # the server may not have seen the cancel yet
                try:
                    r = c.generate(
                        "Hi", max_tokens=2, temperature=0, ignore_eos=True, request_id="reused"
                    )
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.ALREADY_EXISTS, exc.details()
                    time.sleep(0.05)
            else:
                raise AssertionError(f"attempt {attempt}: id never released")
            assert len(r.choices[0].token_ids) == 2
        wait_all_free(c)


def test_logprobs_stop_token_text_and_cache_salt(address, hf):
    tok, greedy = hf
    prompt = "The three primary colors are"
    ids = tok(prompt)["input_ids"]
    ref = greedy(ids, 6)
    with Client(address, timeout_s=300) as c:
        r = c.generate(token_ids=ids, max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
        stop = c.generate(
            token_ids=ids, max_tokens=6, temperature=0, stop_token_ids=[ref[2]], ignore_eos=True
        )
        kept = c.generate(
            token_ids=ids,
            max_tokens=6,
            temperature=0,
            stop_token_ids=[ref[2]],
            include_stop_str_in_output=True,
            ignore_eos=True,
        )
        long_prompt = "Shared context for salting. " * 6 + "Say hi:"
        a = c.generate(long_prompt, max_tokens=1, temperature=0, cache_salt="a")
        b = c.generate(long_prompt, max_tokens=1, temperature=0, cache_salt="b")
        a2 = c.generate(long_prompt, max_tokens=1, temperature=0, cache_salt="a")
        wait_all_free(c)
    choice = r.choices[0]
    assert choice.token_ids == ref
    assert [lp["token_id"] for lp in choice.logprobs] == ref
    assert all(lp["top_logprobs"][0]["token_id"] == t for lp, t in zip(choice.logprobs, ref))
    assert choice.cumulative_logprob == pytest.approx(sum(lp["logprob"] for lp in choice.logprobs))
    assert stop.choices[0].token_ids == ref[:3]
    assert stop.choices[0].stop_reason == ref[2]
    assert stop.choices[0].text == tok.decode(ref[:2])
    assert kept.choices[0].text == tok.decode(ref[:3])
    assert (a.usage["cached_tokens"], b.usage["cached_tokens"]) == (0, 0)
    assert a2.usage["cached_tokens"] >= 16


def test_n_choices_and_beam_search_through_the_server(address, served_model_dir, hf):
    """n>1 (forked from one prefill) and beam search through the real server: every choice
    streams with its index, seeded choices are reproducible, beams equal HF's and are
    sorted by score, and every block comes back."""
    import torch
    from helpers import hf_beams
    from transformers import AutoModelForCausalLM

    tok, _ = hf
    ids = tok("A list of names for a pet goldfish:")["input_ids"]
    kw = dict(token_ids=ids, max_tokens=8, temperature=0.9, seed=5, n=3, ignore_eos=True)
    with Client(address, timeout_s=300) as c:
        a = c.generate(**kw)
        b = c.generate(**kw)
        beams = c.generate(token_ids=ids, max_tokens=8, beam_width=3, n=2, ignore_eos=True)
        wait_all_free(c)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.token_ids for ch in a.choices] == [ch.token_ids for ch in b.choices]
    assert all(len(ch.token_ids) == 8 for ch in a.choices)
    assert len({tuple(ch.token_ids) for ch in a.choices}) > 1
    assert a.usage["prompt_tokens"] == len(ids)

    model = AutoModelForCausalLM.from_pretrained(served_model_dir, torch_dtype=torch.float32)
    ref = hf_beams(model.eval(), ids, 3, 2, 8, 1.0, None)
    assert [ch.index for ch in beams.choices] == [0, 1]
    scores = [ch.score for ch in beams.choices]
    assert scores == sorted(scores, reverse=True)
    for ch, (tokens, score) in zip(beams.choices, ref):
        assert ch.score == pytest.approx(score, abs=1e-4)
        assert ch.token_ids == tokens or any(abs(ch.score - s) < 1e-4 for _, s in ref)
        assert ch.score == pytest.approx(ch.cumulative_logprob / len(ch.token_ids))


def test_cpu_worker_process_has_the_omp_spin_count(cluster):
    """The CPU worker's process runs with GOMP_SPINCOUNT (``--omp-spin-count``, through
    Ray's runtime_env), which libgomp read as torch loaded; the driver's own environment
    is left alone."""
    import os

    import ray

    handle, _ = cluster
    worker_env = ray.get(
        handle.workers[0].__ray_call__.remote(lambda self: os.environ.get("GOMP_SPINCOUNT"))
    )
    assert worker_env == str(handle.config.omp_spin_count) == "1000"
    assert os.environ.get("GOMP_SPINCOUNT") is None
