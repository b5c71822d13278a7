"""A remote swap-in on the worker: a group stored in another node's host block store (a
second store process, key and TLS as a cluster's) is pulled over gRPC into this worker's
pool and freed there; a checksum mismatch, another block layout or dtype, and a dead
source store are refused, leaving the pool untouched."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.cluster.config import ServerConfig
from pagedserve.cluster.host_store import cluster_store_keys
from pagedserve.scheduler.outputs import SwapPlan, SwapTransfer
from pagedserve.v1 import kv_transfer_pb2 as pb
from pagedserve.worker.host_store import HostBlockStore, serve_host_store
from pagedserve.worker.kv_pool import KVPool
from pagedserve.worker.kv_swap import KVSwapper
from pagedserve.worker.swap_client import HostStoreClient

LAYERS, BS, HEADS, DIM = 2, 4, 2, 8


def pool(num_blocks: int = 6, block_size: int = BS, dtype=torch.float32, seed: int = 0) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, HEADS, DIM)
    keys = tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS))
    values = tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS))
    return KVPool(keys, values, block_size)


@pytest.fixture(scope="module")
def second_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    """``pagedserve host-store`` in its own process with a cluster's key and TLS
    certificate; ``(address, the workers' HostStoreAccess)``."""
    keys, access = cluster_store_keys(ServerConfig(tls_cert="x", tls_key="y"))
    tmp = tmp_path_factory.mktemp("store")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    cert.write_bytes(keys.tls_cert)
    key.write_bytes(keys.tls_key)
    cli = Path(sys.executable).with_name("pagedserve")
    proc = subprocess.Popen(
        [
            str(cli),
            "host-store",
            "--port",
            "0",
            "--swap-space",
            "0.01",
            "--api-key",
            keys.api_key,
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # "pagedserve: host block store on HOST:PORT (TLS), ..."
        address = line.split(" on ")[1].split()[0].rstrip(",")
        yield address, access
    finally:
        proc.terminate()
        proc.wait(10)


def stored_by_another_worker(address: str, access, source: KVPool, blocks, host_ids, tid):
    """What worker 0 of the other node did: swap ``blocks`` of ``source`` out to its
    store under ``host_ids``."""
    with HostStoreClient(address, access=access) as client:
        packed = KVSwapper(source, "torch").pack(blocks)
        client.swap_out(tid, packed, host_ids)
        return packed


def pull(swapper: KVSwapper, tid: str, address: str, block_ids, host_ids):
    t = SwapTransfer(tid, block_ids, host_ids, ["s0"], sorted(set(host_ids)), address)
    return swapper.run(SwapPlan(blocks_to_swap_in=[t]))[tid]


def own_store():
    server, port, store = serve_host_store(1 << 20)
    return server, f"127.0.0.1:{port}", store


def test_a_remote_pull_is_bit_exact_and_frees_the_source(second_store) -> None:
    address, access = second_store
    source = pool(seed=1)
    packed = stored_by_another_worker(address, access, source, [4, 1, 2], [7, 8, 9], "out-1")
    server, own, own_store_obj = own_store()
    try:
        dest = pool(seed=2)
        sw = KVSwapper(
            dest,
            "torch",
            HostStoreClient(own),
            connect=lambda a: HostStoreClient(a, timeout_s=10, access=access),
        )
        # a partial block two members shared comes back once per holder (8 twice)
        res = pull(sw, "in-2", address, [0, 3, 5, 2], [7, 8, 9, 8])
        assert res.ok, res.error
        assert res.num_bytes == packed.numel() * 4
        back = sw.pack([0, 3, 5, 2])
        assert torch.equal(back[:3], packed) and torch.equal(back[3], packed[1])
        with HostStoreClient(address, access=access) as c:
            st = c.stats()
        assert (st.used_bytes, st.num_blocks_stored) == (0, 0)  # freed on the source
        assert own_store_obj.num_swap_ins == 0 and own_store_obj.num_swap_outs == 0
        sw.close()
    finally:
        server.stop(0)


def test_a_remote_pull_without_the_key_is_refused(second_store) -> None:
    address, _ = second_store
    dest = pool(seed=2)
    before = dest.key_caches[0].clone()
    _, access = cluster_store_keys(ServerConfig(tls_cert="x", tls_key="y"))  # another cluster
    sw = KVSwapper(dest, "torch", connect=lambda a: HostStoreClient(a, timeout_s=5, access=access))
    res = pull(sw, "in-3", address, [0], [7])
    assert not res.ok
    assert torch.equal(dest.key_caches[0], before)


class CorruptingStore(HostBlockStore):
    """Serves chunks whose payload no longer matches their checksum."""

    def get(self, transfer_id, block_ids, max_chunk_bytes, *rank_and_size):
        for chunk in super().get(transfer_id, block_ids, max_chunk_bytes, *rank_and_size):
            data = bytearray(chunk.data)
            data[0] ^= 0xFF
            yield pb.KVChunk(
                transfer_id=chunk.transfer_id,
                host_block_ids=chunk.host_block_ids,
                layer_start=chunk.layer_start,
                layer_end=chunk.layer_end,
                dtype=chunk.dtype,
                shape=chunk.shape,
                data=bytes(data),
                checksum=chunk.checksum,
            )


@pytest.mark.parametrize(
    ("store_cls", "source", "match"),
    [
        (CorruptingStore, pool(), "checksum mismatch"),
        (HostBlockStore, pool(block_size=8), "does not match the request"),
        (HostBlockStore, pool(dtype=torch.float16), "does not match the request"),
    ],
    ids=["checksum", "block-size", "dtype"],
)
def test_a_bad_remote_pull_is_refused_and_leaves_the_pool(store_cls, source, match) -> None:
    server, port, _ = serve_host_store(1 << 20, store=store_cls(1 << 20))
    address = f"127.0.0.1:{port}"
    try:
        stored_by_another_worker(address, None, source, [0, 1], [3, 4], "out-5")
        dest = pool(seed=2)
        before = [k.clone() for k in dest.key_caches]
        sw = KVSwapper(dest, "torch", connect=lambda a: HostStoreClient(a, timeout_s=5))
        res = pull(sw, "in-6", address, [2, 3], [3, 4])
        assert not res.ok and match in res.error
        assert all(torch.equal(a, b) for a, b in zip(dest.key_caches, before))
        with HostStoreClient(address) as c:
            assert c.stats().num_blocks_stored == 0  # freed on the source all the same
    finally:
        server.stop(0)


def test_a_pull_from_a_dead_store_fails_fast() -> None:
    server, port, _ = serve_host_store(1 << 20)
    server.stop(0).wait()
    sw = KVSwapper(pool(), "torch", connect=lambda a: HostStoreClient(a, timeout_s=5))
    res = pull(sw, "in-7", f"127.0.0.1:{port}", [0], [1])
    assert not res.ok and res.seconds < 5
    no_access = KVSwapper(pool(), "torch")
    res = pull(no_access, "in-8", f"127.0.0.1:{port}", [0], [1])
    assert not res.ok and "no access" in res.error
