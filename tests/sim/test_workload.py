"""Workload records, the default ShareGPT-like generator and the JSONL loader."""

from __future__ import annotations

import json
import statistics

import pytest

from pagedserve.sim.workload import (
    WorkloadRequest,
    WorkloadSpec,
    default_workload,
    load_workload,
    save_workload,
)


def test_default_workload_is_seeded_and_in_bounds() -> None:
    spec = WorkloadSpec(num_requests=3000, seed=3, max_model_len=2048)
    a, b = default_workload(spec), default_workload(spec)
    assert a == b
    assert a != default_workload(WorkloadSpec(num_requests=3000, seed=4))
    assert all(r.prompt_len + r.output_len <= 2048 for r in a)
    assert all(r.max_tokens is not None and r.output_len <= r.max_tokens for r in a)
    assert [r.arrival_step for r in a] == sorted(r.arrival_step for r in a)
    outs = [r.output_len for r in a]
    # Heavy tail: mean well above median; a few long generations.
    assert statistics.mean(outs) > 1.5 * statistics.median(outs)
    assert 0.01 < sum(o > 1000 for o in outs) / len(outs) < 0.15
    assert 120 < statistics.mean(r.prompt_len for r in a) < 200
    assert 0.4 < len(a) / a[-1].arrival_step < 0.6  # Poisson rate 0.5 / step


def test_default_workload_parallel_and_prefix_options() -> None:
    w = default_workload(
        WorkloadSpec(num_requests=200, parallel_fraction=1.0, prefix_fraction=1.0, prefix_len=64)
    )
    assert all(r.n == 4 and r.prefix_id is not None and r.prefix_len == 64 for r in w)
    assert all(r.prompt_len > 64 for r in w)


def test_record_validation() -> None:
    with pytest.raises(ValueError, match="output_len"):
        WorkloadRequest(0, 10, 0)
    with pytest.raises(ValueError, match="prefix_len"):
        WorkloadRequest(0, 10, 5, prefix_id=1, prefix_len=11)
    with pytest.raises(ValueError, match="prefix_id"):
        WorkloadRequest(0, 10, 5, prefix_len=3)
    with pytest.raises(ValueError, match="max_tokens"):
        WorkloadRequest(0, 10, 5, max_tokens=4)
    with pytest.raises(ValueError, match="arrival_step"):
        WorkloadRequest(-1, 10, 5)
    with pytest.raises(ValueError, match="integer"):
        WorkloadRequest(0, 10.5, 5)  # type: ignore[arg-type]


def test_jsonl_round_trip_and_sorting(tmp_path) -> None:
    w = (WorkloadRequest(5, 10, 3), WorkloadRequest(0, 20, 4, n=2, prefix_id=1, prefix_len=8))
    path = tmp_path / "w.jsonl"
    save_workload(path, w)
    assert load_workload(path) == (w[1], w[0])


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"arrival_step": 0, "prompt_len": 5}', "missing field"),
        ('{"arrival_step": 0, "prompt_len": 5, "output_len": 2, "colour": 1}', "unknown field"),
        ('{"arrival_step": 0, "prompt_len": 5, "output_len": 0}', "output_len must be >= 1"),
        (
            '{"arrival_step": 0, "prompt_len": "5", "output_len": 2}',
            "prompt_len must be an integer",
        ),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"arrival_step": 0, "prompt_len": 5, "output_len": 2})
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        load_workload(path)


def test_jsonl_empty_and_missing(tmp_path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="no records"):
        load_workload(path)
    with pytest.raises(FileNotFoundError):
        load_workload(tmp_path / "nope.jsonl")
