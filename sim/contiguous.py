"""Contiguous KV-cache allocator: the pre-PagedAttention baseline.

Each sequence gets, at admission, ONE run of adjacent KV token slots in a linear slot space
``[0, num_slots)``, sized for its prompt plus the most output it could ever produce. The run
is placed first-fit (lowest start address whose free run is long enough) and kept until the
sequence is freed. This reproduces the two losses the vLLM paper measures for systems such
as FasterTransformer and Orca (Kwon et al., SOSP 2023, §2.3 and Fig. 2):

* internal fragmentation: slots of a run reserved for future tokens that are never (or not
  yet) written; and
* external fragmentation: free slots exist, but no single free run is long enough for the
  next request, so it waits although the total free memory would hold it.

Pure Python; no torch. Slot ``s`` is the same unit as the paged cache's
``block_id * block_size + offset``: one token's K and V for every layer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

RESERVE_MODES = ("max_model_len", "max_tokens")


@dataclass(frozen=True)
class ContiguousRun:
    """One sequence's reservation.

    Attributes:
        start: first slot of the run (slot index in ``[0, num_slots)``).
        length: number of reserved slots (tokens).
        num_tokens: slots written so far (KV of tokens computed), ``0 <= num_tokens <= length``.
    """

    start: int
    length: int
    num_tokens: int = 0

    @property
    def end(self) -> int:
        """One past the last reserved slot."""
        return self.start + self.length


class ContiguousAllocator:
    """First-fit allocator of contiguous slot runs, one run per sequence.

    Args:
        num_slots: total KV token slots in the pool (>= 1).
        max_model_len: longest sequence (prompt + output) in tokens (>= 1).
        reserve: how big a run is reserved at admission:
            ``"max_model_len"`` reserves ``max_model_len`` slots whatever the request
            (FasterTransformer / Orca (Max) in the vLLM paper, §6.1);
            ``"max_tokens"`` reserves ``prompt_len + max_tokens`` slots, capped at
            ``max_model_len`` (Orca (Pow2) / Orca (Oracle) when max_tokens is a power-of-two
            / exact bound on the output).

    Raises:
        ValueError: on a non-positive size or an unknown ``reserve`` mode.
    """

    def __init__(self, num_slots: int, max_model_len: int, reserve: str = "max_model_len"):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if reserve not in RESERVE_MODES:
            raise ValueError(f"reserve must be one of {RESERVE_MODES}, got {reserve!r}")
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.reserve = reserve
        # Free runs as parallel sorted lists (start ascending); adjacent runs are always merged.
        self._free_starts: list[int] = [0]
        self._free_lens: list[int] = [num_slots]
        self._runs: dict[str, ContiguousRun] = {}
        self._num_reserved = 0
        self._num_tokens = 0

    # ----------------------------------------------------------------------------- sizing
    def reservation_size(self, prompt_len: int, max_tokens: int | None = None) -> int:
        """Slots reserved for one sequence with this prompt (tokens).

        ``max_tokens=None`` means the client set no cap, so the output may run to
        ``max_model_len`` and ``"max_tokens"`` mode reserves ``max_model_len`` too.

        Raises:
            ValueError: if ``prompt_len < 1``, ``max_tokens < 1`` or the prompt alone does not
                fit in ``max_model_len``.
        """
        if not 1 <= prompt_len <= self.max_model_len:
            raise ValueError(f"prompt_len must be in [1, {self.max_model_len}], got {prompt_len}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if self.reserve == "max_model_len" or max_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, prompt_len + max_tokens)

    # ------------------------------------------------------------------------- allocation
    def find_fit(self, length: int) -> int | None:
        """Start slot of the first free run that holds ``length`` slots, or None."""
        for start, run_len in zip(self._free_starts, self._free_lens):
            if run_len >= length:
                return start
        return None

    def allocate(self, seq_id: str, length: int) -> ContiguousRun | None:
        """Reserve ``length`` contiguous slots for ``seq_id`` (first fit).

        Returns:
            The new run, or ``None`` when no free run is long enough (nothing changes).

        Raises:
            ValueError: if ``seq_id`` already holds a run or ``length < 1``.
        """
        if seq_id in self._runs:
            raise ValueError(f"sequence {seq_id!r} already holds a run")
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        for i, run_len in enumerate(self._free_lens):
            if run_len >= length:
                start = self._free_starts[i]
                if run_len == length:
                    del self._free_starts[i]
                    del self._free_lens[i]
                else:
                    self._free_starts[i] = start + length
                    self._free_lens[i] = run_len - length
                run = ContiguousRun(start, length, 0)
                self._runs[seq_id] = run
                self._num_reserved += length
                return run
        return None

    def append_slots(self, seq_id: str, num_total_tokens: int) -> ContiguousRun:
        """Record that ``seq_id`` now has ``num_total_tokens`` tokens written in its run.

        Raises:
            KeyError: unknown sequence.
            ValueError: if the count shrinks or exceeds the reservation (the contiguous
                scheme cannot grow a run in place).
        """
        run = self._runs[seq_id]
        if not run.num_tokens <= num_total_tokens <= run.length:
            raise ValueError(
                f"{seq_id!r}: num_total_tokens must be in [{run.num_tokens}, {run.length}], "
                f"got {num_total_tokens}"
            )
        self._num_tokens += num_total_tokens - run.num_tokens
        new = ContiguousRun(run.start, run.length, num_total_tokens)
        self._runs[seq_id] = new
        return new

    def free(self, seq_id: str) -> None:
        """Release the run of ``seq_id`` and merge it with adjacent free runs.

        Raises:
            KeyError: unknown sequence.
        """
        run = self._runs.pop(seq_id)
        self._num_reserved -= run.length
        self._num_tokens -= run.num_tokens
        start, length = run.start, run.length
        i = bisect.bisect_left(self._free_starts, start)
        # Merge with the following free run.
        if i < len(self._free_starts) and self._free_starts[i] == start + length:
            length += self._free_lens[i]
            del self._free_starts[i]
            del self._free_lens[i]
        # Merge with the preceding free run.
        if i > 0 and self._free_starts[i - 1] + self._free_lens[i - 1] == start:
            self._free_lens[i - 1] += length
        else:
            self._free_starts.insert(i, start)
            self._free_lens.insert(i, length)

    # ------------------------------------------------------------------------ inspection
    def get_run(self, seq_id: str) -> ContiguousRun:
        """The run of ``seq_id``. Raises KeyError for an unknown sequence."""
        return self._runs[seq_id]

    def runs(self) -> dict[str, ContiguousRun]:
        """A copy of every live run, keyed by sequence id."""
        return dict(self._runs)

    def free_runs(self) -> list[tuple[int, int]]:
        """Free runs as ``(start, length)`` in address order."""
        return list(zip(self._free_starts, self._free_lens))

    @property
    def num_free_slots(self) -> int:
        """Slots in no run."""
        return self.num_slots - self._num_reserved

    @property
    def num_reserved_slots(self) -> int:
        """Slots inside runs (written or not)."""
        return self._num_reserved

    @property
    def num_live_tokens(self) -> int:
        """Slots holding written KV."""
        return self._num_tokens

    @property
    def largest_free_run(self) -> int:
        """Length of the longest free run (0 when full)."""
        return max(self._free_lens, default=0)

    @property
    def usage(self) -> float:
        """Reserved slots / all slots, in [0, 1] (the contiguous analogue of KV cache usage)."""
        return self._num_reserved / self.num_slots

    def unusable_free_slots(self, length: int) -> int:
        """Free slots lying in runs shorter than ``length``: free memory a request needing a
        run of ``length`` cannot use (external fragmentation as seen by that request)."""
        return sum(n for n in self._free_lens if n < length)

    def check_integrity(self) -> None:
        """Check that runs and free runs tile ``[0, num_slots)`` exactly, without overlap,
        that free runs are merged, and that the cached counters match.

        Raises:
            AssertionError: with a message naming the broken invariant.
        """
        pieces = [(r.start, r.length, "run") for r in self._runs.values()]
        pieces += [(s, n, "free") for s, n in zip(self._free_starts, self._free_lens)]
        pieces.sort()
        pos = 0
        prev_kind = ""
        for start, length, kind in pieces:
            if start != pos or length < 1:
                raise AssertionError(f"slot space broken at {pos}: next piece {start}+{length}")
            if kind == "free" and prev_kind == "free":
                raise AssertionError(f"adjacent free runs not merged at {start}")
            pos, prev_kind = start + length, kind
        if pos != self.num_slots:
            raise AssertionError(f"pieces cover {pos} slots, pool has {self.num_slots}")
        if self._free_starts != sorted(self._free_starts):
            raise AssertionError("free runs not in address order")
        if self._num_reserved != sum(r.length for r in self._runs.values()):
            raise AssertionError("reserved-slot counter out of sync")
        if self._num_tokens != sum(r.num_tokens for r in self._runs.values()):
            raise AssertionError("live-token counter out of sync")
        for seq_id, r in self._runs.items():
            if not 0 <= r.num_tokens <= r.length:
                raise AssertionError(f"{seq_id!r} wrote {r.num_tokens} of {r.length} slots")
