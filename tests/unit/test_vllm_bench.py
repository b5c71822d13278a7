"""``benchmarks/serving/vllm_bench.py`` without servers: the command lines it builds for
``pagedserve serve``, ``vllm serve`` and ``vllm bench serve``, the round order, the report
math on canned ``vllm bench serve --save-result`` JSON, and the ShareGPT repair."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "vllm_bench", REPO / "benchmarks" / "serving" / "vllm_bench.py"
)
assert _spec is not None and _spec.loader is not None
vllm_bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = vllm_bench  # its dataclasses look their module up
_spec.loader.exec_module(vllm_bench)
import sharegpt  # noqa: E402  (benchmarks/common, on the path vllm_bench set)
import vllm_bench_report as report  # noqa: E402

MODEL = "/models/SmolLM2"


def _flag(argv: list[str], name: str) -> str:
    """The value following ``name`` in ``argv`` (fails when absent)."""
    return argv[argv.index(name) + 1]


def _select(argv: list[str]) -> tuple[list[Any], list[Any]]:
    args = vllm_bench.build_parser().parse_args(argv)
    return vllm_bench.select(args, "/data/sharegpt.json")


def test_default_systems_and_workloads_are_the_comparison():
    systems, loads = _select([])
    assert [s.name for s in systems] == [
        "pagedserve-auto",
        "vllm-auto-default",
        "vllm-auto-both-cores",
        "vllm-fp32-default",
        "vllm-fp32-both-cores",
    ]
    assert [(s.dtype, s.both_cores) for s in systems[1:]] == [
        ("auto", False), ("auto", True), ("float32", False), ("float32", True)
    ]  # fmt: skip
    assert [w.name for w in loads] == [
        "sharegpt", "random-512-128", "prefix-4x512", "poisson-2rps-256-64", "burst-32x64"
    ]  # fmt: skip
    systems, _ = _select(["--pagedserve-dtypes", "auto,float32", "--systems",
                          "pagedserve-float32,vllm-fp32-both-cores"])  # fmt: skip
    assert [(s.name, s.dtype) for s in systems] == [
        ("pagedserve-float32", "float32"), ("vllm-fp32-both-cores", "float32")
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown systems"):
        _select(["--systems", "vllm-bf16"])
    with pytest.raises(ValueError, match="unknown workloads"):
        _select(["--workloads", "sharegpt,nope"])
    _, quick = _select(["--quick"])
    assert len(quick) == 1 and quick[0].num_prompts == 8


def test_client_args_carry_each_workload():
    _, loads = _select([])
    by_name = {w.name: w for w in loads}
    common = dict(base_url="http://127.0.0.1:9", model_dir=MODEL, result_dir="/r", seed=3)
    sg = vllm_bench.client_args(
        by_name["sharegpt"], backend="openai", result_filename="sg.json", **common
    )
    assert _flag(sg, "--dataset-name") == "sharegpt"
    assert _flag(sg, "--dataset-path") == "/data/sharegpt.json"
    assert _flag(sg, "--num-prompts") == "128" and _flag(sg, "--max-concurrency") == "64"
    assert "--request-rate" not in sg  # all at once, bounded by the concurrency
    assert _flag(sg, "--backend") == "openai" and _flag(sg, "--endpoint") == "/v1/completions"
    assert _flag(sg, "--served-model-name") == vllm_bench.SERVED_NAME
    assert _flag(sg, "--tokenizer") == MODEL and _flag(sg, "--seed") == "3"
    assert {"--ignore-eos", "--save-result"} <= set(sg) and _flag(sg, "--temperature") == "0"
    assert _flag(sg, "--result-dir") == "/r" and _flag(sg, "--result-filename") == "sg.json"
    rnd = vllm_bench.client_args(
        by_name["random-512-128"], backend="openai-chat", result_filename="x", **common
    )
    assert _flag(rnd, "--random-input-len") == "512" and _flag(rnd, "--random-output-len") == "128"
    assert _flag(rnd, "--max-concurrency") == "64"
    assert _flag(rnd, "--endpoint") == "/v1/chat/completions"
    pre = vllm_bench.client_args(
        by_name["prefix-4x512"], backend="openai", result_filename="x", **common
    )
    assert _flag(pre, "--dataset-name") == "prefix_repetition"
    assert _flag(pre, "--prefix-repetition-num-prefixes") == "4"
    assert _flag(pre, "--prefix-repetition-prefix-len") == "512"
    assert _flag(pre, "--max-concurrency") == "16"
    poi = vllm_bench.client_args(
        by_name["poisson-2rps-256-64"], backend="openai", result_filename="x", **common
    )
    assert _flag(poi, "--request-rate") == "2" and "--max-concurrency" not in poi
    assert _flag(poi, "--random-input-len") == "256" and _flag(poi, "--random-output-len") == "64"
    with pytest.raises(ValueError, match="backend"):
        vllm_bench.client_args(loads[0], backend="vllm", result_filename="x", **common)


def test_server_commands_match_memory_length_and_precision():
    systems, _ = _select(["--pagedserve-dtypes", "float32"])
    kw = dict(model_dir=MODEL, port=8123, kv_cache_gib=1, max_model_len=2048,
              vllm_python="/venv/bin/python")  # fmt: skip
    ps, ps_env = vllm_bench.server_command(systems[0], **kw)
    assert Path(ps[0]).name == "pagedserve" and ps[1] == "serve" and ps_env == {}
    assert _flag(ps, "--model") == MODEL and _flag(ps, "--http-port") == "8123"
    assert _flag(ps, "--kv-cache-memory") == "1G" and _flag(ps, "--max-model-len") == "2048"
    assert _flag(ps, "--dtype") == "float32" and "--no-prefix-caching" not in ps
    assert _flag(ps, "--port") != "50051"  # its gRPC port: a free one, not the default
    by_name = {s.name: s for s in systems}
    vd, vd_env = vllm_bench.server_command(by_name["vllm-auto-default"], **kw)
    assert vd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert _flag(vd, "--dtype") == "auto" and "--enable-prefix-caching" in vd
    assert _flag(vd, "--max-model-len") == "2048" and _flag(vd, "--port") == "8123"
    assert _flag(vd, "--served-model-name") == _flag(ps, "--served-model-name")
    assert vd_env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    vb, vb_env = vllm_bench.server_command(by_name["vllm-fp32-both-cores"], **kw)
    assert _flag(vb, "--dtype") == "float32"
    assert vb_env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    extra = ("--max-num-batched-tokens", "1024")
    pe, _ = vllm_bench.server_command(systems[0], **kw, pagedserve_args=extra)
    assert pe[-2:] == list(extra) and _flag(pe, "--dtype") == "float32"
    ve, _ = vllm_bench.server_command(by_name["vllm-auto-default"], **kw, pagedserve_args=extra)
    assert "--max-num-batched-tokens" not in ve  # pagedserve's flags only
    with pytest.raises(ValueError, match="venv"):
        vllm_bench.server_command(by_name["vllm-auto-default"], **{**kw, "vllm_python": None})
    with pytest.raises(ValueError, match="kind"):
        vllm_bench.System("x", "sglang", "auto")
    with pytest.raises(ValueError, match="vLLM only"):
        vllm_bench.System("x", "pagedserve", "auto", both_cores=True)


def test_rounds_rotate_so_every_system_leads_once():
    systems, _ = _select(["--systems", "pagedserve-auto,vllm-auto-default,vllm-fp32-default"])
    orders = [[s.name for s in vllm_bench.rotated(systems, r)] for r in range(3)]
    assert [o[0] for o in orders] == ["pagedserve-auto", "vllm-auto-default", "vllm-fp32-default"]
    assert all(sorted(o) == sorted(orders[0]) for o in orders)


def test_resolved_vllm_dtype_from_its_log():
    log = "INFO ... Initializing a V1 LLM engine with config: model='/m', dtype=torch.bfloat16, x"
    assert vllm_bench.resolved_vllm_dtype(log) == "bfloat16"
    assert vllm_bench.resolved_vllm_dtype("no config line") is None


# ---------------------------------------------------------------------- the report
def _result(tok_s: float, ttft: float, tpot: float, failed: int = 0) -> dict[str, Any]:
    """A ``vllm bench serve --save-result`` JSON (the fields of vLLM 0.32, not detailed)."""
    return {
        "date": "20261201-120000", "endpoint_type": "openai", "backend": "openai",
        "label": None, "model_id": MODEL, "tokenizer_id": MODEL, "num_prompts": 8,
        "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 8, "duration": 4.2,
        "completed": 8 - failed, "failed": failed, "total_input_tokens": 1024,
        "total_output_tokens": 256, "request_throughput": 1.9, "request_goodput": None,
        "output_throughput": tok_s, "total_token_throughput": tok_s * 5,
        "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "std_ttft_ms": 1.0,
        "p50_ttft_ms": ttft, "p99_ttft_ms": ttft * 2, "mean_tpot_ms": tpot,
        "median_tpot_ms": tpot, "std_tpot_ms": 0.5, "p50_tpot_ms": tpot, "p99_tpot_ms": tpot * 3,
        "mean_itl_ms": tpot, "p99_itl_ms": tpot * 4,
    }  # fmt: skip


def _canned_runs(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    """3 rounds of 3 systems on one workload, read back from result files on disk."""
    table = {  # system: per round (tok/s, TTFT mean, TPOT mean, failed)
        "pagedserve-auto": [(100, 900, 50, 0), (120, 800, 40, 0), (110, 1000, 45, 0)],
        "vllm-auto-both-cores": [(200, 300, 30, 0), (180, 400, 25, 0), (220, 350, 20, 0)],
        "vllm-fp32-both-cores": [(90, 250, 60, 0), (95, 200, 70, 0), (5, 1, 1, 2)],
    }
    runs: dict[str, list[dict[str, Any]]] = {}
    for name, rounds in table.items():
        runs[name] = []
        for i, (t, ttft, tpot, failed) in enumerate(rounds):
            path = tmp_path / f"{name}-{i}.json"
            path.write_text(json.dumps(_result(t, ttft, tpot, failed)))
            runs[name].append({"results": {"rnd": json.loads(path.read_text())}})
    return runs


def test_summary_medians_and_ratios(tmp_path):
    runs = _canned_runs(tmp_path)
    s = report.summarize(runs, ["rnd"], list(runs))
    assert s["per_round"]["vllm-fp32-both-cores"]["rnd"][2] is None  # 2 requests failed
    ps = s["medians"]["pagedserve-auto"]["rnd"]
    assert ps["output_throughput"] == 110 and ps["mean_ttft_ms"] == 900
    assert ps["p99_ttft_ms"] == 1800 and ps["mean_tpot_ms"] == 45 and ps["p99_tpot_ms"] == 135
    fp32 = s["medians"]["vllm-fp32-both-cores"]["rnd"]  # the median of the 2 rounds counted
    assert fp32["output_throughput"] == 92.5 and fp32["mean_ttft_ms"] == 225
    r = s["ratios"]["pagedserve-auto"]["rnd"]
    assert r["vllm-auto-both-cores"]["output_throughput"] == pytest.approx(110 / 200, abs=1e-3)
    assert r["vllm-fp32-both-cores"]["output_throughput"] == pytest.approx(110 / 92.5, abs=1e-3)
    # The better vLLM per metric: highest tok/s (auto), lowest TTFT (fp32), lowest TPOT (auto).
    assert r["vllm_best"]["output_throughput"] == pytest.approx(0.55)
    assert r["vllm_best"]["mean_ttft_ms"] == pytest.approx(900 / 225, abs=1e-3)
    assert r["vllm_best"]["mean_tpot_ms"] == pytest.approx(45 / 25, abs=1e-3)
    # Its default precision only: fp32's lower TTFT does not count.
    assert r["vllm_auto_best"]["mean_ttft_ms"] == pytest.approx(900 / 350, abs=1e-3)
    rr = s["round_ratios"]["pagedserve-auto"]["rnd"]["output_throughput"]
    assert rr["rounds"] == [0.5, pytest.approx(0.667, abs=1e-3), 0.5]  # round 3: fp32 failed
    assert rr["median"] == 0.5 and rr["min"] == 0.5 and rr["max"] == pytest.approx(0.667, 1e-3)
    assert s["better_vllm"] == {"rnd": "vllm-auto-both-cores"}
    md = report.markdown(s, "head")
    assert (
        "| rnd | vllm-auto-both-cores (better vLLM) | 200.0 | 350 / 700 | 25.0 / 75.0 | 3/3 |" in md
    )
    assert "| rnd | vllm-fp32-both-cores | 92.5 |" in md and "| 2/3 |" in md
    assert "| rnd | pagedserve-auto | vllm_best | 0.55x | 4.00x |" in md


def test_main_writes_the_json_from_each_round(tmp_path, monkeypatch):
    runs = _canned_runs(tmp_path)
    calls: list[tuple[int, str]] = []

    def fake_run_system(system, loads, args, ctx):
        calls.append((ctx["round"], system.name))
        assert [w.name for w in loads] == ["random-512-128"] and args.kv_cache_gib == 1
        res = runs[system.name][ctx["round"] - 1]["results"]["rnd"]
        return {"results": {"random-512-128": res}, "startup_s": 2.0 + ctx["round"]}

    import pagedserve.worker.model_store as model_store

    monkeypatch.setattr(vllm_bench, "run_system", fake_run_system)
    monkeypatch.setattr(vllm_bench, "ensure_vllm_venv", lambda: Path("/venv/bin/python"))
    monkeypatch.setattr(model_store, "resolve_model", lambda *a, **k: Path(MODEL))
    out = tmp_path / "vb.json"
    vllm_bench.main(["--systems", ",".join(runs), "--pagedserve-dtypes", "auto",
                     "--workloads", "random-512-128", "--out", str(out)])  # fmt: skip
    assert [c[0] for c in calls] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [c[1] for c in calls[3:6]] == ["vllm-auto-both-cores", "vllm-fp32-both-cores",
                                          "pagedserve-auto"]  # fmt: skip
    data = json.loads(out.read_text())
    assert data["model"] == MODEL and data["rounds"] == 3 and data["kv_cache_gib"] == 1
    assert data["medians"]["pagedserve-auto"]["random-512-128"]["output_throughput"] == 110
    assert data["ratios"]["pagedserve-auto"]["random-512-128"]["vllm_best"][
        "output_throughput"
    ] == pytest.approx(0.55)
    assert data["workloads"][0]["dataset_args"][:2] == ["--dataset-name", "random"]
    assert [r["startup_s"] for r in data["servers"]["pagedserve-auto"]] == [3.0, 4.0, 5.0]
    assert data["commit"] and "random-512-128" in data["markdown"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0


def test_pagedserve_alone_still_gets_the_vllm_client(tmp_path, monkeypatch):
    seen: list[Any] = []

    def fake_run_system(system, loads, args, ctx):
        seen.append(ctx["vllm_python"])  # the client runs in the vLLM venv
        return {"results": {}}

    import pagedserve.worker.model_store as model_store

    monkeypatch.setattr(vllm_bench, "run_system", fake_run_system)
    monkeypatch.setattr(vllm_bench, "ensure_vllm_venv", lambda: Path("/venv/bin/python"))
    monkeypatch.setattr(model_store, "resolve_model", lambda *a, **k: Path(MODEL))
    vllm_bench.main(["--quick", "--systems", "pagedserve-auto", "--out", str(tmp_path / "q.json")])
    assert seen == ["/venv/bin/python"]
    assert json.loads((tmp_path / "q.json").read_text())["medians"] == {"pagedserve-auto": {}}


# ---------------------------------------------------------------------- ShareGPT
def test_truncated_sharegpt_list_is_cut_and_closed():
    entries = [{"id": str(i), "conversations": [{"from": "human", "value": "hi }, {"}]}
               for i in range(3)]  # fmt: skip
    full = json.dumps(entries, indent=2).encode()
    cut = full[: full.rindex(b'"id": "2"') + 4]  # the file ends inside the third entry
    assert json.loads(sharegpt.close_truncated_list(cut)) == entries[:2]
    assert json.loads(sharegpt.close_truncated_list(full[:-2] + b",")) == entries
    with pytest.raises(ValueError, match="no complete entry"):
        sharegpt.close_truncated_list(full[:20])
