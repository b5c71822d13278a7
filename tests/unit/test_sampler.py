"""Sampler: greedy, exact top-k / top-p masks, seeded reproducibility, distribution."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.worker.sampler import Sampler, SamplingRow, derive_seed, sampling_probs


def probs_of(logits, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    n = logits.shape[0]
    return sampling_probs(
        logits,
        torch.full((n,), temperature, dtype=torch.float64),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.full((n,), top_p, dtype=torch.float64),
    )


def test_greedy_is_argmax_for_temperature_zero_and_top_k_one() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(temperature=0.0, seed=i) for i in range(3)] + [
        SamplingRow(temperature=1.5, top_k=1, seed=i, output_index=i) for i in range(3)
    ]
    assert Sampler()(logits, rows) == logits.argmax(-1).tolist()


def test_top_k_keeps_exactly_k_tokens() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 2.5, 0.0]])
    p = probs_of(logits, top_k=3)[0]
    assert (p > 0).nonzero().flatten().tolist() == [1, 3, 4]
    kept = torch.softmax(logits[0, [1, 3, 4]].double(), -1)
    torch.testing.assert_close(p[[1, 3, 4]], kept)
    # Disabled values (0, -1, >= vocab) keep everything.
    for k in (0, -1, 6, 100):
        assert bool((probs_of(logits, top_k=k) > 0).all())


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.05, 0.25, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log().unsqueeze(0)
    # sorted: 0.5 (id 0), 0.25 (id 2), 0.15 (id 3), 0.05 (1), 0.05 (4)
    cases = {0.45: [0], 0.6: [0, 2], 0.74: [0, 2], 0.8: [0, 2, 3], 0.92: [0, 1, 2, 3], 0.99: [0, 1, 2, 3, 4], 1.0: [0, 1, 2, 3, 4]}  # fmt: skip
    for top_p, ids in cases.items():
        p = probs_of(logits, top_p=top_p)[0]
        assert (p > 0).nonzero().flatten().tolist() == ids, top_p
        torch.testing.assert_close(p[ids], probs[ids] / probs[ids].sum())
    # The most likely token always survives, however small p is.
    assert (probs_of(logits, top_p=1e-9)[0] > 0).nonzero().flatten().tolist() == [0]


def test_top_k_then_top_p_with_temperature() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    # temperature 2 -> softmax of [2, 1.5, 1, 0.5, 0]; top_k 3 renormalizes over 3 tokens
    # (0.506, 0.307, 0.186); top_p 0.7 then keeps the first two.
    p = probs_of(logits, temperature=2.0, top_k=3, top_p=0.7)[0]
    assert (p > 0).nonzero().flatten().tolist() == [0, 1]
    e = torch.tensor([math.exp(2.0), math.exp(1.5)], dtype=torch.float64)
    torch.testing.assert_close(p[[0, 1]], e / e.sum())


def test_seeded_draws_are_reproducible_and_batch_independent() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 200, generator=gen)
    rows = [SamplingRow(temperature=1.0, seed=42, choice_index=c, output_index=i)
            for c in range(2) for i in range(4)]  # fmt: skip
    sampler = Sampler()
    together = sampler(logits, rows)
    alone = [sampler(logits[i : i + 1], [row])[0] for i, row in enumerate(rows)]
    reversed_batch = sampler(logits.flip(0), rows[::-1])[::-1]
    assert together == alone == reversed_batch
    # Another seed gives another stream (with 8 draws over 200 tokens, surely different).
    other = sampler(logits, [SamplingRow(1.0, seed=43, choice_index=r.choice_index,
                                          output_index=r.output_index) for r in rows])  # fmt: skip
    assert other != together


def test_derive_seed_separates_fields() -> None:
    seeds = {derive_seed(s, c, i) for s in range(3) for c in range(3) for i in range(3)}
    assert len(seeds) == 27
    assert all(0 <= s < 2**64 for s in seeds)
    assert derive_seed(1, 23, 4) != derive_seed(12, 3, 4)


def test_samples_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    expected = probs_of(logits, temperature=0.8, top_k=4, top_p=0.9)[0]
    n = 4000
    rows = [SamplingRow(0.8, 4, 0.9, seed=7, output_index=i) for i in range(n)]
    tokens = Sampler()(logits.expand(n, -1), rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double() / n
    assert bool(((counts > 0) == (expected > 0)).all()), (counts, expected)
    torch.testing.assert_close(counts, expected, atol=0.03, rtol=0)


def test_mixed_batch_and_errors() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0]])
    rows = [SamplingRow(temperature=0.0), SamplingRow(temperature=1.0, top_k=1, seed=3)]
    assert Sampler()(logits, rows) == [1, 0]
    assert Sampler()(torch.empty(0, 3), []) == []
    with pytest.raises(ValueError, match="rows"):
        Sampler()(logits, rows[:1])


def test_tiny_temperature_is_greedy() -> None:
    from pagedserve.scheduler.sampling_params import SamplingParams

    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingRow(temperature=1e-300).greedy
    assert not SamplingParams(temperature=1e-3).greedy
