"""The tensor-parallel group of one logical worker and the collectives the sharded model
runs (Shoeybi et al., 2019, "Megatron-LM", sec. 3; vLLM's ``parallel_state`` and
``communication_op``).

A :class:`TensorParallelGroup` is the ranks ``[0, T)`` of one logical worker joined in a
torch.distributed process group: gloo on CPU, NCCL on CUDA. With ``T == 1`` it is a group of
one that never touches torch.distributed (every collective is the identity), so the
unsharded worker pays nothing.

What crosses the group per step: the step itself (:meth:`broadcast_object` from rank 0),
one all-reduce after every row-parallel layer and after the vocab-parallel embedding
(:meth:`all_reduce`), the LM head's logits gathered on rank 0 (:meth:`gather_last`) and the
sampled tokens broadcast back (:meth:`broadcast_tensor`). Any collective that fails (a rank
died, the timeout passed) raises :class:`GroupBroken`: the group cannot recover, so its
ranks stop and the scheduler requeues the logical worker's sequences.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.worker.config import ParallelConfig


class GroupBroken(RuntimeError):
    """A collective of the tensor-parallel group failed (a rank is gone or timed out)."""


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's view of its tensor-parallel group.

    Attributes:
        rank: this process's rank, ``0 <= rank < size``; rank 0 samples.
        size: ranks in the group (``T``).
        device: where the collectives' tensors live (CPU for gloo, the rank's GPU for NCCL).
    """

    rank: int
    size: int
    device: torch.device

    @classmethod
    def join(cls, config: ParallelConfig, device: torch.device) -> TensorParallelGroup:
        """Join (rendezvous at ``config.init_method``) the default process group of
        ``config.tensor_parallel_size`` ranks; returns the group of one without
        torch.distributed when the size is 1. On CUDA the rank takes GPU ``rank % visible
        GPUs`` as its current device (NCCL needs one GPU per rank).

        Raises:
            GroupBroken: the rendezvous did not complete within ``config.timeout_s``.
            RuntimeError: this process already joined another group.
        """
        size = config.tensor_parallel_size
        if size == 1:
            return cls(0, 1, device)
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            # One GPU per rank: under Ray each rank sees only its own (index 0); local
            # ranks (the offline API, the tests) see them all and take the rank's.
            index = config.rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        try:
            dist.init_process_group(
                backend,
                init_method=config.init_method,
                rank=config.rank,
                world_size=size,
                timeout=datetime.timedelta(seconds=config.timeout_s),
            )
        except (RuntimeError, ValueError) as exc:
            raise GroupBroken(
                f"rank {config.rank} of {size} could not join the group at "
                f"{config.init_method}: {exc}"
            ) from exc
        return cls(config.rank, size, device)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank the scheduler talks to, which samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x`` (any shape and dtype).

        Raises:
            GroupBroken: the collective failed.
        """
        if self.size > 1:
            self._run(dist.all_reduce, x)
        return x

    def min_int(self, value: int) -> int:
        """The minimum of ``value`` over the ranks (e.g. the KV pool's blocks)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._run(dist.all_reduce, t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x [N, C]`` along the last axis on rank 0:
        ``[N, size * C]`` in rank order there, ``None`` on the other ranks.

        Raises:
            GroupBroken: the collective failed.
        """
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        self._run(dist.gather, x, gather_list=parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (every rank passes a tensor of the same
        shape and dtype); returns ``x``.

        Raises:
            GroupBroken: the collective failed.
        """
        if self.size > 1:
            self._run(dist.broadcast, x, src=0)
        return x

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (any picklable value) on every rank; the others pass ``None``.

        Raises:
            GroupBroken: the collective failed.
        """
        if self.size == 1:
            return obj
        box = [obj]
        self._run(dist.broadcast_object_list, box, src=0)
        return box[0]

    def leave(self) -> None:
        """Destroy the process group (nothing when the size is 1 or it is gone)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def _run(self, collective: Any, *args: Any, **kwargs: Any) -> None:
        try:
            collective(*args, **kwargs)
        except (RuntimeError, ValueError, OSError) as exc:
            raise GroupBroken(
                f"rank {self.rank} of {self.size}: {collective.__name__} failed: {exc}"
            ) from exc
