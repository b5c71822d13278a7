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
from pagedserve.worker.sampler import greedy_tokens


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
        matchers: ``(sample row, grammar)`` of the rows to mask (row: an index into the
            step's logits).
        bitmask: int32 ``[num_rows_sampled, ceil(V / 32)]`` on the CPU.
        filled: resolves to the fill time in seconds once every row is filled.
    """

    matchers: list[tuple[int, SequenceGrammar]]
    bitmask: torch.Tensor
    filled: Future[float]

    @property
    def rows(self) -> list[int]:
        """The sample rows to mask."""
        return [i for i, _ in self.matchers]


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
        self._bitmask: torch.Tensor | None = None

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
        bitmask = self._bitmask_rows(len(grammars))
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-fill")
        return StructuredStep(matchers, bitmask, self._fill_pool.submit(_fill, matchers, bitmask))

    def _bitmask_rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the bitmask buffer, grown (doubling) when short.

        NOTE: one buffer for every step: a row is written whole by its fill and only the
        filled rows are applied, so it is never reset; steps run one at a time and the
        fills on one thread, in order, so a step's rows are not overwritten before its
        apply. Allocating (a ``torch.full``) each step costs milliseconds on busy cores.
        """
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < n:
            old = 0 if self._bitmask is None else self._bitmask.shape[0]
            self._bitmask = xgr.allocate_token_bitmask(max(n, 2 * old), self.vocab_size)
        return self._bitmask[:n]

    def apply(
        self,
        step: StructuredStep,
        logits: torch.Tensor,
        copy: bool,
        greedy: Sequence[bool] = (),
    ) -> tuple[torch.Tensor, float]:
        """Wait for the fill and mask the step's rows of ``logits`` (float ``[N, V]``, the
        processed logits), in place unless ``copy`` (when the caller still reads the
        unmasked values: logprobs and beam candidates come from the raw logits).

        A row flagged in ``greedy`` (its token is the argmax) whose unmasked argmax the
        grammar allows is left unmasked: its argmax is the same either way (argmax takes
        the lowest index among equal maxima, so no disallowed token ties below it).

        Returns:
            ``(masked, fill_s)``: the logits with the disallowed tokens of the constrained
            rows at ``-inf`` (except those greedy rows), and the seconds the fill took.
        """
        fill_s = step.filled.result()
        try:
            return self._mask(step, logits, copy, greedy), fill_s
        except Exception as exc:  # an xgrammar error ends these sequences, not the step
            for _, grammar in step.matchers:
                grammar.fail(f"applying the grammar mask failed: {exc}")
            return logits, fill_s

    def _mask(
        self, step: StructuredStep, logits: torch.Tensor, copy: bool, greedy: Sequence[bool]
    ) -> torch.Tensor:
        import xgrammar as xgr

        rows = step.rows
        greedy_rows = [r for r in rows if r < len(greedy) and greedy[r]]
        if greedy_rows:
            index = torch.tensor(greedy_rows)
            top = greedy_tokens(logits).cpu()[index]  # every row: no copy of the rows
            words = step.bitmask[index, top // 32]
            allowed = ((words >> (top % 32)) & 1).tolist()
            keep = {r for r, ok in zip(greedy_rows, allowed) if ok}
            rows = [r for r in rows if r not in keep]
        if not rows:
            return logits
        out = logits.clone() if copy else logits
        xgr.apply_token_bitmask_inplace(
            out, step.bitmask.to(out.device), vocab_size=self.vocab_size, indices=rows
        )
        return out


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
