"""The report of ``vllm_bench.py``: medians over rounds, ratios, the Markdown table, the plot.

Input: per system, one entry per round, ``{"results": {workload: R or None}}`` where R is
the JSON ``vllm bench serve --save-result`` writes (``output_throughput`` in output
tokens/s; ``mean_ttft_ms``, ``p99_ttft_ms``, ``mean_tpot_ms``, ``p99_tpot_ms`` in ms;
``completed``, ``failed``, ``num_prompts``). A run counts only when every request
completed. System names start with ``pagedserve-`` or ``vllm-`` (``vllm-auto-``: vLLM in
its default precision). Only the standard library is imported (matplotlib in :func:`plot`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

METRICS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")
HIGHER_IS_BETTER = frozenset({"output_throughput"})
LABELS = {
    "output_throughput": "output tok/s",
    "mean_ttft_ms": "TTFT mean",
    "p99_ttft_ms": "TTFT p99",
    "mean_tpot_ms": "TPOT mean",
    "p99_tpot_ms": "TPOT p99",
}


def run_metrics(res: dict[str, Any] | None) -> dict[str, float] | None:
    """The :data:`METRICS` of one ``vllm bench serve`` result; None when it is missing or
    a request did not complete."""
    if not res or res.get("failed", 0) or res.get("completed") != res.get("num_prompts"):
        return None
    return {m: float(res[m]) for m in METRICS}


def _best(values: dict[str, float], metric: str) -> tuple[str, float] | None:
    if not values:
        return None
    pick = max if metric in HIGHER_IS_BETTER else min
    name = pick(values, key=lambda n: values[n])
    return name, values[name]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def summarize(
    runs: dict[str, list[dict[str, Any]]], workloads: list[str], systems: list[str]
) -> dict[str, Any]:
    """Medians over rounds and pagedserve / vLLM ratios.

    Returns:
        ``per_round[system][workload]``: each round's metrics (None: failed);
        ``medians[system][workload][metric]``: the median over the rounds that counted;
        ``ratios[pagedserve system][workload][over]`` with ``over`` each vLLM system,
        ``vllm_best`` (per metric the better value of any vLLM configuration: highest
        throughput, lowest latency) and ``vllm_auto_best`` (the same over vLLM in its default
        precision): ``{metric: pagedserve / vLLM}``;
        ``round_ratios[pagedserve system][workload][metric]``: the ratio to the better vLLM
        within each round, and its median, min and max (what a drift of the machine's speed
        over the run moves least);
        ``better_vllm[workload]``: the vLLM system with the highest median throughput.
    """
    per_round = {
        s: {w: [run_metrics(r.get("results", {}).get(w)) for r in runs.get(s, [])] for w in workloads}
        for s in systems
    }  # fmt: skip
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for s in systems:
        medians[s] = {}
        for w in workloads:
            ok = [m for m in per_round[s][w] if m is not None]
            if ok:
                medians[s][w] = {k: round(statistics.median(m[k] for m in ok), 3) for k in METRICS}
    ps_names = [s for s in systems if s.startswith("pagedserve-")]
    vllm_names = [s for s in systems if s.startswith("vllm-")]
    groups = {
        "vllm_best": vllm_names,
        "vllm_auto_best": [s for s in vllm_names if s.startswith("vllm-auto-")],
    }
    ratios: dict[str, Any] = {}
    round_ratios: dict[str, Any] = {}
    for ps in ps_names:
        ratios[ps], round_ratios[ps] = {}, {}
        for w in workloads:
            mine = medians[ps].get(w)
            if mine is None:
                continue
            r: dict[str, dict[str, float | None]] = {}
            for v in vllm_names:
                if w in medians[v]:
                    r[v] = {k: _ratio(mine[k], medians[v][w][k]) for k in METRICS}
            for group, members in groups.items():
                have = [v for v in members if w in medians[v]]
                if have:
                    r[group] = {}
                    for k in METRICS:
                        best = _best({v: medians[v][w][k] for v in have}, k)
                        r[group][k] = _ratio(mine[k], best[1] if best else None)
            ratios[ps][w] = r
            round_ratios[ps][w] = _round_ratios(per_round, ps, vllm_names, w)
    better = {}
    for w in workloads:
        best = _best({v: medians[v][w]["output_throughput"] for v in vllm_names if w in medians[v]},
                     "output_throughput")  # fmt: skip
        better[w] = best[0] if best else None
    return {
        "per_round": per_round,
        "medians": medians,
        "ratios": ratios,
        "round_ratios": round_ratios,
        "better_vllm": better,
    }


def _round_ratios(
    per_round: dict[str, Any], ps: str, vllm_names: list[str], w: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in METRICS:
        rs = []
        for i, mine in enumerate(per_round[ps][w]):
            vals = {
                v: per_round[v][w][i][k]
                for v in vllm_names
                if i < len(per_round[v][w]) and per_round[v][w][i] is not None
            }
            best = _best(vals, k)
            if mine is not None and best is not None:
                rs.append(_ratio(mine[k], best[1]))
        if rs:
            out[k] = {"rounds": rs, "median": statistics.median(rs), "min": min(rs), "max": max(rs)}
    return out


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(summary: dict[str, Any], head: str) -> str:
    """Two tables: medians per workload and system, then pagedserve / vLLM ratios."""
    rows = [head, "", "| workload | system | output tok/s | TTFT mean / p99 (ms) "
            "| TPOT mean / p99 (ms) | rounds counted |", "|---|---|---|---|---|---|"]  # fmt: skip
    workloads = list(next(iter(summary["per_round"].values()), {}))
    for w in workloads:
        for s, by_w in summary["per_round"].items():
            m = summary["medians"][s].get(w)
            counted = f"{sum(x is not None for x in by_w[w])}/{len(by_w[w])}"
            if m is None:
                rows.append(f"| {w} | {s} | - | - | - | {counted} |")
                continue
            star = " (better vLLM)" if summary["better_vllm"].get(w) == s else ""
            rows.append(
                f"| {w} | {s}{star} | {m['output_throughput']:.1f} | {m['mean_ttft_ms']:.0f} / "
                f"{m['p99_ttft_ms']:.0f} | {m['mean_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} "
                f"| {counted} |"
            )
    rows += ["", "pagedserve / vLLM (medians; above 1 is better for tok/s, below 1 for "
             "latencies):", "", "| workload | pagedserve | over | "
             + " | ".join(LABELS[k] for k in METRICS) + " |", "|---|---|---|"
             + "---|" * len(METRICS)]  # fmt: skip
    for ps, by_w in summary["ratios"].items():
        for w, overs in by_w.items():
            for over, r in overs.items():
                cells = " | ".join(f"{_f(r[k], '.2f')}x" for k in METRICS)
                rows.append(f"| {w} | {ps} | {over} | {cells} |")
    return "\n".join(rows)


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Output tok/s, TTFT mean and TPOT mean per workload and system (bars: medians; dots:
    rounds). Returns False, writing nothing, when no run counted or matplotlib is not
    importable."""
    if not any(summary["medians"].values()):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    per_round = summary["per_round"]
    systems = list(per_round)
    workloads = list(next(iter(per_round.values()), {}))
    panels = [("output_throughput", "output tokens/s"), ("mean_ttft_ms", "TTFT mean (ms)"),
              ("mean_tpot_ms", "TPOT mean (ms)")]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5))
    width = 0.8 / max(1, len(systems))
    for ax, (k, label) in zip(axes, panels, strict=True):
        for j, s in enumerate(systems):
            xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(workloads))]
            ys = [summary["medians"][s].get(w, {}).get(k, 0.0) for w in workloads]
            ax.bar(xs, ys, width, label=s)
            for x, w in zip(xs, workloads, strict=True):
                pts = [m[k] for m in per_round[s][w] if m is not None]
                ax.scatter([x] * len(pts), pts, color="k", s=8, zorder=3)
        ax.set_xticks(range(len(workloads)), workloads, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        if k != "output_throughput":
            ax.set_yscale("log", nonpositive="clip")  # a missing median is a 0 bar
    axes[0].legend(fontsize=7)
    fig.suptitle("vllm bench serve against each server (medians over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
