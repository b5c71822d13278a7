"""The host block store as a process of its own: a Ray actor, or ``pagedserve host-store``.

Both serve :mod:`pagedserve.worker.host_store` (``pagedserve.v1.HostBlockStore``) on
loopback with ``swap_space`` bytes of CPU memory for swapped-out KV blocks. The launcher
starts one actor on the driver's node (the workers of that node reach it on 127.0.0.1);
the standalone command is for running and measuring a store by hand.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from pagedserve.worker.host_store import serve_host_store

GiB = 1 << 30


class HostStoreActor:
    """Ray actor class (create with ``ray.remote(num_cpus=0)``) holding one store.

    Args:
        capacity_bytes: CPU memory for KV blocks (``--swap-space``).
        host: interface to bind (loopback).
        port: TCP port; 0 picks a free one.

    Raises:
        ValueError: bad capacity. RuntimeError: the port cannot be bound.
    """

    def __init__(self, capacity_bytes: int, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server, self._port, self._store = serve_host_store(capacity_bytes, host, port)
        self._host = host

    def address(self) -> str:
        """``host:port`` of the gRPC service."""
        return f"{self._host}:{self._port}"

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


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; prints the address first.

    Raises:
        ValueError: a swap space that holds nothing. RuntimeError: the port is taken.
    """
    capacity = int(args.swap_space * GiB)
    server, port, _ = serve_host_store(capacity, args.host, args.port)
    print(f"pagedserve: host block store on {args.host}:{port}, {args.swap_space} GiB", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(1.0).wait()
    return 0
