"""Structured outputs on the worker: one grammar matcher per sequence and the step's bitmask.

The worker holds each sequence's token history, so it holds the matcher too
(:attr:`SequenceState.grammar <pagedserve.worker.input_batch.SequenceState>`): built when
the sequence arrives (:class:`~pagedserve.scheduler.outputs.NewSequenceData`, whose
``sampling.structured_outputs`` carries the spec) by compiling the spec (an LRU per worker,
:mod:`pagedserve.worker.grammar`) and replaying the sequence's output tokens. Every way a
sequence reaches a worker again (a forked choice, a recompute preemption, a swap-in, a move
to another worker) sends it as a new sequence, so its matcher is rebuilt from the tokens the
scheduler holds and never travels between processes. A choice forked with ``n > 1`` gets
its own matcher the same way.

Per step (:class:`StructuredStep`): the rows to sample whose sequences are constrained get
their bitmask filled on a thread while the model forward runs (the matcher's state depends
only on tokens already accepted, which the worker holds before the step starts: in the
overlapped loop the worker has accepted the token it sampled at step t before t+1 arrives);
the sampler's logits are masked after penalties and before temperature, top-k and top-p
(vLLM v1 fills its ``grammar_bitmask`` in the scheduler process and applies it in the
model runner, ``apply_grammar_bitmask``). No bitmask is allocated and no thread is used when
no row of the step is constrained.

A grammar never ends the worker: a spec that does not compile, a replayed or sampled token
the matcher rejects, or an xgrammar error marks that sequence failed
(:attr:`~pagedserve.scheduler.outputs.RunnerOutput.failed_seq_ids`, which the scheduler
aborts) and its later rows run unconstrained until the scheduler forgets it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.scheduler.structured_outputs import StructuredOutputs
from pagedserve.worker.grammar import GrammarCompiler, GrammarConfig


class SequenceGrammar:
    """One sequence's grammar state: an ``xgrammar.GrammarMatcher``, or why it failed.

    Attributes:
        matcher: the matcher (None once failed).
        error: why the sequence's grammar failed ("" while it works).
    """

    __slots__ = ("error", "matcher")

    def __init__(self, matcher: Any = None, error: str = "") -> None:
        self.matcher = matcher
        self.error = error

    @property
    def active(self) -> bool:
        """True when the next token must be masked (a live, unterminated matcher)."""
        return self.matcher is not None and not self.matcher.is_terminated()

    def fail(self, error: str) -> None:
        self.matcher = None
        self.error = error

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and failed) when the grammar rejects it."""
        if self.matcher is None or self.matcher.is_terminated():
            return True
        try:
            ok = bool(self.matcher.accept_token(token_id))
        except Exception as exc:  # an xgrammar error ends this sequence only
            self.fail(f"grammar matcher failed: {exc}")
            return False
        if not ok:
            self.fail(f"token {token_id} is not allowed by the grammar")
        return ok


@dataclass
class StructuredStep:
    """One step's bitmask, being filled on a thread.

    Attributes:
        rows: the sample rows (indices into the step's logits) to mask.
        bitmask: int32 ``[num_rows_sampled, ceil(V / 32)]`` on the CPU.
        filled: resolves to the fill time in seconds once every row is filled.
    """

    rows: list[int]
    bitmask: torch.Tensor
    filled: Future[float]


class StructuredOutputsRunner:
    """The worker's grammar side: compiler, matcher construction, bitmask fill and apply.

    Args:
        model_path: the model folder (its tokenizer is loaded on first use).
        vocab_size: rows of the LM head.
        eos_token_ids: the model's EOS ids (the grammar's stop tokens).
        config: compile limits.
    """

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        config: GrammarConfig | None = None,
    ) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.config = config
        self._compiler: GrammarCompiler | None = None
        self._fill_pool: ThreadPoolExecutor | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler, built on first use (loading the tokenizer takes ~0.3 s)."""
        if self._compiler is None:
            self._compiler = GrammarCompiler.for_model(
                self.model_path, self.vocab_size, self.eos_token_ids, self.config
            )
        return self._compiler

    def build(self, spec: StructuredOutputs, output_token_ids: Sequence[int]) -> SequenceGrammar:
        """A matcher for ``spec`` that has accepted ``output_token_ids`` (failed state on
        any error: compile, a rejected token)."""
        import xgrammar as xgr

        try:
            grammar = SequenceGrammar(xgr.GrammarMatcher(self.compiler.compile(spec)))
        except Exception as exc:
            return SequenceGrammar(error=f"structured outputs: {exc}")
        for token in output_token_ids:
            if not grammar.accept(token):
                grammar.error = f"replaying the output: {grammar.error}"
                break
        return grammar

    def start_fill(self, grammars: Sequence[SequenceGrammar | None]) -> StructuredStep | None:
        """Start filling the bitmask of the active rows of ``grammars`` (one per sample
        row, None = unconstrained); None when no row is active (nothing allocated)."""
        matchers = [(i, g) for i, g in enumerate(grammars) if g is not None and g.active]
        if not matchers:
            return None
        import xgrammar as xgr

        rows = [i for i, _ in matchers]
        bitmask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-fill")
        return StructuredStep(rows, bitmask, self._fill_pool.submit(_fill, matchers, bitmask))

    def apply(
        self, step: StructuredStep, logits: torch.Tensor, raw: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """Wait for the fill and mask ``logits`` (the processed logits; copied first when
        they are the raw logits ``raw``, which logprobs read) in the step's rows.

        Returns:
            ``(masked, fill_s)``: float ``[N, V]`` with the disallowed tokens of the
            constrained rows at ``-inf``, and the seconds the fill took.
        """
        import xgrammar as xgr

        fill_s = step.filled.result()
        out = logits.clone() if logits is raw else logits
        xgr.apply_token_bitmask_inplace(
            out, step.bitmask.to(out.device), vocab_size=self.vocab_size, indices=step.rows
        )
        return out, fill_s


def _fill(matchers: list[tuple[int, SequenceGrammar]], bitmask: torch.Tensor) -> float:
    """Fill ``bitmask[i]`` for each ``(i, grammar)``; a row whose fill fails stays all-ones
    and its grammar is marked failed. Returns the seconds it took."""
    start = time.perf_counter()
    for i, grammar in matchers:
        try:
            grammar.matcher.fill_next_token_bitmask(bitmask, i)
        except Exception as exc:  # an xgrammar error ends this sequence only
            grammar.fail(f"grammar matcher failed: {exc}")
    return time.perf_counter() - start
