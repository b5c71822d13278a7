"""Configuration of the scheduler: admission, batching and prefix-caching policy.

A frozen dataclass validated in ``__post_init__`` (``ValueError`` naming the field); Ray
pickles it to the scheduler actor.
"""

from __future__ import annotations

from dataclasses import dataclass

ADMISSION_RESERVES = ("none", "max_tokens", "max_model_len")


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission and batching policy.

    Attributes:
        max_num_seqs: most sequences running on one worker in one step.
        max_num_batched_tokens: token budget of one step (decodes count 1, prefill chunks
            count their length; long prompts are chunked to fit).
        enable_chunked_prefill: split prompts longer than the remaining budget.
        enable_prefix_caching: share full prompt blocks across requests by block hash.
        max_model_len: longest sequence (prompt + output), tokens. ``None`` until the
            launcher fills it in from the workers' model (the :class:`Scheduler` requires
            it set); users set the model's ``max_model_len`` instead.
        admission_reserve: ``"none"`` (paged: blocks as a sequence grows); or, to measure
            what paging buys (``benchmarks/capacity.py``), admit a sequence only when the
            pool can hold its whole reservation, as pre-paging servers did:
            ``"max_tokens"`` reserves prompt + max_tokens, ``"max_model_len"`` reserves
            max_model_len (both capped at the pool size).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    admission_reserve: str = "none"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.admission_reserve not in ADMISSION_RESERVES:
            raise ValueError(
                f"admission_reserve must be one of {ADMISSION_RESERVES}, "
                f"got {self.admission_reserve!r}"
            )
