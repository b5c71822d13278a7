"""The host block store over gRPC on loopback: bit-exact round trips, refusals, all or nothing."""

from __future__ import annotations

import zlib

import grpc
import pytest
import torch

from pagedserve.v1 import kv_transfer_pb2 as pb
from pagedserve.v1 import kv_transfer_pb2_grpc as pb_grpc
from pagedserve.worker.host_store import HostBlockStore, StoreError, serve_host_store
from pagedserve.worker.swap_client import HostStoreClient, SwapError


@pytest.fixture()
def served():
    server, port, store = serve_host_store(4 << 20)
    yield f"127.0.0.1:{port}", store
    server.stop(0)


def random_blocks(n: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (every byte value; NaN payloads included) of the packed shape."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = n * torch.Size(shape).numel()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(n, *shape)


@pytest.mark.parametrize(
    ("dtype", "shape", "chunk"),
    [
        (torch.float32, (2, 2, 16, 2, 16), 1 << 20),  # one chunk
        (torch.float16, (3, 2, 4, 1, 24), 700),  # a block per chunk (odd head dim)
        (torch.bfloat16, (1, 2, 1, 4, 64), 1000),  # several blocks per chunk
        (torch.float8_e4m3fn, (2, 2, 4, 1, 32), 600),  # fp8: bytes, all 256 values
        (torch.int8, (2, 2, 4, 2, 20), 500),  # int8: head_dim 16 + its 4 scale bytes
    ],
)
def test_swap_out_then_swap_in_is_bit_exact(served, dtype, shape, chunk) -> None:
    address, store = served
    n = 7
    packed = random_blocks(n, shape, dtype, seed=n)
    host_ids = [40, 3, 17, 0, 9, 11, 25]
    with HostStoreClient(address, max_chunk_bytes=chunk) as client:
        sent = client.swap_out("t1", packed, host_ids)
        assert sent == packed.numel() * packed.element_size()
        assert store.num_blocks_stored == n and store.used_bytes == sent
        back = torch.empty_like(packed)
        assert client.swap_in("t1", host_ids, back) == sent
        assert torch.equal(back.view(torch.uint8), packed.view(torch.uint8))
        # Another order, a subset: block i comes back from its own id.
        order = [4, 0, 6]
        part = torch.empty_like(packed[: len(order)])
        client.swap_in("t2", [host_ids[i] for i in order], part)
        assert torch.equal(part.view(torch.uint8), packed[order].view(torch.uint8))
        st = client.stats()
        assert (st.num_swap_outs, st.num_swap_ins) == (1, 2)
        assert (
            st.swap_out_bytes == sent
            and st.swap_in_bytes == sent + part.numel() * part.element_size()
        )
        assert client.free(host_ids) == n
        assert client.free(host_ids) == 0  # unknown ids are ignored
    assert store.num_blocks_stored == 0 and store.used_bytes == 0


def test_the_ranks_of_a_group_keep_their_own_chunks_of_a_host_block(served) -> None:
    """Two ranks swap their own heads under the same host ids: each reads back and frees
    its own chunk only; a reader of another rank or group size is refused."""
    address, store = served
    shape = (2, 2, 4, 1, 8)  # one KV head per rank
    host_ids = [5, 1, 9]
    packed = [random_blocks(3, shape, torch.float32, seed=r) for r in range(2)]
    clients = [HostStoreClient(address, rank=r, tensor_parallel_size=2) for r in range(2)]
    try:
        for r, client in enumerate(clients):
            client.swap_out(f"t-rank{r}", packed[r], host_ids)
        per_rank = packed[0].numel() * 4
        assert store.num_blocks_stored == 6 and store.used_bytes == 2 * per_rank
        for r, client in enumerate(clients):
            back = torch.empty_like(packed[r])
            assert client.swap_in("in", host_ids, back) == per_rank
            assert torch.equal(back.view(torch.uint8), packed[r].view(torch.uint8)), r
        with (
            HostStoreClient(address) as unsharded,
            pytest.raises(SwapError, match="FAILED_PRECONDITION"),
        ):
            unsharded.swap_in("in", host_ids, torch.empty_like(packed[0]))
        with (
            HostStoreClient(address, rank=2, tensor_parallel_size=4) as other,
            pytest.raises(SwapError, match="NOT_FOUND"),
        ):
            other.swap_in("in", host_ids, torch.empty_like(packed[0]))
        assert clients[1].free(host_ids) == 3
        assert store.num_blocks_stored == 3 and store.used_bytes == per_rank
        with pytest.raises(SwapError, match="NOT_FOUND"):
            clients[1].swap_in("in", host_ids, torch.empty_like(packed[1]))
        back = torch.empty_like(packed[0])
        clients[0].swap_in("in", host_ids, back)  # rank 0's chunks untouched
        assert torch.equal(back.view(torch.uint8), packed[0].view(torch.uint8))
        assert clients[0].free(host_ids) == 3
        assert store.num_blocks_stored == 0 and store.used_bytes == 0
    finally:
        for client in clients:
            client.close()
    with pytest.raises(ValueError, match="rank must be in"):
        HostStoreClient(address, rank=2, tensor_parallel_size=2)


def test_a_chunk_of_a_rank_outside_its_group_is_refused() -> None:
    with pytest.raises(StoreError, match="rank 2 of a group of 2") as err:
        HostBlockStore(1 << 20).put([_chunk(rank=2, tensor_parallel_size=2)])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_overwrite_replaces_a_block(served) -> None:
    address, store = served
    a = random_blocks(2, (1, 2, 2, 1, 8), torch.float32, 1)
    b = random_blocks(2, (1, 2, 2, 1, 8), torch.float32, 2)
    with HostStoreClient(address) as client:
        client.swap_out("a", a, [0, 1])
        client.swap_out("b", b, [1, 2])
        assert store.num_blocks_stored == 3 and store.used_bytes == 3 * a[0].numel() * 4
        out = torch.empty_like(a)
        client.swap_in("r", [0, 1], out)
        assert torch.equal(out[0], a[0]) and torch.equal(out[1], b[0])


def test_full_store_refuses_and_keeps_nothing(served) -> None:
    address, store = served  # 4 MiB
    big = torch.zeros((5, 1, 2, 16, 8, 64), dtype=torch.float32)  # 5 x 64 KiB
    with HostStoreClient(address) as client:
        client.swap_out("fits", big, [0, 1, 2, 3, 4])
        huge = torch.zeros((64, 1, 2, 16, 8, 64), dtype=torch.float32)  # 4 MiB more
        with pytest.raises(SwapError, match="RESOURCE_EXHAUSTED"):
            client.swap_out("too-big", huge, list(range(100, 164)))
        assert store.num_blocks_stored == 5
        with pytest.raises(SwapError, match="NOT_FOUND"):
            client.swap_in("missing", [7], torch.empty_like(big[:1]))


def _chunk(**kw) -> pb.KVChunk:
    data = kw.pop("data", bytes(64))
    fields = dict(
        transfer_id="x",
        host_block_ids=[1],
        layer_start=0,
        layer_end=1,
        dtype="float32",
        shape=[1, 1, 2, 1, 1, 8],
        data=data,
        checksum=zlib.crc32(data),
        num_blocks_total=1,
    )
    fields.update(kw)
    return pb.KVChunk(**fields)


@pytest.mark.parametrize(
    ("chunk", "code"),
    [
        (_chunk(checksum=123), grpc.StatusCode.DATA_LOSS),
        (_chunk(shape=[2, 1, 2, 1, 1, 8]), grpc.StatusCode.INVALID_ARGUMENT),
        (_chunk(layer_end=3), grpc.StatusCode.INVALID_ARGUMENT),
        (_chunk(data=bytes(60)), grpc.StatusCode.INVALID_ARGUMENT),
        (_chunk(host_block_ids=[]), grpc.StatusCode.INVALID_ARGUMENT),
        (_chunk(dtype=""), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_bad_chunks_are_refused_with_a_status(served, chunk, code) -> None:
    address, store = served
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.HostBlockStoreStub(ch)
        good = _chunk(host_block_ids=[5])
        with pytest.raises(grpc.RpcError) as err:
            stub.SwapOut(iter([good, chunk]), timeout=10)
        assert err.value.code() == code
    assert store.num_blocks_stored == 0  # the good chunk before it is not kept either
    if code == grpc.StatusCode.DATA_LOSS:
        assert store.num_checksum_failures == 1


def test_a_stream_broken_mid_transfer_stores_nothing(served) -> None:
    address, store = served

    def chunks():
        yield _chunk(host_block_ids=[1], num_blocks_total=2)
        raise RuntimeError("client died")

    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.HostBlockStoreStub(ch)
        with pytest.raises(grpc.RpcError):
            stub.SwapOut(chunks(), timeout=10)
    assert store.num_blocks_stored == 0 and store.used_bytes == 0


def test_a_stream_that_ends_before_its_total_stores_nothing() -> None:
    # What the server sees when gRPC ends a cancelled client stream like a complete one.
    store = HostBlockStore(1 << 20)
    with pytest.raises(StoreError) as err:
        store.put(iter([_chunk(host_block_ids=[1], num_blocks_total=2)]))
    assert err.value.code == grpc.StatusCode.ABORTED and "after 1 of 2 blocks" in str(err.value)
    assert store.num_blocks_stored == 0 and store.used_bytes == 0
    for bad in ([_chunk(num_blocks_total=0)],
                [_chunk(host_block_ids=[1], num_blocks_total=2),
                 _chunk(host_block_ids=[2], num_blocks_total=3)]):  # fmt: skip
        with pytest.raises(StoreError) as err:
            store.put(iter(bad))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert store.put(iter([_chunk(host_block_ids=[3])])) == (1, 64)
    assert store.num_blocks_stored == 1


def test_unreachable_store_raises_swap_error() -> None:
    server, port, _ = serve_host_store(1 << 20)
    server.stop(0).wait()
    with (
        HostStoreClient(f"127.0.0.1:{port}", timeout_s=5) as client,
        pytest.raises(SwapError, match="UNAVAILABLE"),
    ):
        client.swap_out("t", torch.zeros((1, 1, 2, 1, 1, 8)), [0])


def test_a_transfer_of_another_kv_dtype_is_refused() -> None:
    server, port, store = serve_host_store(1 << 20, kv_cache_dtype="float32")
    try:
        with HostStoreClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            bf16 = random_blocks(2, (1, 2, 4, 1, 8), torch.bfloat16, 3)
            with pytest.raises(SwapError, match="FAILED_PRECONDITION") as err:
                client.swap_out("mixed", bf16, [0, 1])
            assert "KV dtype 'bfloat16'" in str(err.value) and "'float32'" in str(err.value)
            assert store.num_blocks_stored == 0
            fp32 = random_blocks(2, (1, 2, 4, 1, 8), torch.float32, 3)
            assert client.swap_out("same", fp32, [0, 1]) == fp32.numel() * 4
            # Reading blocks back into a pool of another dtype is refused by the client.
            with pytest.raises(SwapError, match="does not match the request"):
                client.swap_in("back", [0, 1], torch.empty_like(bf16))
    finally:
        server.stop(0)
    assert HostBlockStore(1 << 20).kv_cache_dtype is None  # a store of its own: any dtype


def test_an_fp8_store_refuses_other_bytes_of_the_same_size() -> None:
    server, port, store = serve_host_store(1 << 20, kv_cache_dtype="float8_e4m3fn")
    try:
        with HostStoreClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            # int8-sized blocks of another dtype name, and bf16 ones, are refused.
            for dtype in (torch.bfloat16, torch.float8_e5m2):
                other = random_blocks(2, (1, 2, 4, 1, 8), dtype, 3)
                with pytest.raises(SwapError, match="FAILED_PRECONDITION"):
                    client.swap_out("other", other, [0, 1])
            assert store.num_blocks_stored == 0
            fp8 = random_blocks(2, (1, 2, 4, 1, 8), torch.float8_e4m3fn, 4)
            assert client.swap_out("fp8", fp8, [0, 1]) == fp8.numel()
            with pytest.raises(SwapError, match="does not match the request"):
                client.swap_in("back", [0, 1], torch.empty_like(fp8).view(torch.float8_e5m2))
            back = torch.empty_like(fp8)
            client.swap_in("back", [0, 1], back)
            assert torch.equal(back.view(torch.uint8), fp8.view(torch.uint8))
    finally:
        server.stop(0)


def test_an_int8_store_refuses_fp8_blocks_and_another_head_layout() -> None:
    """An int8 block carries its scales in its bytes ([..., head_dim + 4]): the store takes
    int8 blocks only, and a swap-in into a buffer without the scale bytes is refused."""
    server, port, store = serve_host_store(1 << 20, kv_cache_dtype="int8")
    try:
        with HostStoreClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            fp8 = random_blocks(2, (1, 2, 4, 1, 20), torch.float8_e4m3fn, 3)
            with pytest.raises(SwapError, match="FAILED_PRECONDITION"):
                client.swap_out("fp8", fp8, [0, 1])
            assert store.num_blocks_stored == 0
            i8 = random_blocks(2, (1, 2, 4, 1, 20), torch.int8, 4)
            assert client.swap_out("i8", i8, [0, 1]) == i8.numel()
            no_scales = torch.empty(2, 1, 2, 4, 1, 16, dtype=torch.int8)
            with pytest.raises(SwapError, match="does not match the request"):
                client.swap_in("back", [0, 1], no_scales)
            back = torch.empty_like(i8)
            client.swap_in("back", [0, 1], back)
            assert torch.equal(back, i8)
    finally:
        server.stop(0)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostBlockStore(0)


def test_serve_flags_and_host_store_command_parse() -> None:
    from pagedserve.cluster.cli import build_parser, serve_config

    parser = build_parser()
    cfg = serve_config(
        parser.parse_args(["serve", "--preemption-mode", "swap", "--swap-space", "1"])
    )
    assert (cfg.scheduler.preemption_mode, cfg.swap_space) == ("swap", 1 << 30)
    cfg = serve_config(parser.parse_args(["serve"]))
    assert (cfg.scheduler.preemption_mode, cfg.swap_space) == ("auto", 4 << 30)
    args = parser.parse_args(["host-store", "--port", "0", "--swap-space", "0.5"])
    assert (args.command, args.port, args.swap_space) == ("host-store", 0, 0.5)
    assert args.kv_cache_dtype is None
    args = parser.parse_args(["host-store", "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"
    args = parser.parse_args(["host-store", "--kv-cache-dtype", "float8_e4m3fn"])
    assert args.kv_cache_dtype == "float8_e4m3fn"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--preemption-mode", "sometimes"])
