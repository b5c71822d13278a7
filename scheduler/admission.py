"""Admission by projected growth: admit a sequence only if the pool's projected peak fits.

Admitting whatever fits the free pool now (vLLM v1) fills the pool with prompts, and then
every decode step that crosses a block boundary needs a block nobody has: the scheduler
preempts by recompute, and under pressure most of the compute is spent recomputing. Two
known answers: vLLM v0 keeps a watermark (1% of the pool) free at admission, which delays
but does not prevent the collapse (growth is not accounted); SGLang reserves, for each
running request, ``new_token_ratio`` x its remaining ``max_new_tokens`` (the ratio decays
while nothing is retracted and jumps back up on a retraction), which accounts for growth
but adds the reservations up as if every request reached its peak at the same moment.

This module computes the peak itself. Every running sequence ``i`` holds ``c_i`` token
slots and may add one slot per step for ``r_i`` more steps (``r_i``: its remaining
``max_tokens``, times ``admission_growth_ratio``), then finishes and frees its blocks. The
pool's demand ``t`` steps ahead is ``D(t) = other + sum over i with r_i >= t of (base_i +
ceil((c_i + t) / block_size))`` (``other``: blocks no running sequence frees when it
finishes, e.g. shared prefix blocks; ``base_i`` corrects for blocks shared with others).
``D`` only grows between two finishes, so its maximum is at some ``t = r_k``; sweeping the
sequences by decreasing ``r`` and keeping a histogram of ``(c_i - 1) mod block_size``
evaluates all of them in ``O(n log n + n * block_size)``. A candidate is admitted when the
peak with it included is at most the pool size: with ratio 1.0 no admitted sequence's
growth can force a preemption (decodes grow one slot per step; prefill is counted whole at
once), yet the pool holds more than a sum-of-maxima reservation (``--reserve max_tokens``)
would, because sequences that finish early leave room for later peaks.

Pure Python, no torch.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class Footprint:
    """One sequence's projected block use: ``base + ceil((tokens + t) / block_size)`` blocks
    for ``0 <= t <= growth`` steps ahead, then none (it finished).

    Built for every running sequence whenever a waiting one is refused, so not frozen (a
    frozen dataclass's ``__init__`` costs ~3x a plain one's); treat it as immutable.

    Attributes:
        base: blocks added to the table size (negative for blocks shared with others,
            which the sequence does not free and which are counted elsewhere).
        tokens: token slots it needs at ``t = 0`` (>= 1).
        growth: steps (= token slots) it may still add (>= 0).
    """

    base: int
    tokens: int
    growth: int


def peak_blocks(other: int, footprints: list[Footprint], block_size: int) -> int:
    """``max over t >= 0`` of the pool demand (see the module docstring), in blocks.

    Args:
        other: blocks that stay held whatever finishes.
        footprints: the sequences' projections.
        block_size: tokens per block (>= 1).

    Returns:
        The peak number of blocks; ``other`` when there are no footprints.
    """
    bs = block_size
    order = sorted(footprints, key=operator.attrgetter("growth"), reverse=True)
    counts = [0] * bs  # of (tokens - 1) % bs among the sequences alive at the current t
    sum_blocks = 0  # sum of base + ceil(tokens / bs) over them
    alive = 0
    best = other
    i, n = 0, len(order)
    while i < n:
        t = order[i].growth
        while i < n and order[i].growth == t:
            f = order[i]
            sum_blocks += f.base - (-f.tokens // bs)  # base + ceil(tokens / bs)
            counts[(f.tokens - 1) % bs] += 1
            alive += 1
            i += 1
        whole, part = divmod(t, bs)
        # ceil((c + t) / bs) = ceil(c / bs) + whole + [((c - 1) % bs) + part >= bs]
        crossing = sum(counts[bs - part :]) if part else 0
        best = max(best, other + sum_blocks + alive * whole + crossing)
    return best


@dataclass
class GrowthProjection:
    """The projected demand of one worker's pool, built once per admission round.

    Args:
        num_blocks: the pool size.
        block_size: tokens per block.
        used_blocks: blocks held now (``num_blocks - num_free_blocks``).
    """

    num_blocks: int
    block_size: int
    used_blocks: int
    footprints: list[Footprint] = field(default_factory=list)
    _other: int = 0
    _worst: int = 0  # used + every sequence's remaining growth, nothing freed

    def __post_init__(self) -> None:
        self._other = self.used_blocks
        self._worst = self.used_blocks

    def add_running(
        self, exclusive_blocks: int, allocated_tokens: int, tokens: int, growth: int
    ) -> None:
        """Account a running sequence.

        Args:
            exclusive_blocks: blocks only it holds (what its finish frees).
            allocated_tokens: token slots its table covers now.
            tokens: token slots it needs at its next step (its known tokens: a prompt
                still in prefill counts whole).
            growth: slots it may still add after that (>= 0).
        """
        # NOTE: called for every running sequence: no helper calls.
        bs = self.block_size
        if growth < 0:
            growth = 0
        if tokens < 1:
            tokens = 1
        allocated = -(-allocated_tokens // bs)
        self._other -= exclusive_blocks
        self.footprints.append(Footprint(exclusive_blocks - allocated, tokens, growth))
        self._worst += -(-(tokens + growth) // bs) - allocated

    def fits(self, candidates: list[Footprint]) -> bool:
        """Whether the pool's projected peak, with ``candidates`` admitted, fits it."""
        bs = self.block_size
        extra = sum(f.base + _cdiv(f.tokens + f.growth, bs) for f in candidates)
        if self._worst + extra <= self.num_blocks:
            return True  # fits even if nothing ever finished
        peak = peak_blocks(self._other, self.footprints + candidates, bs)
        return peak <= self.num_blocks

    def add(self, candidates: list[Footprint]) -> None:
        """Account admitted candidates (whose blocks ``used_blocks`` did not count)."""
        bs = self.block_size
        for f in candidates:
            self.footprints.append(f)
            self._worst += f.base + _cdiv(f.tokens + f.growth, bs)
