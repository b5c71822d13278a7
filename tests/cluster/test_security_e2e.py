"""The real server with an API key and TLS on every surface (gRPC, the OpenAI HTTP API, and
the host block store it swaps through), the CLI client's --api-key / --tls-ca, request size
limits, and cache_salt isolation."""

from __future__ import annotations

import json
import ssl
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import ray
from tiny_cluster import assert_all_blocks_free, running_cluster
from tls_certs import TlsFiles, make_tls_files

from pagedserve.cluster.cli import main
from pagedserve.cluster.client import Client
from pagedserve.cluster.config import SchedulerConfig
from pagedserve.v1 import kv_transfer_pb2 as kv_pb
from pagedserve.v1 import kv_transfer_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

KEY = "test-key-0123"
PROMPT_IDS = [5, 17, 33, 9, 100, 64, 2, 77, 31, 40, 41, 42]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tls):
    # A small pool and swap preemption: long requests side by side must swap through the
    # store the cluster starts, which takes the server's key and serves TLS.
    with running_cluster(
        tiny_llama_dir,
        num_blocks=24,
        scheduler=SchedulerConfig(preemption_mode="swap", host_prefix_cache=False),
        swap_space=64 << 20,
        http_port=0,
        api_key=KEY,
        tls_cert=tls.server_cert,
        tls_key=tls.server_key,
        max_message_bytes=1 << 20,
    ) as (handle, _):
        yield handle
        with Client(handle.address, timeout_s=30, api_key=KEY, tls_ca=tls.ca) as c:
            assert_all_blocks_free(handle, c)
            swap = c.stats()["swap"]
        assert swap["host_blocks_free"] == swap["host_blocks_total"] > 0
        (store,) = handle.host_stores.values()  # one node: one store
        assert ray.get(store.used_bytes.remote(), timeout=30) == 0


def _client(server, tls, **kwargs) -> Client:
    kwargs.setdefault("api_key", KEY)
    return Client(server.address, timeout_s=120, tls_ca=tls.ca, **kwargs)


def _error(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code(), ei.value.details() or ""


def test_grpc_needs_the_key_over_tls(server, tls):
    kw = dict(token_ids=PROMPT_IDS, max_tokens=6, temperature=0, ignore_eos=True)
    with _client(server, tls) as c:
        r = c.generate(**kw)
    assert len(r.choices[0].token_ids) == 6 and r.choices[0].finish_reason == "length"
    for api_key in (None, "wrong"):
        with _client(server, tls, api_key=api_key) as c:
            assert _error(lambda c=c: c.generate(**kw))[0] == grpc.StatusCode.UNAUTHENTICATED
            assert _error(c.stats)[0] == grpc.StatusCode.UNAUTHENTICATED
    with Client(server.address, timeout_s=10, api_key=KEY) as c:  # plaintext to a TLS port
        assert _error(c.stats)[0] == grpc.StatusCode.UNAVAILABLE


def test_preempted_requests_swap_through_the_authenticated_store(server, tls):
    prompts = [[(7 * i + j) % 120 + 3 for j in range(12)] for i in range(4)]
    kw = dict(max_tokens=100, temperature=0, ignore_eos=True)
    with _client(server, tls) as c:
        before = c.stats()["swap"]
        alone = [c.generate(token_ids=p, **kw).choices[0].token_ids for p in prompts]
        assert c.stats()["swap"]["num_swap_outs"] == before["num_swap_outs"]  # one fits

    def one(prompt: list[int]) -> list[int]:
        with _client(server, tls) as c:
            return c.generate(token_ids=prompt, **kw).choices[0].token_ids

    # 4 x 7 blocks at full length in a pool of 24: preemption, by swap.
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == alone
    with _client(server, tls) as c:
        sw = c.stats()["swap"]
    assert sw["num_swap_outs"] > before["num_swap_outs"]
    assert (
        sw["num_swap_ins"] - before["num_swap_ins"] == sw["num_swap_outs"] - before["num_swap_outs"]
    )
    assert sw["swap_in_bytes"] == sw["swap_out_bytes"] > 0
    assert sw["num_swap_failures"] == 0  # every transfer got through the key and TLS
    # The store is TLS only, with a certificate of its own, and needs the server's key.
    (store,) = server.host_stores.values()
    store_address = ray.get(store.address.remote(), timeout=30)
    host, port = store_address.rsplit(":", 1)
    assert host == "127.0.0.1"
    request = kv_pb.HostStoreStatsRequest()
    with grpc.insecure_channel(store_address) as ch:
        code = _error(lambda: pb_grpc.HostBlockStoreStub(ch).GetStats(request, timeout=10))[0]
    assert code == grpc.StatusCode.UNAVAILABLE
    store_cert = ssl.get_server_certificate((host, int(port)), timeout=10).encode()
    assert store_cert != Path(tls.server_cert).read_bytes()
    creds = grpc.ssl_channel_credentials(root_certificates=store_cert)
    with grpc.secure_channel(store_address, creds) as ch:
        stub = pb_grpc.HostBlockStoreStub(ch)
        code = _error(lambda: stub.GetStats(request, timeout=10))[0]
        assert code == grpc.StatusCode.UNAUTHENTICATED
        auth = (("authorization", f"Bearer {KEY}"),)
        st = stub.GetStats(request, timeout=10, metadata=auth)
    assert st.swap_out_bytes >= sw["swap_out_bytes"] > 0  # the cluster's transfers were here


def test_cli_client_takes_api_key_and_tls_ca(server, tls, capsys):
    argv = ["generate", "--address", server.address, "--tls-ca", tls.ca, "--output", "json"]
    argv += ["--max-tokens", "5", "--ignore-eos", "Hello there"]
    assert main([*argv, "--api-key", KEY]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["choices"][0]["token_ids"]) == 5
    with _client(server, tls) as c:  # the same greedy tokens through the library
        ref = c.generate("Hello there", max_tokens=5, temperature=0, ignore_eos=True)
    assert out["choices"][0]["token_ids"] == ref.choices[0].token_ids
    assert main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["stats", "--address", server.address, "--tls-ca", tls.ca, "--api-key", KEY]) == 0


def test_http_openai_api_needs_the_key_over_tls(server, tls):
    ctx = ssl.create_default_context(cafile=tls.ca)
    base = f"https://{server.http_address}"
    with httpx.Client(verify=ctx, timeout=60) as http:
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, http_client=http)
        model = oa.models.list().data[0].id
        r = oa.completions.create(
            model=model,
            prompt=PROMPT_IDS,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        with _client(server, tls) as c:
            ref = c.generate(token_ids=PROMPT_IDS, max_tokens=6, temperature=0, ignore_eos=True)
        assert r.choices[0].model_extra["token_ids"] == ref.choices[0].token_ids
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", http_client=http)
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.completions.create(model=model, prompt="hi", max_tokens=2)
        assert ei.value.status_code == 401 and ei.value.code == "invalid_api_key"
        assert http.get(f"{base}/health").status_code == 200  # open for probes
        assert http.get(f"{base}/metrics").status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        metrics = http.get(f"{base}/metrics", headers=auth)
        assert metrics.status_code == 200 and "pagedserve:generation_tokens_total" in metrics.text


def test_cache_salt_isolates_the_prefix_cache(server, tls):
    prompt = "cache salt isolation: forty characters!"  # char tokenizer: 2 full blocks of 16
    assert len(prompt) >= 32
    kw = dict(max_tokens=3, temperature=0, ignore_eos=True)
    with _client(server, tls) as c:
        first = c.generate(prompt, cache_salt="alice", **kw)
        again = c.generate(prompt, cache_salt="alice", **kw)
        other = c.generate(prompt, cache_salt="bob", **kw)
        unsalted = c.generate(prompt, **kw)
        other_again = c.generate(prompt, cache_salt="bob", **kw)
    assert first.usage["cached_tokens"] == 0
    assert again.usage["cached_tokens"] == 32
    assert other.usage["cached_tokens"] == 0  # alice's blocks are not bob's
    assert unsalted.usage["cached_tokens"] == 0  # nor anyone's without a salt
    assert other_again.usage["cached_tokens"] == 32
    ids = first.choices[0].token_ids
    for r in (again, other, unsalted, other_again):
        assert r.choices[0].token_ids == ids


def test_size_limits_name_the_field(server, tls):
    with _client(server, tls) as c:
        code, details = _error(lambda: c.generate("hi", stop_token_ids=[3] * 257, max_tokens=2))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in details
        code, details = _error(lambda: c.generate("hi", stop=["x"] * 17, max_tokens=2))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "stop" in details
        code, details = _error(lambda: c.generate("hi", stop=["x" * 1025], max_tokens=2))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "stop" in details
        chat = [{"role": "user", "content": "a"}] * 1025
        code, details = _error(lambda: c.generate(chat=chat, max_tokens=2))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "chat" in details
        code, details = _error(lambda: c.generate("x" * (2 << 20), max_tokens=2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # over max_message_bytes (1 MiB)
        code, details = _error(lambda: c.generate("hi", n=65, max_tokens=2))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "n must be" in details
    ctx = ssl.create_default_context(cafile=tls.ca)
    url = f"https://{server.http_address}/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(verify=ctx, timeout=60, headers=auth) as http:
        model = http.get(f"https://{server.http_address}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1.0}}
        r = http.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
        body = {"model": model, "prompt": ["hi"] * 129, "max_tokens": 2}
        r = http.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
