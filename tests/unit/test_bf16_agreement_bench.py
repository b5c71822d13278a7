"""``benchmarks/quality/bf16_agreement.py``'s pure helpers: the first difference, bf16 ulps,
margins at a first difference and the per-system summary."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "bf16_agreement", REPO / "benchmarks" / "quality" / "bf16_agreement.py"
)
assert _spec is not None and _spec.loader is not None
agreement = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = agreement  # its dataclasses look their module up
_spec.loader.exec_module(agreement)


def test_first_difference() -> None:
    assert agreement.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert agreement.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert agreement.first_difference([4, 2], [1, 2]) == 0
    assert agreement.first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: the shorter length
    assert agreement.first_difference([], []) is None


def test_bf16_ulp_matches_torch_spacing() -> None:
    for x in (1.0, 1.5, 3.0, 17.25, 0.3, 100.0, -22.0):
        t = torch.tensor(abs(x), dtype=torch.bfloat16)
        up = torch.nextafter(t, torch.tensor(float("inf"), dtype=torch.bfloat16))
        assert agreement.bf16_ulp(x) == float(up) - float(t)
    assert agreement.bf16_ulp(16.0) == 0.125  # 2^4 with 8 significant bits: 2^-3
    assert agreement.bf16_ulp(0.0) > 0


def test_margin_ulps() -> None:
    # Top 16.0 (ulp 0.125), second 15.75: 2 ulps; the token at 15.0 is 8 ulps below.
    row = [15.0, 16.0, 15.75, -3.0]
    assert agreement.margin_ulps(row) == pytest.approx(2.0)
    assert agreement.margin_ulps(row, 0) == pytest.approx(8.0)
    assert agreement.margin_ulps(row, 1) == 0.0
    assert agreement.margin_ulps(torch.tensor(row)) == pytest.approx(2.0)  # tensors too
    assert agreement.margin_ulps([2.0, 2.0, 1.0]) == 0.0  # an exact tie


def test_compare_and_summarize() -> None:
    ref = [5, 6, 7, 8]
    logits = [torch.full((10,), -1.0) for _ in ref]
    for lg, t in zip(logits, ref):
        lg[t] = 16.0
    logits[2][3] = 15.875  # step 2: token 3 one ulp below HF's top
    equal = agreement.compare([5, 6, 7, 8], ref, logits)
    assert (equal.agreed, equal.first_diff, equal.margin_ulps) == (4, None, None)
    flip = agreement.compare([5, 6, 3, 1], ref, logits)
    assert (flip.agreed, flip.first_diff) == (2, 2)
    assert flip.margin_ulps == pytest.approx(1.0)
    assert flip.chosen_gap_ulps == pytest.approx(1.0)
    far = agreement.compare([9, 6, 7, 8], ref, logits)
    assert far.margin_ulps == pytest.approx(17.0 / 0.125)
    assert far.chosen_gap_ulps == pytest.approx(17.0 / 0.125)
    short = agreement.compare([5, 6], ref, logits)
    assert (short.agreed, short.first_diff, short.margin_ulps) == (2, 2, None)

    s = agreement.summarize([equal, flip, far], 4)
    assert (s["equal"], s["prompts"]) == (1, 3)
    assert s["mean_agreed"] == 2.0  # (4 + 2 + 0) / 3
    assert s["agreement"] == 0.5  # 6 of 12 tokens
    assert s["first_diffs"] == [None, 2, 0]
    assert s["margins_ulps"] == [None, 1.0, 136.0]
    assert s["first_diffs_over_2_ulps"] == 1
