"""The host block store as a process of its own: a Ray actor, or ``pagedserve host-store``.

Both serve :mod:`pagedserve.worker.host_store` (``pagedserve.v1.HostBlockStore``) with
``swap_space`` bytes of CPU memory for swapped-out KV blocks. The launcher starts one actor
on every node that runs workers, on 127.0.0.1 (the workers of that node reach it on
loopback) and on the node's address (workers of other nodes pull swapped groups from it
there, remote swap-ins); the standalone command is for running and measuring a
store by hand.

Who may call it (:mod:`pagedserve.cluster.auth`): with an API key, every call needs
``authorization: Bearer <key>`` (else ``UNAUTHENTICATED``); with a certificate it serves
TLS, and with a client CA it requires client certificates (mutual TLS). The store a
cluster starts (:func:`cluster_store_keys`) always needs a key: the server's ``--api-key``,
or a random one made at startup that only the cluster's workers know; when the server
serves TLS, the store does too, with a certificate made at startup for 127.0.0.1 that only
the workers trust.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from pagedserve.cluster.auth import (
    API_KEY_ENV,
    ApiKeyServerInterceptor,
    check_tls_files,
    exposure_warning,
    loopback_certificate,
    read_pem,
    ssl_server_credentials,
)
from pagedserve.cluster.config import ServerConfig
from pagedserve.worker.config import HostStoreAccess
from pagedserve.worker.host_store import HostBlockStore, serve_host_store
from pagedserve.worker.precision import KV_DTYPE_NAMES

GiB = 1 << 30
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreKeys:
    """The secrets of one host block store: what its server needs (PEM bytes; no field is
    printed).

    Attributes:
        api_key: the bearer token every call must carry; ``None``: no check.
        tls_cert: PEM certificate (chain) to serve TLS with; ``None``: plaintext.
        tls_key: PEM private key of ``tls_cert``.
        tls_client_ca: PEM CA that client certificates must chain to (mutual TLS).
    """

    api_key: str | None = field(default=None, repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    tls_client_ca: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")


def cluster_store_keys(server: ServerConfig) -> tuple[StoreKeys, HostStoreAccess]:
    """The secrets of the store a cluster starts for itself, and its workers' side of them.

    The key is the server's ``api_key`` (one key guards every surface the server opens),
    or, without one, a random token: the store never answers a caller that is not one of
    the cluster's workers. When the server serves TLS, the store serves TLS with a fresh
    self-signed certificate for 127.0.0.1 (:func:`loopback_certificate`), which the
    workers take as their only trust root. No client certificates: the workers prove
    themselves with the key.
    """
    api_key = server.api_key or secrets.token_urlsafe(32)
    cert = key = None
    if server.tls:
        cert, key = loopback_certificate()
    access = HostStoreAccess(
        api_key=api_key, tls_ca=cert, tls_server_name="localhost" if cert else None
    )
    return StoreKeys(api_key, cert, key), access


def serve_store(
    capacity_bytes: int,
    host: str,
    port: int,
    keys: StoreKeys,
    kv_cache_dtype: str | None = None,
    extra_hosts: tuple[str, ...] = (),
) -> tuple[grpc.Server, int, HostBlockStore]:
    """Start a store guarded by ``keys`` that accepts blocks of ``kv_cache_dtype`` only
    (``None``: any), on ``host`` and ``extra_hosts`` (one port; see
    :func:`pagedserve.worker.host_store.serve_host_store`).

    Raises:
        ValueError: bad capacity, or PEM data gRPC cannot use. RuntimeError: the port
            cannot be bound.
    """
    credentials = None
    if keys.tls_cert is not None and keys.tls_key is not None:
        credentials = ssl_server_credentials(keys.tls_cert, keys.tls_key, keys.tls_client_ca)
    interceptors = [ApiKeyServerInterceptor(keys.api_key)] if keys.api_key else []
    return serve_host_store(
        capacity_bytes,
        host,
        port,
        credentials=credentials,
        interceptors=interceptors,
        kv_cache_dtype=kv_cache_dtype,
        extra_hosts=extra_hosts,
    )


class HostStoreActor:
    """Ray actor class (create with ``ray.remote(num_cpus=0)``) holding one store.

    Args:
        capacity_bytes: CPU memory for KV blocks (``--swap-space``).
        host: interface to bind (loopback).
        port: TCP port; 0 picks a free one.
        keys: who may call it (:func:`cluster_store_keys`); ``None``: anyone.
        kv_cache_dtype: the workers' KV dtype name, the only one the store accepts.
        serve_node_address: also serve on this node's address (Ray's node IP, same port),
            where workers of other nodes pull swapped groups from (remote swap-ins); not
            when that address is loopback.

    Raises:
        ValueError: bad capacity. RuntimeError: the port cannot be bound.
    """

    def __init__(
        self,
        capacity_bytes: int,
        host: str = "127.0.0.1",
        port: int = 0,
        keys: StoreKeys | None = None,
        kv_cache_dtype: str | None = None,
        serve_node_address: bool = False,
    ) -> None:
        node = None
        if serve_node_address:
            import ray

            ip = ray.util.get_node_ip_address()
            node = None if ip in (host, "127.0.0.1", "localhost") else ip
        self._server, self._port, self._store = serve_store(
            capacity_bytes,
            host,
            port,
            keys or StoreKeys(),
            kv_cache_dtype,
            extra_hosts=(node,) if node else (),
        )
        self._host = host
        self._node = node

    def address(self) -> str:
        """``host:port`` of the gRPC service."""
        return f"{self._host}:{self._port}"

    def remote_address(self) -> str | None:
        """``host:port`` where workers of other nodes reach it; None: loopback only."""
        return None if self._node is None else f"{self._node}:{self._port}"

    def used_bytes(self) -> int:
        """Payload bytes held now."""
        return self._store.used_bytes

    def ping(self) -> str:
        return "pong"


def add_parser(sub: Any) -> None:
    """The ``host-store`` subcommand."""
    p = sub.add_parser("host-store", help="serve a host block store (swap space) on loopback")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061, help="0 = a free port")
    p.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU memory for KV blocks")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"bearer token every call must carry (default: ${API_KEY_ENV})",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", default=None, help="PEM CA: require client certificates (mutual TLS)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_DTYPE_NAMES,
        default=None,
        help="accept KV blocks of this dtype only (default: any)",
    )


def store_keys_from_args(args: argparse.Namespace) -> StoreKeys:
    """The :class:`StoreKeys` of ``host-store`` arguments (files read once, checked).

    Raises:
        ValueError: a half-given TLS pair, or a file that cannot be read or used.
    """
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key must be given together")
    check_tls_files(args.tls_cert, args.tls_key, args.tls_client_ca)
    if args.tls_cert is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        return StoreKeys(api_key)
    return StoreKeys(
        api_key,
        read_pem(args.tls_cert, "tls_cert"),
        read_pem(args.tls_key, "tls_key"),
        read_pem(args.tls_client_ca, "tls_client_ca") if args.tls_client_ca else None,
    )


def start(args: argparse.Namespace) -> tuple[grpc.Server, int]:
    """Start the store of ``host-store`` arguments; warns first when ``--host`` is reachable
    from other machines and no key guards it.

    Raises:
        ValueError: bad swap space or TLS files. RuntimeError: the port is taken.
    """
    keys = store_keys_from_args(args)
    warning = exposure_warning(
        args.host, keys.api_key, risk="can read, overwrite and drop swapped KV blocks"
    )
    if warning is not None:
        log.warning(warning)
    server, port, _ = serve_store(
        int(args.swap_space * GiB), args.host, args.port, keys, args.kv_cache_dtype
    )
    return server, port


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; prints the address first.

    Raises:
        ValueError: a swap space that holds nothing, bad TLS files. RuntimeError: the port
            is taken.
    """
    server, port = start(args)
    scheme = " (TLS)" if args.tls_cert else ""
    print(
        f"pagedserve: host block store on {args.host}:{port}{scheme}, {args.swap_space} GiB",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(1.0).wait()
    return 0
