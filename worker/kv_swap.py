"""The worker's half of swap preemption: pack blocks and stream them to the host store, and
receive them back into freshly allocated blocks.

A swap-out packs the transfer's blocks of every layer into one contiguous buffer
(:func:`pagedserve.kernels.gather_blocks`; on a GPU into a pinned host buffer, so the copy
is one DMA) and streams it to the store (:class:`~pagedserve.worker.swap_client.HostStoreClient`);
a swap-in receives into such a buffer and scatters it (:func:`pagedserve.kernels.scatter_blocks`).
A remote swap-in (``SwapTransfer.source_address`` set: a group stored by a worker of
another node) pulls from that node's store over gRPC (the same checked protobuf chunks;
a chunk of another dtype or block layout is refused) and frees the blocks there.
Failures never raise: each transfer gets a :class:`SwapResult` and the scheduler recomputes
what did not move.

Under tensor parallelism every rank runs the same plan on its own pool (its KV heads, the
same block ids) through its own client, under the same host block ids (the store keys a
chunk by rank). The ranks then agree on every transfer (one all-reduce): a transfer moved
only where it moved on every rank, its bytes are the group's, and a swap-out that failed on
another rank is freed here too; so every rank drops the same failed swap-ins and the
scheduler sees one result per transfer for the logical worker.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pagedserve import kernels
from pagedserve.scheduler.outputs import SwapPlan, SwapResult, SwapTransfer
from pagedserve.worker.kv_pool import KVPool
from pagedserve.worker.parallel import TensorParallelGroup

if TYPE_CHECKING:  # grpc only where a store is connected: the model path runs without it
    from pagedserve.worker.swap_client import HostStoreClient

log = logging.getLogger(__name__)


class SwapError(Exception):
    """A swap transfer failed (store unreachable or full, bad data); nothing to resume."""


class KVSwapper:
    """Runs the swap transfers of a step on one worker's KV pool.

    Args:
        kv_pool: the worker's caches.
        backend: the kernels backend name.
        client: the host store's client; None until connected (every transfer then fails).
        connect: makes the client of another node's store from its ``host:port`` (for
            remote swap-ins; each address connected once); None: remote swap-ins fail.
        group: the worker's tensor-parallel group, whose ranks agree on every result;
            None: a group of one.
    """

    def __init__(
        self,
        kv_pool: KVPool,
        backend: str,
        client: HostStoreClient | None = None,
        connect: Callable[[str], HostStoreClient] | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        self.kv_pool = kv_pool
        self.group = group
        self.backend = backend
        self.client = client
        self.connect = connect
        self._remotes: dict[str, HostStoreClient] = {}  # address -> client

    def host_buffer(self, n: int) -> torch.Tensor:
        """An uninitialised host buffer for ``n`` packed blocks (pinned on a GPU worker)."""
        k = self.kv_pool.key_caches[0]
        _, bs, heads, dim = k.shape
        shape = (n, self.kv_pool.num_layers, 2, bs, heads, dim)
        return torch.empty(shape, dtype=k.dtype, pin_memory=k.is_cuda)

    def pack(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks of every layer in one host buffer ``[n, L, 2, bs, Hkv, D]``."""
        pool = self.kv_pool
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=pool.key_caches[0].device)
        out = self.host_buffer(len(block_ids))
        kernels.gather_blocks(
            pool.key_caches, pool.value_caches, ids, out=out, backend=self.backend
        )
        return out

    def unpack(self, block_ids: Sequence[int], packed: torch.Tensor) -> None:
        """Write ``packed[i]`` into block ``block_ids[i]`` of every layer."""
        pool = self.kv_pool
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=pool.key_caches[0].device)
        kernels.scatter_blocks(pool.key_caches, pool.value_caches, ids, packed, self.backend)

    def run(self, plan: SwapPlan) -> dict[str, SwapResult]:
        """Swap-outs, then swap-ins, then the free of ``host_blocks_to_free``; under tensor
        parallelism, the results agreed by every rank (:meth:`agree`).

        Raises:
            GroupBroken: the ranks' agreement failed (a rank is gone).
        """
        results: dict[str, SwapResult] = {}
        for t in plan.blocks_to_swap_out:
            results[t.transfer_id] = self._timed(self._swap_out, t)
        for t in plan.blocks_to_swap_in:
            results[t.transfer_id] = self._timed(self._swap_in, t)
        if plan.host_blocks_to_free:
            start = time.perf_counter()
            try:
                self._client().free(plan.host_blocks_to_free)
                res = SwapResult(True, 0, time.perf_counter() - start)
            except SwapError as exc:
                res = SwapResult(False, 0, time.perf_counter() - start, str(exc))
            results[plan.free_transfer_id] = res
        return self.agree(plan, results)

    def agree(self, plan: SwapPlan, results: dict[str, SwapResult]) -> dict[str, SwapResult]:
        """Every rank's view of ``results`` (this rank's, in the plan's order on every
        rank): ok where every rank's transfer was, with the bytes summed over the ranks.
        A swap-out this rank stored but another failed is freed here (the scheduler
        recomputes its sequences; nothing may stay behind under its host ids).

        Raises:
            GroupBroken: the all-reduce failed.
        """
        group = self.group
        if group is None or group.size == 1 or not results:
            return results
        ids = list(results)
        flags = torch.tensor(
            [[int(results[i].ok), results[i].num_bytes] for i in ids],
            dtype=torch.int64,
            device=group.device,
        )
        summed = group.all_reduce(flags).tolist()
        agreed: dict[str, SwapResult] = {}
        for tid, (ok_ranks, nbytes) in zip(ids, summed):
            mine = results[tid]
            ok = ok_ranks == group.size
            error = mine.error if not mine.ok else "" if ok else "failed on another rank"
            agreed[tid] = SwapResult(ok, int(nbytes) if ok else 0, mine.seconds, error)
        for t in plan.blocks_to_swap_out:
            if results[t.transfer_id].ok and not agreed[t.transfer_id].ok and self.client:
                with contextlib.suppress(SwapError):
                    self.client.free(t.host_block_ids)
        return agreed

    def _client(self) -> HostStoreClient:
        if self.client is None:
            raise SwapError("no host block store is connected")
        return self.client

    def remote_client(self, address: str) -> HostStoreClient:
        """The client of the store at ``address`` (another node's), connected once.

        Raises:
            SwapError: this worker cannot connect to other stores.
        """
        client = self._remotes.get(address)
        if client is None:
            if self.connect is None:
                raise SwapError(f"no access to the host block store at {address}")
            client = self._remotes[address] = self.connect(address)
        return client

    def close(self) -> None:
        """Close every channel (the own store's and the remote ones)."""
        for client in [self.client, *self._remotes.values()]:
            if client is not None:
                client.close()
        self._remotes.clear()

    def _timed(self, fn: Callable[[SwapTransfer], int], t: SwapTransfer) -> SwapResult:
        start = time.perf_counter()
        try:
            nbytes = fn(t)
        except (SwapError, ValueError, RuntimeError) as exc:
            log.warning("swap transfer %s failed: %s", t.transfer_id, exc)
            return SwapResult(False, 0, time.perf_counter() - start, str(exc))
        return SwapResult(True, int(nbytes), time.perf_counter() - start)

    def _swap_out(self, t: SwapTransfer) -> int:
        client = self._client()
        packed = self.pack(t.block_ids)
        try:
            return client.swap_out(t.transfer_id, packed, t.host_block_ids)
        except SwapError:
            # All or nothing on the store; a call that failed after the commit (deadline)
            # could still leave the blocks there.
            with contextlib.suppress(SwapError):
                client.free(t.host_block_ids)
            raise

    def _swap_in(self, t: SwapTransfer) -> int:
        client = (
            self._client() if t.source_address is None else self.remote_client(t.source_address)
        )
        unique = list(dict.fromkeys(t.host_block_ids))
        buf = self.host_buffer(len(unique))
        try:
            nbytes = client.swap_in(t.transfer_id, unique, buf)
            if len(unique) != len(t.host_block_ids):
                pos = {h: i for i, h in enumerate(unique)}
                index = torch.tensor([pos[h] for h in t.host_block_ids], dtype=torch.int64)
                buf = buf.index_select(0, index)
            self.unpack(t.block_ids, buf)
        finally:
            if t.host_blocks_to_free:
                try:
                    client.free(t.host_blocks_to_free)
                except SwapError:
                    log.warning("could not free host blocks of %s", t.transfer_id)
        return nbytes
