"""Admission checks beyond "the pool has room now": projected growth and reservations.

:class:`AdmissionPolicy` answers, for one worker and one waiting sequence, whether the
configured rule admits it: ``admission="projected"`` asks the projected peak of the
running batch (:mod:`pagedserve.scheduler.admission` computes it), ``admission_reserve``
asks whether the free pool covers every running sequence's reservation. Read-only: the
scheduler allocates and admits.
"""

from __future__ import annotations

import math

from pagedserve.scheduler.admission import Footprint, GrowthProjection
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.request import Sequence
from pagedserve.scheduler.worker_state import WorkerState


class AdmissionPolicy:
    """The projected-growth and reservation rules of one scheduler.

    Args:
        config: ``admission``, ``admission_reserve``, ``admission_growth_ratio``,
            ``async_scheduling`` and ``speculative_config``.
        max_model_len: the reservation of ``admission_reserve="max_model_len"``, tokens.
    """

    def __init__(self, config: SchedulerConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        spec = config.speculative_config
        # Slots a sequence may hold beyond its growth: one step more under overlap (see
        # _growth), and the K lookahead slots of a speculative decode.
        self._lag = (1 if config.async_scheduling else 0) + (
            0 if spec is None else spec.num_speculative_tokens
        )

    def _growth(self, seq: Sequence, num_tokens: int) -> int:
        """Steps a sequence with ``num_tokens`` known tokens may still grow (its last
        sampled token is never stored), scaled by ``admission_growth_ratio``.

        NOTE: with overlapped scheduling a finished sequence's blocks are freed when its
        last step's answer is applied, which is after the next step was planned: it holds
        them one step longer, counted here as one more step of growth (at most one block
        too many per sequence). With speculative decoding a decode holds up to K
        lookahead slots more, counted the same way."""
        lag = self._lag
        remaining = seq.max_total_tokens - 1 - num_tokens
        if remaining <= 0:
            return lag
        return math.ceil(remaining * self.config.admission_growth_ratio) + lag

    def projection(self, ws: WorkerState) -> GrowthProjection:
        """The projected demand of ``ws``'s running batch (:mod:`.admission`)."""
        kv = ws.kv
        bs = ws.spec.block_size
        proj = GrowthProjection(ws.spec.num_blocks, bs, ws.spec.num_blocks - kv.num_free_blocks)
        # NOTE: O(batch) on every step that a waiting sequence is refused: _growth inlined.
        get_usage = kv.get_usage
        add_running = proj.add_running
        lag = self._lag
        ratio = self.config.admission_growth_ratio
        ceil = math.ceil
        for seq in ws.running:
            exclusive, allocated = get_usage(seq.seq_id)
            n = len(seq.all_token_ids) + seq.num_pending_tokens
            remaining = seq.max_total_tokens - 1 - n
            growth = ceil(remaining * ratio) + lag if remaining > 0 else lag
            add_running(exclusive, allocated, n, growth)
            if seq.fork_children:
                proj.add([self._child_footprint(seq, bs) for _ in seq.fork_children])
        return proj

    def projection_admits(self, ws: WorkerState, seq: Sequence) -> bool:
        """Whether ``ws``'s projected-growth rule would admit ``seq`` now (True when that
        rule is off or nothing runs there)."""
        if (
            self.config.admission != "projected"
            or self.config.admission_reserve != "none"
            or not ws.running
        ):
            return True
        computed, _ = ws.kv.get_computed_blocks(
            seq.all_token_ids, seq.sampling.cache_salt, count=False
        )
        return self.projection(ws).fits(self.candidate_footprints(ws, seq, computed))

    def _child_footprint(self, parent: Sequence, bs: int) -> Footprint:
        """A choice still to fork from ``parent``: it will share the prompt's full blocks."""
        p = parent.num_prompt_tokens
        return Footprint(-((p - 1) // bs), p, self._growth(parent, p))

    def candidate_footprints(
        self, ws: WorkerState, seq: Sequence, computed_blocks: list[int]
    ) -> list[Footprint]:
        """Footprints of a waiting sequence and the choices (or beams) that will fork from
        it; its prefix-cache hits on blocks others hold add nothing."""
        kv = ws.kv
        bs = ws.spec.block_size
        held = sum(1 for b in computed_blocks if kv.get_ref_count(b) > 0)
        n = seq.num_tokens
        out = [Footprint(-held, n, self._growth(seq, n))]
        forks = len(seq.fork_children)
        if seq.sampling.use_beam_search and not seq.output_token_ids:
            forks += seq.sampling.beam_width - 1  # the beams fork from it after the prompt
        out.extend(self._child_footprint(seq, bs) for _ in range(forks))
        return out

    def reservation_fits(self, ws: WorkerState, seq: Sequence) -> bool:
        """Whether the free pool covers ``seq``'s whole reservation (``admission_reserve``).

        NOTE: the reservation is accounted, not allocated: running sequences still take
        their blocks as they grow (block tables and copy-on-write as in paged mode), but
        blocks they reserved and have not yet taken are never lent to a new admission, so
        no running sequence is ever preempted. Prefix-cache hits are not credited.
        """
        bs = ws.spec.block_size
        cap = ws.spec.num_blocks  # a reservation beyond the pool could never be admitted

        def reserved(s: Sequence) -> int:
            tokens = s.max_total_tokens
            if self.config.admission_reserve == "max_model_len":
                tokens = self.max_model_len
            return min(-(-tokens // bs), cap)

        owed = sum(reserved(s) - len(ws.kv.get_block_ids(s.seq_id)) for s in ws.running)
        return reserved(seq) + owed <= ws.kv.num_free_blocks
