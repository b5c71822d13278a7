"""A small run of ``benchmarks/serving/stress.py`` (the full one is a script; docs/testing.md,
"Faults, security and load"): concurrent gRPC and HTTP streaming clients, mixed lengths, n > 1,
cancellations; every request ends with a terminal status and no block leaks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "serving"))
import stress

pytestmark = pytest.mark.slow


def test_small_stress_run(tiny_llama_dir, tmp_path):
    cfg = stress.StressConfig(
        model=str(tiny_llama_dir),
        clients=20,
        requests=60,
        max_tokens_max=24,
        max_model_len=512,
        max_paragraphs=1,
        num_blocks=64,
        cpus_per_worker=0,
        time_limit_s=300,
        request_timeout_s=120,
        sample_every=10,
        out=str(tmp_path / "stress.json"),
    )
    specs = stress.workload(cfg)
    assert {s.transport for s in specs} == {"grpc", "http"}
    assert any(s.n > 1 for s in specs) and any(s.cancel_after for s in specs)
    report = stress.run(cfg)
    assert report["requests_sent"] == 60 and report["not_sent"] == 0
    assert set(report["statuses"]) <= {"finished", "cancelled"}, report["statuses"]
    assert report["statuses"].get("finished", 0) >= 60 - sum(bool(s.cancel_after) for s in specs)
    assert report["all_terminal"] and report["finished_with_missing_choices"] == 0
    assert report["leaked_blocks"] == 0 and report["integrity"] == "ok"
    assert report["running_after"] == 0 and report["waiting_after"] == 0
    assert report["ttft_s"]["p50"] > 0 and report["itl_s"]["p99"] >= report["itl_s"]["p50"]
    assert report["output_tokens"] > 0
    assert any(name.startswith("driver+frontend") for name in report["rss"])
    assert json.loads(Path(cfg.out).read_text())["leaked_blocks"] == 0
