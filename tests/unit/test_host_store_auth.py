"""Who may call the host block store: the API key, TLS and mutual TLS on the real gRPC
server (loopback), the cluster's own store keys, and the ``host-store`` command's flags."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
import torch
from test_host_store import random_blocks
from tls_certs import TlsFiles, make_tls_files

from pagedserve.cluster.auth import API_KEY_ENV
from pagedserve.cluster.cli import build_parser, main
from pagedserve.cluster.config import ServerConfig
from pagedserve.cluster.host_store import (
    StoreKeys,
    cluster_store_keys,
    serve_store,
    start,
    store_keys_from_args,
)
from pagedserve.v1 import kv_transfer_pb2 as pb
from pagedserve.v1 import kv_transfer_pb2_grpc as pb_grpc
from pagedserve.worker.config import HostStoreAccess
from pagedserve.worker.swap_client import HostStoreClient, SwapError

KEY = "store-key-42"
SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, kv heads, head dim


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def pem(path: str) -> bytes:
    return Path(path).read_bytes()


def round_trip(address: str, access: HostStoreAccess | None) -> None:
    """Swap 5 blocks out and back in through ``address``: bit-exact, then freed."""
    packed = random_blocks(5, SHAPE, torch.float32, seed=3)
    ids = [7, 0, 3, 12, 5]
    with HostStoreClient(address, timeout_s=10, access=access) as client:
        assert client.swap_out("t", packed, ids) == packed.numel() * 4
        back = torch.empty_like(packed)
        client.swap_in("t", ids, back)
        assert torch.equal(back.view(torch.uint8), packed.view(torch.uint8))
        assert client.stats().num_blocks_stored == 5
        assert client.free(ids) == 5


def refused(address: str, access: HostStoreAccess | None) -> str:
    """The error of every call through a client with ``access``; all must fail alike."""
    messages = []
    with HostStoreClient(address, timeout_s=10, access=access) as client:
        calls = [
            lambda: client.swap_out("t", random_blocks(1, SHAPE, torch.float32, 1), [0]),
            lambda: client.swap_in("t", [0], torch.empty((1, *SHAPE))),
            lambda: client.free([0]),
            client.stats,
        ]
        for call in calls:
            with pytest.raises(SwapError) as ei:
                call()
            messages.append(str(ei.value))
    codes = {m.split(": ")[1] for m in messages}
    assert len(codes) == 1, messages
    return codes.pop()


def test_a_keyed_store_refuses_calls_without_the_key():
    server, port, store = serve_store(1 << 20, "127.0.0.1", 0, StoreKeys(KEY))
    address = f"127.0.0.1:{port}"
    try:
        assert refused(address, None) == "UNAUTHENTICATED"
        assert refused(address, HostStoreAccess(api_key="wrong")) == "UNAUTHENTICATED"
        assert store.num_swap_outs == 0 and store.used_bytes == 0  # nothing reached it
        # The raw stub says what the client sees, with the message of the other surfaces.
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as ei:
            pb_grpc.HostBlockStoreStub(ch).GetStats(pb.HostStoreStatsRequest(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in (ei.value.details() or "")
        round_trip(address, HostStoreAccess(api_key=KEY))
        assert store.num_swap_outs == 1 and store.used_bytes == 0
    finally:
        server.stop(0)


def test_tls_store_with_the_key(tls):
    keys = StoreKeys(KEY, pem(tls.server_cert), pem(tls.server_key))
    server, port, _ = serve_store(1 << 20, "127.0.0.1", 0, keys)
    address = f"127.0.0.1:{port}"
    try:
        round_trip(address, HostStoreAccess(api_key=KEY, tls_ca=pem(tls.ca)))
        assert refused(address, HostStoreAccess(tls_ca=pem(tls.ca))) == "UNAUTHENTICATED"
        # Plaintext to a TLS port, and a certificate signed by a CA the client does not
        # trust: no connection.
        assert refused(address, HostStoreAccess(api_key=KEY)) == "UNAVAILABLE"
        wrong_ca = HostStoreAccess(api_key=KEY, tls_ca=pem(tls.other_ca))
        assert refused(address, wrong_ca) == "UNAVAILABLE"
    finally:
        server.stop(0)


def test_mutual_tls_store_needs_a_client_certificate(tls):
    keys = StoreKeys(None, pem(tls.server_cert), pem(tls.server_key), pem(tls.ca))
    server, port, _ = serve_store(1 << 20, "127.0.0.1", 0, keys)
    address = f"127.0.0.1:{port}"
    try:
        with_cert = HostStoreAccess(
            tls_ca=pem(tls.ca), tls_cert=pem(tls.client_cert), tls_key=pem(tls.client_key)
        )
        round_trip(address, with_cert)
        assert refused(address, HostStoreAccess(tls_ca=pem(tls.ca))) == "UNAVAILABLE"
    finally:
        server.stop(0)


def test_the_cluster_store_always_needs_a_key_and_follows_the_server_tls(tls):
    # No server key: a random one, the same on both sides, new per cluster.
    keys, access = cluster_store_keys(ServerConfig())
    assert keys.api_key and access.api_key == keys.api_key and len(keys.api_key) >= 32
    assert cluster_store_keys(ServerConfig())[0].api_key != keys.api_key
    assert keys.tls_cert is None and not access.tls
    assert KEY not in repr(StoreKeys(KEY)) and KEY not in repr(HostStoreAccess(api_key=KEY))
    # The server's key, and TLS with a certificate made for 127.0.0.1 that the workers trust.
    server_cfg = ServerConfig(api_key=KEY, tls_cert=tls.server_cert, tls_key=tls.server_key)
    keys, access = cluster_store_keys(server_cfg)
    assert keys.api_key == access.api_key == KEY
    assert keys.tls_cert is not None and access.tls_ca == keys.tls_cert
    assert b"PRIVATE KEY" in (keys.tls_key or b"") and keys.tls_client_ca is None
    server, port, _ = serve_store(1 << 20, "127.0.0.1", 0, keys)
    address = f"127.0.0.1:{port}"
    try:
        round_trip(address, access)
        # The test CA's clients do not trust the store's own certificate.
        assert refused(address, HostStoreAccess(api_key=KEY, tls_ca=pem(tls.ca))) == "UNAVAILABLE"
    finally:
        server.stop(0)


def test_host_store_command_flags(tls, monkeypatch, caplog):
    parser = build_parser()
    argv = ["host-store", "--port", "0", "--swap-space", "0.001"]
    args = parser.parse_args(
        [*argv, "--api-key", KEY, "--tls-cert", tls.server_cert, "--tls-key", tls.server_key]
    )
    keys = store_keys_from_args(args)
    assert keys.api_key == KEY and keys.tls_cert == pem(tls.server_cert)
    assert keys.tls_client_ca is None
    args = parser.parse_args([*argv, "--tls-cert", tls.server_cert, "--tls-key", tls.server_key])
    args.tls_client_ca = tls.ca
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    keys = store_keys_from_args(args)
    assert keys.api_key == "from-env" and keys.tls_client_ca == pem(tls.ca)
    monkeypatch.delenv(API_KEY_ENV)
    # Bad TLS flags are one clear error (exit status 2), before anything binds.
    assert main([*argv, "--tls-cert", tls.server_cert]) == 2
    assert main([*argv, "--tls-client-ca", tls.ca]) == 2
    assert main([*argv, "--tls-cert", tls.client_cert, "--tls-key", tls.server_key]) == 2
    # A non-loopback host without a key: the exposure warning, then the bind (192.0.2.1 is
    # a documentation address no machine holds, so it fails here).
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="cannot bind"):
        start(parser.parse_args(["host-store", "--host", "192.0.2.1", "--swap-space", "0.001"]))
    assert "192.0.2.1" in caplog.text and "swapped KV blocks" in caplog.text
    caplog.clear()
    server, port = start(parser.parse_args([*argv, "--api-key", KEY]))
    try:
        assert "without an API key" not in caplog.text
        round_trip(f"127.0.0.1:{port}", HostStoreAccess(api_key=KEY))
    finally:
        server.stop(0)
