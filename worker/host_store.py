"""The host block store: swapped-out KV blocks in CPU memory, served over gRPC.

One store per node (``pagedserve host-store``, or the Ray actor the launcher starts) serves
``pagedserve.v1.HostBlockStore`` on loopback (``protos/pagedserve/v1/kv_transfer.proto``).
The workers of the node stream packed blocks to it on a swap-out and read them back on a
swap-in (:mod:`pagedserve.worker.swap_client`). The scheduler owns the host block ids; the
store keeps the bytes under them, up to ``capacity_bytes``.

Under tensor parallelism each rank of a logical worker streams its own KV heads under the
same host block ids: a block is keyed by ``(rank, host block id)`` and remembers the
writer's group size, so one host block of a group of T holds T chunks, each read back (and
freed) by its own rank only.

No torch here: a block is opaque bytes with its dtype name and shape. SwapOut is all or
nothing (staged per call, committed when the client's stream ends cleanly), so a transfer
broken mid-way leaves nothing behind.

Who may call it is decided by whoever starts it (:mod:`pagedserve.cluster.host_store`):
:func:`serve_host_store` takes server credentials (TLS) and interceptors (the API key) as
plain gRPC objects.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from pagedserve.v1 import kv_transfer_pb2 as pb
from pagedserve.v1 import kv_transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20  # at least one block; 1 MiB measured faster than 2-8 MiB
MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredBlock:
    """One host block: all layers of one KV block, as raw bytes.

    Attributes:
        data: ``prod(shape) * itemsize`` bytes (a view into the chunk it arrived in).
        dtype: the cache dtype name, e.g. ``"float32"``.
        shape: the block's payload shape, ``[num_layers, 2, block_size, num_kv_heads,
            head_dim]``.
        layer_start, layer_end: the layer range it holds.
        tensor_parallel_size: ranks in the group of the rank that wrote it (1: unsharded).
    """

    data: memoryview
    dtype: str
    shape: tuple[int, ...]
    layer_start: int
    layer_end: int
    tensor_parallel_size: int = 1


class StoreError(Exception):
    """A refused request; ``code`` is the gRPC status the servicer answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _check_chunk(chunk: Any) -> list[memoryview]:
    """Validate one KVChunk and split its payload per block.

    Raises:
        StoreError: INVALID_ARGUMENT (shape, ids, sizes, layer range), DATA_LOSS (checksum).
    """
    ids = list(chunk.host_block_ids)
    shape = tuple(int(s) for s in chunk.shape)
    if not ids:
        raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, "chunk has no host_block_ids")
    if len(shape) != 6 or shape[0] != len(ids) or min(shape) < 1:
        raise StoreError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"chunk shape {list(shape)} must be [num_blocks={len(ids)}, layers, 2, "
            "block_size, kv_heads, head_dim] with positive sizes",
        )
    if shape[2] != 2 or chunk.layer_end - chunk.layer_start != shape[1]:
        raise StoreError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"chunk shape {list(shape)} does not match layers "
            f"[{chunk.layer_start}, {chunk.layer_end}) x (K, V)",
        )
    if len(set(ids)) != len(ids):
        raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, f"repeated host_block_ids {ids}")
    data = chunk.data
    if not chunk.dtype:
        raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, "chunk has no dtype")
    if len(data) % len(ids) != 0 or not data:
        raise StoreError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"payload of {len(data)} bytes does not split into {len(ids)} blocks",
        )
    elems = 1
    for s in shape[1:]:
        elems *= s
    per_block = len(data) // len(ids)
    if per_block % elems != 0:
        raise StoreError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"block payload of {per_block} bytes is not a whole number of {elems} elements",
        )
    if zlib.crc32(data) != chunk.checksum:
        raise StoreError(
            grpc.StatusCode.DATA_LOSS,
            f"transfer {chunk.transfer_id!r}: checksum mismatch on blocks {ids}",
        )
    view = memoryview(data)
    return [view[i * per_block : (i + 1) * per_block] for i in range(len(ids))]


class HostBlockStore:
    """The store's memory and counters (thread-safe; the gRPC servicer wraps it).

    Args:
        capacity_bytes: most payload bytes held at once (``--swap-space``).
        kv_cache_dtype: the dtype name of the cluster's KV pools (e.g. ``"bfloat16"``);
            a SwapOut chunk of another dtype is refused (FAILED_PRECONDITION), so bytes
            written as one dtype are never read back as another. ``None``: any dtype.

    Raises:
        ValueError: ``capacity_bytes`` < 1.
    """

    def __init__(self, capacity_bytes: int, kv_cache_dtype: str | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.kv_cache_dtype = kv_cache_dtype
        self._blocks: dict[tuple[int, int], StoredBlock] = {}  # key: (rank, host block id)
        self._used = 0
        self._lock = threading.Lock()
        self.swap_out_bytes = 0
        self.swap_in_bytes = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_checksum_failures = 0

    @property
    def used_bytes(self) -> int:
        """Payload bytes held now."""
        return self._used

    @property
    def num_blocks_stored(self) -> int:
        """Host block chunks holding data now (one per rank and host block)."""
        return len(self._blocks)

    def put(self, chunks: Iterable[Any]) -> tuple[int, int]:
        """Store every block of a SwapOut stream, all or nothing.

        Returns:
            ``(num_blocks, num_bytes)`` written.

        Raises:
            StoreError: a bad chunk (INVALID_ARGUMENT / DATA_LOSS), a chunk whose dtype
                is not the store's ``kv_cache_dtype`` (FAILED_PRECONDITION), not enough
                room (RESOURCE_EXHAUSTED), or a stream that ended before
                ``num_blocks_total`` blocks (ABORTED); nothing is stored then.
        """
        staged: dict[tuple[int, int], StoredBlock] = {}
        total = 0
        for chunk in chunks:
            size = max(1, chunk.tensor_parallel_size)
            if chunk.rank >= size:
                raise StoreError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"transfer {chunk.transfer_id!r}: rank {chunk.rank} of a group of {size}",
                )
            if chunk.num_blocks_total < 1 or (total and chunk.num_blocks_total != total):
                raise StoreError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"transfer {chunk.transfer_id!r}: num_blocks_total must be >= 1 and the "
                    f"same in every chunk, got {chunk.num_blocks_total} (before: {total})",
                )
            total = chunk.num_blocks_total
            if self.kv_cache_dtype is not None and chunk.dtype != self.kv_cache_dtype:
                raise StoreError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"transfer {chunk.transfer_id!r} carries KV dtype {chunk.dtype!r}; this "
                    f"store holds {self.kv_cache_dtype!r} blocks (--kv-cache-dtype differs "
                    "between the worker and the store)",
                )
            try:
                views = _check_chunk(chunk)
            except StoreError as exc:
                if exc.code == grpc.StatusCode.DATA_LOSS:
                    with self._lock:
                        self.num_checksum_failures += 1
                raise
            shape = tuple(int(s) for s in chunk.shape[1:])
            for block_id, view in zip(chunk.host_block_ids, views):
                key = (chunk.rank, block_id)
                if key in staged:
                    raise StoreError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"host block {block_id} appears twice in transfer {chunk.transfer_id!r}",
                    )
                staged[key] = StoredBlock(
                    view, chunk.dtype, shape, chunk.layer_start, chunk.layer_end, size
                )
        if not staged:
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, "SwapOut stream had no chunks")
        if len(staged) != total:
            # NOTE: gRPC may end a cancelled client stream like a complete one on the server
            # (the read returns no message before the cancellation is seen): the count, not
            # the end of the stream, says the transfer is whole.
            raise StoreError(
                grpc.StatusCode.ABORTED,
                f"transfer stream ended after {len(staged)} of {total} blocks; nothing stored",
            )
        nbytes = sum(len(b.data) for b in staged.values())
        with self._lock:
            replaced = sum(len(self._blocks[i].data) for i in staged if i in self._blocks)
            if self._used - replaced + nbytes > self.capacity_bytes:
                raise StoreError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{nbytes} bytes do not fit: {self._used} of {self.capacity_bytes} "
                    "bytes are held",
                )
            self._used += nbytes - replaced
            self._blocks.update(staged)
            self.swap_out_bytes += nbytes
            self.num_swap_outs += 1
        return len(staged), nbytes

    def get(
        self,
        transfer_id: str,
        block_ids: list[int],
        max_chunk_bytes: int,
        rank: int = 0,
        tensor_parallel_size: int = 1,
    ) -> Iterator[Any]:
        """Yield KVChunks holding rank ``rank``'s chunks of ``block_ids`` in order, each at
        most ``max_chunk_bytes`` of payload (at least one block).

        Raises:
            StoreError: INVALID_ARGUMENT (no ids, repeated ids, mixed dtypes or shapes),
                NOT_FOUND (an id holding nothing for ``rank``), FAILED_PRECONDITION (a block
                written by a group of another ``tensor_parallel_size``: its heads are split
                otherwise). Raised before the first chunk.
        """
        if not block_ids:
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, "no host_block_ids to read")
        if len(set(block_ids)) != len(block_ids):
            raise StoreError(grpc.StatusCode.INVALID_ARGUMENT, f"repeated ids {block_ids}")
        with self._lock:
            missing = [i for i in block_ids if (rank, i) not in self._blocks]
            if missing:
                raise StoreError(
                    grpc.StatusCode.NOT_FOUND, f"host blocks {missing} hold nothing for rank {rank}"
                )
            blocks = [self._blocks[(rank, i)] for i in block_ids]
        sizes = {b.tensor_parallel_size for b in blocks}
        if sizes != {tensor_parallel_size}:
            raise StoreError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"host blocks {block_ids} were written by a group of tensor_parallel_size "
                f"{sorted(sizes)}, read by one of {tensor_parallel_size}",
            )
        first = blocks[0]
        key = (first.dtype, first.shape, first.layer_start, first.layer_end)
        if any((b.dtype, b.shape, b.layer_start, b.layer_end) != key for b in blocks):
            raise StoreError(
                grpc.StatusCode.INVALID_ARGUMENT, "blocks of one SwapIn differ in dtype or shape"
            )
        per_chunk = max(1, max_chunk_bytes // max(1, len(first.data)))
        sent = 0
        for start in range(0, len(blocks), per_chunk):
            part = blocks[start : start + per_chunk]
            data = b"".join(b.data for b in part)
            sent += len(data)
            yield pb.KVChunk(
                transfer_id=transfer_id,
                host_block_ids=block_ids[start : start + per_chunk],
                layer_start=first.layer_start,
                layer_end=first.layer_end,
                dtype=first.dtype,
                shape=[len(part), *first.shape],
                data=data,
                checksum=zlib.crc32(data),
                rank=rank,
                tensor_parallel_size=tensor_parallel_size,
            )
        with self._lock:
            self.swap_in_bytes += sent
            self.num_swap_ins += 1

    def free(self, block_ids: Iterable[int], rank: int = 0) -> int:
        """Drop rank ``rank``'s chunks of the blocks; returns how many held data (unknown
        ids are ignored)."""
        n = 0
        with self._lock:
            for i in block_ids:
                block = self._blocks.pop((rank, i), None)
                if block is not None:
                    self._used -= len(block.data)
                    n += 1
        return n

    def stats(self) -> Any:
        """The ``HostStoreStatsResponse`` of now."""
        with self._lock:
            return pb.HostStoreStatsResponse(
                capacity_bytes=self.capacity_bytes,
                used_bytes=self._used,
                num_blocks_stored=len(self._blocks),
                swap_out_bytes=self.swap_out_bytes,
                swap_in_bytes=self.swap_in_bytes,
                num_swap_outs=self.num_swap_outs,
                num_swap_ins=self.num_swap_ins,
                num_checksum_failures=self.num_checksum_failures,
            )


class HostBlockStoreServicer(pb_grpc.HostBlockStoreServicer):
    """gRPC face of a :class:`HostBlockStore` (refusals become status codes)."""

    def __init__(self, store: HostBlockStore) -> None:
        self.store = store

    def SwapOut(self, request_iterator: Any, context: Any) -> Any:
        tid = ""

        def chunks() -> Iterator[Any]:
            nonlocal tid
            for chunk in request_iterator:
                tid = chunk.transfer_id
                yield chunk

        try:
            n, nbytes = self.store.put(chunks())
        except StoreError as exc:
            context.abort(exc.code, str(exc))
        return pb.SwapOutResponse(transfer_id=tid, num_blocks=n, num_bytes=nbytes)

    def SwapIn(self, request: Any, context: Any) -> Iterator[Any]:
        limit = request.max_chunk_bytes or DEFAULT_CHUNK_BYTES
        stream = self.store.get(
            request.transfer_id,
            list(request.host_block_ids),
            limit,
            request.rank,
            max(1, request.tensor_parallel_size),
        )
        try:
            first = next(stream, None)
        except StoreError as exc:
            context.abort(exc.code, str(exc))
        if first is not None:
            yield first
            yield from stream

    def Free(self, request: Any, context: Any) -> Any:
        return pb.FreeResponse(num_freed=self.store.free(request.host_block_ids, request.rank))

    def GetStats(self, request: Any, context: Any) -> Any:
        return self.store.stats()


def serve_host_store(
    capacity_bytes: int,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 8,
    store: HostBlockStore | None = None,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    kv_cache_dtype: str | None = None,
    extra_hosts: Sequence[str] = (),
) -> tuple[grpc.Server, int, HostBlockStore]:
    """Start a store's gRPC server (threads) on ``host:port``; 0 picks a free port.
    ``extra_hosts`` are more interfaces served on the same port (a node's address, for
    the workers of other nodes).

    ``store`` serves an existing store object instead of a new one of ``capacity_bytes``;
    ``credentials`` serve TLS (plaintext without); ``interceptors`` see every call first
    (the API key check of :mod:`pagedserve.cluster.auth`); ``kv_cache_dtype`` is the one
    dtype a new store accepts (:class:`HostBlockStore`).

    Returns:
        ``(server, port, store)``; stop with ``server.stop(grace)``.

    Raises:
        ValueError: bad capacity.
        RuntimeError: the port cannot be bound.
    """
    if store is None:
        store = HostBlockStore(capacity_bytes, kv_cache_dtype)
    opts = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=opts,
        interceptors=list(interceptors),
    )
    pb_grpc.add_HostBlockStoreServicer_to_server(HostBlockStoreServicer(store), server)
    bound = port
    for i, interface in enumerate([host, *extra_hosts]):
        address = f"{interface}:{bound}"
        try:
            if credentials is None:
                got = server.add_insecure_port(address)
            else:
                got = server.add_secure_port(address, credentials)
        except RuntimeError:  # grpcio raises where older versions returned 0
            got = 0
        if got == 0:
            raise RuntimeError(f"cannot bind the host block store to {address}")
        if i == 0:
            bound = got
    server.start()
    log.info(
        "host block store on %s:%d%s, %d bytes",
        ",".join([host, *extra_hosts]),
        bound,
        " (TLS)" if credentials is not None else "",
        store.capacity_bytes,
    )
    return server, bound, store
