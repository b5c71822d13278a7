"""API key, TLS / mutual TLS and request parsing on the gRPC and HTTP surfaces, without Ray:
the real grpc.aio server and uvicorn on 127.0.0.1 in front of a servicer whose calls never
reach a scheduler."""

from __future__ import annotations

import ast
import asyncio
import logging
import ssl
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_certs import TlsFiles, make_tls_files

from pagedserve.cluster.auth import (
    API_KEY_ENV,
    ApiKeyMiddleware,
    bearer_matches,
    check_tls_files,
    exposure_warning,
    uvicorn_ssl_options,
)
from pagedserve.cluster.cli import build_parser, serve_config
from pagedserve.cluster.client import Client
from pagedserve.cluster.config import ClusterConfig, ModelConfig, ServerConfig
from pagedserve.cluster.frontend import GenerationServicer, start_server
from pagedserve.cluster.http_server import HttpServer
from pagedserve.cluster.pipeline import RequestPipeline
from pagedserve.cluster.request_prep import ModelInfo
from pagedserve.cluster.wire import find_bad_field
from pagedserve.v1 import generate_pb2 as pb

KEY = "s3cret-key"
GENERATE = "/pagedserve.v1.Generation/Generate"
CLUSTER_DIR = Path(__file__).resolve().parents[2] / "cluster"


class _Tok:
    def get_vocab(self):
        return {"a": 0, "bb": 1}


def _servicer() -> GenerationServicer:
    info = ModelInfo("m", 16, 2, (1,), 64)
    return GenerationServicer(RequestPipeline(scheduler=None, tokenizer=_Tok(), info=info))


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


async def _with_server(config: ServerConfig, body) -> None:
    server, port = await start_server(config, _servicer())
    try:
        await asyncio.to_thread(body, f"127.0.0.1:{port}")
    finally:
        await server.stop(0)


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code(), ei.value.details() or ""


# ---------------------------------------------------------------- helpers and config


def test_bearer_matching_and_exposure_rule():
    assert bearer_matches(f"Bearer {KEY}", KEY)
    assert bearer_matches(f"bearer {KEY}", KEY)  # the scheme is case-insensitive
    assert not bearer_matches(f"Bearer {KEY}x", KEY)
    assert not bearer_matches(f"Basic {KEY}", KEY)
    assert not bearer_matches(KEY, KEY)
    assert not bearer_matches(None, KEY)
    assert not bearer_matches("", KEY)
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("localhost", None) is None
    assert exposure_warning("::1", None) is None
    assert exposure_warning("0.0.0.0", KEY) is None
    msg = exposure_warning("0.0.0.0", None)
    assert msg is not None and "0.0.0.0" in msg and "--api-key" in msg


def test_server_config_validates_tls_and_hides_the_key(tls: TlsFiles):
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServerConfig(tls_cert=tls.server_cert)
    with pytest.raises(ValueError, match="tls_client_ca"):
        ServerConfig(tls_client_ca=tls.ca)
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key=" padded ")
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(api_key="")
    cfg = ServerConfig(api_key=KEY, tls_cert=tls.server_cert, tls_key=tls.server_key)
    assert KEY not in repr(cfg) and cfg.tls
    check_tls_files(tls.server_cert, tls.server_key, tls.ca)
    with pytest.raises(ValueError, match="tls_cert"):
        check_tls_files(tls.server_cert, tls.client_key, None)  # key of another certificate
    with pytest.raises(ValueError, match="tls_cert"):
        check_tls_files("/nonexistent.pem", tls.server_key, None)


def test_cli_flags_and_env_var_reach_the_config(tls: TlsFiles, monkeypatch):
    argv = ["serve", "--tls-cert", tls.server_cert, "--tls-key", tls.server_key]
    argv += ["--tls-client-ca", tls.ca, "--batch-invariant"]
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    cfg = serve_config(build_parser().parse_args(argv))
    assert cfg.server.api_key == "from-env"
    assert (cfg.server.tls_cert, cfg.server.tls_key) == (tls.server_cert, tls.server_key)
    assert cfg.server.tls_client_ca == tls.ca
    assert cfg.model.batch_invariant
    cfg = serve_config(build_parser().parse_args(["serve", "--api-key", "from-flag"]))
    assert cfg.server.api_key == "from-flag" and not cfg.model.batch_invariant
    args = build_parser().parse_args(["generate", "--tls-ca", tls.ca, "--api-key", "k", "hi"])
    assert (args.tls_ca, args.api_key) == (tls.ca, "k")


def test_non_loopback_host_without_key_warns_before_anything_starts(caplog):
    from pagedserve.cluster.launcher import start_cluster

    config = ClusterConfig(
        model=ModelConfig(model="/nonexistent/model/folder", dtype="float32"),
        server=ServerConfig(host="0.0.0.0", port=0),
    )
    with caplog.at_level(logging.WARNING), pytest.raises(Exception):  # noqa: B017
        asyncio.run(start_cluster(config))  # fails at the missing model, before Ray
    assert any("0.0.0.0" in r.getMessage() and "API key" in r.getMessage() for r in caplog.records)


def test_no_pickle_or_eval_in_the_network_layer():
    """The frontends parse protobuf and JSON only (Ray's own channels pickle; see
    docs/operations.md, "Security and limits")."""
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    banned_calls = {"eval", "exec", "compile", "__import__"}
    for path in sorted(CLUSTER_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned_modules, path
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, path
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in banned_calls, f"{path}:{node.lineno}"


# ---------------------------------------------------------------- gRPC


def test_grpc_api_key_guards_every_method_but_health():
    def body(address: str) -> None:
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # open, no key
        with Client(address, timeout_s=10) as c:
            code, details = _code(lambda: c.abort(""))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
            assert _code(c.stats)[0] == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: c.generate("hi"))[0] == grpc.StatusCode.UNAUTHENTICATED
        with Client(address, timeout_s=10, api_key="wrong") as c:
            assert _code(lambda: c.abort(""))[0] == grpc.StatusCode.UNAUTHENTICATED
        with Client(address, timeout_s=10, api_key=KEY) as c:  # through to the servicer
            code, details = _code(lambda: c.abort(""))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in details
        with grpc.insecure_channel(address) as ch:  # unauthenticated junk is not parsed
            raw = ch.unary_stream(GENERATE)
            code, _ = _code(lambda: list(raw(b"\x12\x02\xff\xfe", timeout=10)))
            assert code == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(_with_server(ServerConfig(port=0, api_key=KEY), body))


def test_grpc_malformed_bytes_are_invalid_argument_naming_the_field():
    bad_text = b"\x12\x02\xff\xfe"  # field 2 (text): invalid UTF-8
    stop = b"\x3a\x01\xff"  # SamplingParams field 7 (stop): invalid UTF-8
    bad_stop = b"\x2a" + bytes([len(stop)]) + stop  # GenerateRequest field 5 (sampling)
    msg = b"\x12\x02hi" + b"\x0a\x01\xc3"  # good text, then request_id cut mid-character
    cases = {
        bad_text: "text",
        bad_stop: "sampling.stop",
        msg: "request_id",
        b"\x12\x10ab": "text",  # length 16, 2 bytes follow
        b"\x2a\x03\x08\xff\xff": "sampling.max_tokens",  # varint never ends
    }
    for data, field in cases.items():
        assert find_bad_field(pb.GenerateRequest.DESCRIPTOR, data) == field, data

    def body(address: str) -> None:
        with grpc.insecure_channel(address) as ch:
            raw = ch.unary_stream(GENERATE)
            for data, field in cases.items():
                code, details = _code(lambda d=data: list(raw(d, timeout=10)))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (data, details)
                assert details.startswith(f"{field}:"), details

    asyncio.run(_with_server(ServerConfig(port=0), body))


def test_grpc_tls_and_mutual_tls(tls: TlsFiles):
    def body(address: str) -> None:
        full = dict(tls_ca=tls.ca, tls_cert=tls.client_cert, tls_key=tls.client_key)
        with Client(address, timeout_s=10, **full) as c:  # handshake ok: servicer answers
            assert _code(lambda: c.abort(""))[0] == grpc.StatusCode.INVALID_ARGUMENT
        for kwargs in (
            {"tls_ca": tls.ca},  # no client certificate
            {},  # plaintext against a TLS port
            dict(full, tls_ca=tls.other_ca),  # server certificate from an untrusted CA
        ):
            with Client(address, timeout_s=10, **kwargs) as c:
                assert _code(lambda c=c: c.abort(""))[0] == grpc.StatusCode.UNAVAILABLE

    config = ServerConfig(
        port=0, tls_cert=tls.server_cert, tls_key=tls.server_key, tls_client_ca=tls.ca
    )
    asyncio.run(_with_server(config, body))


# ---------------------------------------------------------------- HTTP


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok\n")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("pagedserve:x 1\n")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": []}

    return app


def test_http_api_key_gives_openai_401_and_leaves_health_open():
    async def scenario() -> None:
        transport = httpx.ASGITransport(app=ApiKeyMiddleware(_app(), KEY))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 200
            for path in ("/v1/models", "/metrics"):
                for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
                    r = await client.get(path, headers=headers)
                    assert r.status_code == 401, (path, headers)
                    assert r.headers["www-authenticate"] == "Bearer"
                    err = r.json()["error"]
                    assert err["code"] == "invalid_api_key"
                    assert err["type"] == "invalid_request_error"
                ok = await client.get(path, headers={"Authorization": f"Bearer {KEY}"})
                assert ok.status_code == 200

    asyncio.run(scenario())


def test_http_tls_and_mutual_tls(tls: TlsFiles):
    async def scenario() -> None:
        options = uvicorn_ssl_options(tls.server_cert, tls.server_key, tls.ca)
        http = HttpServer(_app(), "127.0.0.1", 0, options)
        port = await http.start()
        url = f"https://127.0.0.1:{port}/health"
        try:
            ctx = ssl.create_default_context(cafile=tls.ca)
            ctx.load_cert_chain(tls.client_cert, tls.client_key)
            async with httpx.AsyncClient(verify=ctx, timeout=10) as client:
                assert (await client.get(url)).text == "ok\n"
            no_cert = ssl.create_default_context(cafile=tls.ca)
            async with httpx.AsyncClient(verify=no_cert, timeout=10) as client:
                with pytest.raises(httpx.HTTPError):  # handshake refused: no client cert
                    await client.get(url)
            async with httpx.AsyncClient(timeout=10) as client:
                with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
                    await client.get(url.replace("https", "http"))
        finally:
            await http.stop()

    asyncio.run(scenario())
