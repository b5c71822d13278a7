"""The worker's client of the host block store (``pagedserve.v1.HostBlockStore``).

Swap-out streams a packed buffer (:func:`pagedserve.kernels.gather_blocks` layout,
``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``, on the CPU) as chunks of
several whole blocks, each under ``max_chunk_bytes``; swap-in receives the chunks back into
such a buffer, checking every chunk's CRC-32. Any failure (store unreachable, refused,
checksum) raises :class:`SwapError`; the caller falls back to recompute.

A client belongs to one tensor-parallel rank (``rank`` of ``tensor_parallel_size``): every
chunk it sends carries its rank, and it reads and frees that rank's chunks only (the store
keys a block by rank and host block id; the packed buffer holds the rank's KV heads).

With :class:`~pagedserve.worker.config.HostStoreAccess` set, every call carries
``authorization: Bearer <key>`` metadata and the channel is TLS (a store started with a key
refuses calls without it: ``UNAUTHENTICATED``, raised as :class:`SwapError`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import torch

from pagedserve.v1 import kv_transfer_pb2 as pb
from pagedserve.v1 import kv_transfer_pb2_grpc as pb_grpc
from pagedserve.worker.config import HostStoreAccess
from pagedserve.worker.kv_swap import SwapError

__all__ = ["DEFAULT_CHUNK_BYTES", "HostStoreClient", "SwapError"]

DEFAULT_CHUNK_BYTES = 1 << 20  # at least one block; 1 MiB measured faster than 2-8 MiB
_MAX_MESSAGE_BYTES = 64 << 20


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HostStoreClient:
    """A channel to one host block store.

    Args:
        address: ``host:port`` of the store (loopback).
        timeout_s: deadline of each call, seconds.
        max_chunk_bytes: payload bytes per chunk at most (at least one block per chunk).
        access: the API key to send and the TLS trust (and client certificate) of the
            channel; ``None``: no key, plaintext.
        rank: the tensor-parallel rank whose blocks this client moves.
        tensor_parallel_size: ranks in that rank's group (1: unsharded).

    Raises:
        ValueError: ``max_chunk_bytes`` < 1, or ``rank`` outside ``[0,
            tensor_parallel_size)``.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 60.0,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        access: HostStoreAccess | None = None,
        rank: int = 0,
        tensor_parallel_size: int = 1,
    ) -> None:
        if max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
        if not 0 <= rank < tensor_parallel_size:
            raise ValueError(f"rank must be in [0, {tensor_parallel_size}), got {rank}")
        self.rank = rank
        self.tensor_parallel_size = tensor_parallel_size
        self.address = address
        self.timeout_s = timeout_s
        self.max_chunk_bytes = max_chunk_bytes
        access = access or HostStoreAccess()
        self._metadata = (
            (("authorization", f"Bearer {access.api_key}"),) if access.api_key else None
        )
        options: list[tuple[str, int | str]] = [
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ]
        if access.tls_server_name is not None:
            options.append(("grpc.ssl_target_name_override", access.tls_server_name))
        if access.tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=access.tls_ca,
                private_key=access.tls_key,
                certificate_chain=access.tls_cert,
            )
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.HostBlockStoreStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> HostStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _chunks(
        self, transfer_id: str, packed: torch.Tensor, host_block_ids: Sequence[int]
    ) -> Iterator[pb.KVChunk]:
        n = packed.shape[0]
        raw = packed.view(torch.uint8).reshape(n, -1).numpy()  # no copy
        per_block = raw.shape[1]
        per_chunk = max(1, self.max_chunk_bytes // per_block)
        dtype = _dtype_name(packed.dtype)
        num_layers = packed.shape[1]
        for start in range(0, n, per_chunk):
            data = raw[start : start + per_chunk].tobytes()
            ids = list(host_block_ids[start : start + per_chunk])
            yield pb.KVChunk(
                transfer_id=transfer_id,
                host_block_ids=ids,
                layer_start=0,
                layer_end=num_layers,
                dtype=dtype,
                shape=[len(ids), *packed.shape[1:]],
                data=data,
                checksum=zlib.crc32(data),
                num_blocks_total=n,
                rank=self.rank,
                tensor_parallel_size=self.tensor_parallel_size,
            )

    def swap_out(
        self, transfer_id: str, packed: torch.Tensor, host_block_ids: Sequence[int]
    ) -> int:
        """Store ``packed[i]`` under ``host_block_ids[i]``.

        Args:
            transfer_id: names the transfer.
            packed: contiguous CPU tensor ``[n, num_layers, 2, block_size, num_kv_heads,
                head_dim]`` (any dtype).
            host_block_ids: ``n`` distinct host block ids.

        Returns:
            Payload bytes sent.

        Raises:
            ValueError: ``packed`` is not a contiguous 6-D CPU tensor matching the ids.
            SwapError: the store refused or could not be reached.
        """
        if packed.dim() != 6 or packed.device.type != "cpu" or not packed.is_contiguous():
            raise ValueError("packed must be a contiguous 6-D CPU tensor")
        if packed.shape[0] != len(host_block_ids) or not host_block_ids:
            raise ValueError(
                f"packed holds {packed.shape[0]} blocks for {len(host_block_ids)} host ids"
            )
        try:
            resp = self._stub.SwapOut(
                self._chunks(transfer_id, packed, host_block_ids),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise SwapError(f"swap-out {transfer_id}: {exc.code().name}: {exc.details()}") from exc
        return int(resp.num_bytes)

    def swap_in(self, transfer_id: str, host_block_ids: Sequence[int], out: torch.Tensor) -> int:
        """Read the blocks back into ``out`` (``out[i]`` = block ``host_block_ids[i]``).

        Args:
            out: contiguous CPU tensor of the packed shape for ``len(host_block_ids)``
                blocks and the cache dtype.

        Returns:
            Payload bytes received.

        Raises:
            ValueError: ``out`` is not a contiguous 6-D CPU tensor matching the ids.
            SwapError: unreachable store, unknown blocks, a dtype/shape other than ``out``'s
                (this rank's KV heads, block size, layers), another rank's or group size's
                chunk, a checksum mismatch, or missing blocks.
        """
        if out.dim() != 6 or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("out must be a contiguous 6-D CPU tensor")
        n = len(host_block_ids)
        if out.shape[0] != n or n == 0:
            raise ValueError(f"out holds {out.shape[0]} blocks for {n} host ids")
        raw = out.view(torch.uint8).reshape(n, -1).numpy()
        dtype = _dtype_name(out.dtype)
        want_ids = list(host_block_ids)
        pos = 0
        try:
            for chunk in self._stub.SwapIn(
                pb.SwapInRequest(
                    transfer_id=transfer_id,
                    host_block_ids=want_ids,
                    max_chunk_bytes=self.max_chunk_bytes,
                    rank=self.rank,
                    tensor_parallel_size=self.tensor_parallel_size,
                ),
                timeout=self.timeout_s,
                metadata=self._metadata,
            ):
                k = len(chunk.host_block_ids)
                if (
                    list(chunk.host_block_ids) != want_ids[pos : pos + k]
                    or chunk.dtype != dtype
                    or list(chunk.shape) != [k, *out.shape[1:]]
                    or len(chunk.data) != k * raw.shape[1]
                    or chunk.rank != self.rank
                    or max(1, chunk.tensor_parallel_size) != self.tensor_parallel_size
                ):
                    raise SwapError(
                        f"swap-in {transfer_id}: chunk of blocks {list(chunk.host_block_ids)} "
                        f"({chunk.dtype}, shape {list(chunk.shape)}, rank {chunk.rank} of "
                        f"{max(1, chunk.tensor_parallel_size)}) does not match the request"
                    )
                if zlib.crc32(chunk.data) != chunk.checksum:
                    raise SwapError(
                        f"swap-in {transfer_id}: checksum mismatch on blocks "
                        f"{list(chunk.host_block_ids)}"
                    )
                raw[pos : pos + k] = np.frombuffer(chunk.data, dtype=np.uint8).reshape(k, -1)
                pos += k
        except grpc.RpcError as exc:
            raise SwapError(f"swap-in {transfer_id}: {exc.code().name}: {exc.details()}") from exc
        if pos != n:
            raise SwapError(f"swap-in {transfer_id}: received {pos} of {n} blocks")
        return n * raw.shape[1]

    def free(self, host_block_ids: Sequence[int]) -> int:
        """Drop this rank's blocks from the store; returns how many held data.

        Raises:
            SwapError: the store could not be reached.
        """
        try:
            resp = self._stub.Free(
                pb.FreeRequest(host_block_ids=list(host_block_ids), rank=self.rank),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise SwapError(f"free: {exc.code().name}: {exc.details()}") from exc
        return int(resp.num_freed)

    def stats(self) -> pb.HostStoreStatsResponse:
        """The store's ``GetStats``.

        Raises:
            SwapError: the store could not be reached.
        """
        try:
            return self._stub.GetStats(
                pb.HostStoreStatsRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise SwapError(f"stats: {exc.code().name}: {exc.details()}") from exc
