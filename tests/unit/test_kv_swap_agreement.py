"""The ranks of a tensor-parallel worker agree on every swap transfer
(:meth:`pagedserve.worker.kv_swap.KVSwapper.agree`): a transfer moved only where it moved
on every rank, with the group's bytes, and a swap-out this rank stored but another failed
is freed from the store. Rank 0 runs against a real store; the other rank's results arrive
through a stand-in for the group's all-reduce."""

from __future__ import annotations

import torch

from pagedserve.scheduler.outputs import SwapPlan, SwapTransfer
from pagedserve.worker.host_store import serve_host_store
from pagedserve.worker.kv_pool import KVPool
from pagedserve.worker.kv_swap import KVSwapper
from pagedserve.worker.swap_client import HostStoreClient


class OtherRank:
    """A group of two whose other rank reports ``flags`` (``[[ok, bytes], ...]``)."""

    size = 2

    def __init__(self, flags: list[list[int]]) -> None:
        self.flags = flags
        self.device = torch.device("cpu")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(torch.tensor(self.flags, dtype=x.dtype))


def test_a_transfer_moved_only_where_every_rank_moved_it() -> None:
    server, port, store = serve_host_store(1 << 20)
    try:
        g = torch.Generator().manual_seed(0)
        shape = (6, 4, 1, 8)  # this rank's one KV head
        pool = KVPool(
            tuple(torch.randn(shape, generator=g) for _ in range(2)),
            tuple(torch.randn(shape, generator=g) for _ in range(2)),
            4,
        )
        client = HostStoreClient(f"127.0.0.1:{port}", rank=0, tensor_parallel_size=2)
        per_block = 2 * 2 * 4 * 1 * 8 * 4
        plan = SwapPlan(
            blocks_to_swap_out=[
                SwapTransfer("out-a", [0, 1], [10, 11]),
                SwapTransfer("out-b", [2], [12]),
            ]
        )
        # The other rank moved out-a (its own bytes) and failed out-b.
        group = OtherRank([[1, 2 * per_block], [0, 0]])
        swapper = KVSwapper(pool, "torch", client, group=group)  # type: ignore[arg-type]
        results = swapper.run(plan)
        assert results["out-a"].ok and results["out-a"].num_bytes == 4 * per_block
        assert not results["out-b"].ok and results["out-b"].num_bytes == 0
        assert results["out-b"].error == "failed on another rank"
        # out-b's chunk of this rank was freed: only out-a's two blocks stay.
        assert store.num_blocks_stored == 2 and store.used_bytes == 2 * per_block
        client.close()
    finally:
        server.stop(0)
