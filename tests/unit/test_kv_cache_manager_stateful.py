"""Hypothesis stateful test of KVCacheManager against a shadow worker KV cache.

The machine plays scheduler and worker: it admits sequences (with prefix-cache hits), appends
tokens, forks, preempts (free + recompute with cache hits) and frees, on a small pool so that
allocation fails and cached blocks get evicted. The "worker" keeps its own block tables,
updated only from ``AllocationResult`` (``apply_to`` + ``blocks_to_copy``), and a shadow cache
holding ``(salt, token)`` per slot. After every rule: ``check_integrity()``, the worker tables
equal the manager's, and every live sequence reads back exactly its own tokens through its
table. Writes must land only in blocks the writer holds alone and that are not cached, and
every prefix-cache hit must hold exactly the looked-up tokens under the same salt.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.scheduler.kv_cache_manager import KVCacheManager

BS = 4
NUM_BLOCKS = 20
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9], [7] * 10]
tokens_st = st.lists(st.integers(0, 3), max_size=10)
salt_st = st.sampled_from([None, None, "s"])


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BS)
        self.kv: list[list[tuple[str | None, int] | None]] = [
            [None] * BS for _ in range(NUM_BLOCKS)
        ]
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.salts: dict[str, str | None] = {}
        self.next_id = 0

    # ----------------------------------------------------------------------- helpers
    def _new_id(self) -> str:
        self.next_id += 1
        return f"seq{self.next_id}"

    def _check_hit(self, hit: list[int], tokens: list[int], salt: str | None) -> None:
        assert len(hit) <= max(0, (len(tokens) - 1) // BS)
        for i, b in enumerate(hit):
            assert self.kv[b] == [(salt, t) for t in tokens[i * BS : (i + 1) * BS]], "wrong KV hit"

    def _write(self, sid: str, start: int) -> None:
        table, tokens, salt = self.tables[sid], self.tokens[sid], self.salts[sid]
        for pos in range(start, len(tokens)):
            b = table[pos // BS]
            assert self.m.get_ref_count(b) == 1, f"write into shared block {b}"
            assert self.m._pool.blocks[b].block_hash is None, f"write into cached block {b}"
            self.kv[b][pos % BS] = (salt, tokens[pos])

    def _admit(self, sid: str, tokens: list[int], salt: str | None, use_cache: bool) -> bool:
        hit, n = self.m.get_computed_blocks(tokens, salt) if use_cache else ([], 0)
        self._check_hit(hit, tokens, salt)
        if hit:
            event("admit: prefix-cache hit")
        evictable_before = self.m.num_cached_blocks
        free = self.m.num_free_blocks
        need = self.m.num_blocks_needed(None, len(tokens), hit)
        res = self.m.allocate_slots(sid, len(tokens), hit)
        assert (res is not None) == (need <= free)
        if res is None:
            event("admit: out of blocks")
            assert self.m.num_free_blocks == free and not self.m.has_seq(sid)
            return False
        if self.m.num_cached_blocks < evictable_before:
            event("admit: evicted cached blocks")
        assert not res.blocks_to_copy and self.m.num_free_blocks == free - need
        self.tables[sid] = []
        res.apply_to(self.tables[sid])
        self.tokens[sid], self.salts[sid] = list(tokens), salt
        self._write(sid, n)
        self.m.cache_blocks(sid, tokens, len(tokens), salt)
        return True

    def _drop(self, sid: str) -> None:
        self.m.free(sid)
        del self.tables[sid], self.tokens[sid], self.salts[sid]

    # ------------------------------------------------------------------------- rules
    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens_st, salt=salt_st, cache=st.booleans())
    def admit(self, prefix, suffix, salt, cache) -> None:
        tokens = (prefix + suffix) or [0]
        self._admit(self._new_id(), tokens, salt, cache)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=2 * BS))
    def append(self, data, new) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        tokens = self.tokens[sid]
        prev = len(tokens)
        free = self.m.num_free_blocks
        need = self.m.num_blocks_needed(sid, prev + len(new))
        res = self.m.allocate_slots(sid, prev + len(new))
        assert (res is not None) == (need <= free)
        if res is None:  # out of blocks: nothing changed; the scheduler preempts it
            event("append: out of blocks -> preempt")
            assert self.m.get_block_ids(sid) == self.tables[sid]
            assert self.m.num_free_blocks == free
            self._drop(sid)
            return
        assert self.m.num_free_blocks == free - need
        assert len(res.blocks_to_copy) == int(res.replaced_last) <= 1
        if res.replaced_last:
            event("append: copy-on-write")
        for src, dst in res.blocks_to_copy:
            self.kv[dst] = list(self.kv[src])
        res.apply_to(self.tables[sid])
        tokens.extend(new)
        self._write(sid, prev)
        self.m.cache_blocks(sid, tokens, len(tokens), self.salts[sid])

    @precondition(lambda self: self.tables)
    @rule(
        data=st.data(),
        drafts=st.lists(st.integers(0, 3), min_size=1, max_size=2 * BS),
        accepted=st.integers(0, 2 * BS),
    )
    def speculate(self, data, drafts, accepted) -> None:
        """Speculative decoding: reserve and write the slots of ``drafts``, keep the
        first ``accepted`` of them, roll the rest back (their blocks return to the pool,
        no block holding a rejected token is ever hashed: a later hit would read it)."""
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        tokens = self.tokens[sid]
        prev = len(tokens)
        accepted = min(accepted, len(drafts))
        res = self.m.allocate_slots(sid, prev + len(drafts))
        if res is None:
            event("speculate: out of blocks -> preempt")
            self._drop(sid)
            return
        for src, dst in res.blocks_to_copy:
            self.kv[dst] = list(self.kv[src])
        res.apply_to(self.tables[sid])
        tokens.extend(drafts)
        self._write(sid, prev)
        del tokens[prev + accepted :]
        keep = max(1, len(tokens))
        free = self.m.num_free_blocks
        freed = self.m.rollback(sid, keep)
        table = self.tables[sid]
        assert freed == table[-(-keep // BS) :]
        del table[-(-keep // BS) :]
        assert self.m.num_free_blocks == free + len(freed)
        if freed:
            event("speculate: blocks rolled back")
        self.m.cache_blocks(sid, tokens, len(tokens), self.salts[sid])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        child = self._new_id()
        free = self.m.num_free_blocks
        self.m.fork(parent, child)
        assert self.m.num_free_blocks == free
        self.tables[child] = list(self.tables[parent])
        self.tokens[child] = list(self.tokens[parent])
        self.salts[child] = self.salts[parent]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data) -> None:
        self._drop(data.draw(st.sampled_from(sorted(self.tables))))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def preempt_and_resume(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tables)))
        tokens, salt = self.tokens[sid], self.salts[sid]
        self._drop(sid)
        self._admit(sid, tokens, salt, use_cache=True)  # recompute; may hit its own blocks

    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens_st, salt=salt_st)
    def lookup_only(self, prefix, suffix, salt) -> None:
        tokens = prefix + suffix
        hit, n = self.m.get_computed_blocks(tokens, salt)
        assert n == len(hit) * BS
        self._check_hit(hit, tokens, salt)

    # -------------------------------------------------------------------- invariants
    @invariant()
    def integrity(self) -> None:
        self.m.check_integrity()

    @invariant()
    def worker_view_matches(self) -> None:
        held = set()
        for sid, table in self.tables.items():
            assert self.m.get_block_ids(sid) == table
            held.update(table)
            salt = self.salts[sid]
            for pos, t in enumerate(self.tokens[sid]):
                assert self.kv[table[pos // BS]][pos % BS] == (salt, t), f"{sid} lost token {pos}"
        assert len(held) == NUM_BLOCKS - self.m.num_free_blocks

    def teardown(self) -> None:
        for sid in list(self.tables):
            self._drop(sid)
        self.m.check_integrity()
        assert self.m.num_free_blocks == NUM_BLOCKS and self.m.usage == 0.0


KVCacheMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheManagerStateful = KVCacheMachine.TestCase
