"""Startup failures are clean: a taken port, a second server on the same port, a bad model."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from pathlib import Path

import pytest

from pagedserve.cluster.cli import main
from pagedserve.cluster.config import ServerConfig
from pagedserve.cluster.frontend import (
    GenerationServicer,
    PortUnavailable,
    check_port_free,
    start_server,
)
from pagedserve.cluster.pipeline import RequestPipeline
from pagedserve.cluster.request_prep import ModelInfo


class _Tok:
    def get_vocab(self):
        return {"a": 0, "bb": 1}


def _servicer() -> GenerationServicer:
    info = ModelInfo("m", 16, 2, (1,), 64)
    return GenerationServicer(RequestPipeline(scheduler=None, tokenizer=_Tok(), info=info))


def test_check_port_free_detects_a_taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortUnavailable, match=str(port)):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", 0)


def test_second_server_on_the_same_port_fails_instead_of_sharing():
    async def scenario():
        server, port = await start_server(ServerConfig(port=0), _servicer())
        try:
            with pytest.raises(PortUnavailable):
                await start_server(ServerConfig(port=port), _servicer())
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_text_size_bound_uses_the_longest_token():
    svc = _servicer()  # longest token 2 bytes, max_model_len 16 -> 32 bytes
    svc.pipeline.preparer._check_text_size("x" * 32)
    with pytest.raises(ValueError, match="cannot fit"):
        svc.pipeline.preparer._check_text_size("x" * 33)


def test_serve_refuses_unsupported_architecture_before_starting_ray(
    tiny_llama_dir: Path, tmp_path: Path, capsys, monkeypatch
):
    import pagedserve.cluster.launcher as launcher

    def no_ray(config):
        raise AssertionError("Ray must not start for an unsupported model")

    monkeypatch.setattr(launcher, "init_ray", no_ray)
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    rc = main(["serve", "--model", str(bad), "--port", "0"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err


def test_serve_on_a_taken_port_exits_cleanly(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        rc = main(["serve", "--port", str(port)])
    assert rc == 1
    assert "cannot bind" in capsys.readouterr().err


def test_port_check_refuses_a_listener_but_not_time_wait_leftovers():
    """A server that stopped with a client connected leaves its side in TIME-WAIT for a
    minute; starting again on that port must work (only a listener refuses it)."""
    import psutil

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with pytest.raises(PortUnavailable, match=f"127.0.0.1:{port}"):
        check_port_free("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server closes first: its end goes to TIME-WAIT
    listener.close()
    client.recv(1)
    client.close()
    waits = [
        c
        for c in psutil.net_connections(kind="tcp4")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_TIME_WAIT
    ]
    assert waits, "the test did not leave a TIME-WAIT socket"
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what the old check did: refused
    check_port_free("127.0.0.1", port)  # what serve does now: accepted
