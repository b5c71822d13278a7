"""Verification of speculative tokens (worker/spec_decode.py): the acceptance rule, the
rows of a speculative step, and a statistical test that speculative sampling keeps the
target distribution (a Markov chain stands in for the model)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.input_batch import SequenceState
from pagedserve.worker.sampler import Sampler, SamplingRow, sampling_probs
from pagedserve.worker.spec_decode import accept, expand_rows

V = 4  # vocabulary of the chain
L = 3  # output tokens per sample
N = 3000  # samples per method


def test_accept_keeps_the_agreeing_prefix_then_the_first_disagreeing_draw():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + the bonus
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # first mismatch: its draw
    assert accept([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept([], [4]) == [4]
    with pytest.raises(ValueError, match="one more"):
        accept([5, 6], [5, 6])


def state(token_ids, num_prompt, num_spec, **sampling):
    return SequenceState(
        seq_id="s",
        token_ids=list(token_ids),
        num_prompt_tokens=num_prompt,
        block_ids=[0],
        num_computed_tokens=len(token_ids) - num_spec - 1,
        sampling=SamplingParams(**sampling),
        choice_index=2,
        seed=99,
        num_spec_tokens=num_spec,
    )


def test_rows_see_the_tokens_before_them_and_draw_with_their_positions_seed():
    # prompt [1 2], outputs [3], proposals [4 5]: rows after [1 2 3], [.. 4], [.. 4 5]
    vr = expand_rows([state([1, 2, 3, 4, 5], 2, 2), state([7, 8], 1, 0)])
    assert vr.token_ids == [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5], [7, 8]]
    assert [r.output_index for r in vr.rows] == [1, 2, 3, 1]
    assert {(r.seed, r.choice_index) for r in vr.rows} == {(99, 2)}
    assert vr.starts == [0, 3, 4]
    assert vr.num_prompt_tokens == [2, 2, 2, 1]


def chain() -> torch.Tensor:
    """Logits of the next token given the previous one: float32 ``[V, V]``."""
    return torch.randn(V, V, generator=torch.Generator().manual_seed(7)) * 1.5


def exact(logits: torch.Tensor, start: int) -> dict[tuple[int, ...], float]:
    """The probability of every L-token continuation of ``start``."""
    n = logits.shape[0]
    p = sampling_probs(
        logits,
        torch.ones(n, dtype=torch.float64),
        torch.zeros(n, dtype=torch.int64),
        torch.ones(n, dtype=torch.float64),
    )
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        prob, prev = 1.0, start
        for t in seq:
            prob *= float(p[prev, t])
            prev = t
        out[seq] = prob
    return out


def plain_samples(sampler, logits, start, seeds):
    """One plain sample of L tokens per seed (all seeds in one sampler call per token)."""
    toks = [[start] for _ in seeds]
    for i in range(L):
        rows = [SamplingRow(temperature=1.0, seed=s, output_index=i) for s in seeds]
        drawn = sampler(logits[torch.tensor([t[-1] for t in toks])], rows)
        for t, d in zip(toks, drawn):
            t.append(d)
    return [tuple(t[1:]) for t in toks]


def spec_samples(sampler, logits, start, seeds, rule=accept):
    """Speculative samples with proposals from a fixed rule (the next two ids), every
    unfinished sample's verification rows in one sampler call per round."""
    toks = {s: [start] for s in seeds}
    while live := [s for s in seeds if len(toks[s]) - 1 < L]:
        states, drafts = [], []
        for s in live:
            room = L - (len(toks[s]) - 1) - 1
            d = [(toks[s][-1] + 1) % V, (toks[s][-1] + 2) % V][:room]
            st = state(toks[s] + d, 1, len(d), temperature=1.0)
            st.seed = s
            states.append(st)
            drafts.append(d)
        vr = expand_rows(states)
        drawn = sampler(logits[torch.tensor([t[-1] for t in vr.token_ids])], vr.rows)
        for i, s in enumerate(live):
            toks[s] += rule(drafts[i], drawn[vr.starts[i] : vr.starts[i + 1]])
    return [tuple(toks[s][1 : L + 1]) for s in seeds]


def tv(counts: Counter, probs: dict[tuple[int, ...], float]) -> float:
    total = sum(counts.values())
    return 0.5 * sum(abs(counts.get(k, 0) / total - p) for k, p in probs.items())


def test_speculative_sampling_keeps_the_target_distribution():
    """Over N seeds, speculative samples (seeds 0..N-1) and plain samples (other seeds)
    of 3 tokens both match the chain's exact distribution of the 64 continuations (total
    variation within sampling noise: ~0.06 expected, bound 0.1), and each other. Always
    accepting the proposals (a wrong rule) is far off."""
    logits, sampler = chain(), Sampler()
    probs = exact(logits, 0)
    spec = Counter(spec_samples(sampler, logits, 0, range(N)))
    plain = Counter(plain_samples(sampler, logits, 0, range(N, 2 * N)))
    assert tv(spec, probs) < 0.1
    assert tv(plain, probs) < 0.1
    both = sum(plain.values())
    assert 0.5 * sum(abs(spec[k] - plain[k]) / both for k in probs) < 0.12

    def accept_all(drafts, drawn):
        return [*drafts, drawn[-1]]

    wrong = Counter(spec_samples(sampler, logits, 0, range(N // 3), accept_all))
    assert tv(wrong, probs) > 0.3


def test_acceptance_rate_is_the_target_probability_of_the_proposal():
    """One proposal d after token 0: accepted with probability p(d | 0) (within 4 sigma
    of N draws); after a rejection the token follows p with d removed, renormalised."""
    logits, sampler = chain(), Sampler()
    p = exact(logits, 0)
    p1 = [sum(v for k, v in p.items() if k[0] == t) for t in range(V)]
    d = 1
    states = []
    for s in range(N):
        st = state([0, d], 1, 1, temperature=1.0)
        st.seed = s
        states.append(st)
    vr = expand_rows(states)
    drawn = sampler(logits[torch.tensor([t[-1] for t in vr.token_ids])], vr.rows)
    firsts = [accept([d], drawn[2 * i : 2 * i + 2])[0] for i in range(N)]
    rate = firsts.count(d) / N
    sigma = (p1[d] * (1 - p1[d]) / N) ** 0.5
    assert abs(rate - p1[d]) < 4 * sigma
    rejected = Counter(t for t in firsts if t != d)
    residual = {(t,): p1[t] / (1 - p1[d]) for t in range(V) if t != d}
    assert tv(Counter({(t,): c for t, c in rejected.items()}), residual) < 0.06
