"""Benchmark: paged vs contiguous KV allocation on the default ShareGPT-like workload.

Runs, with the same KV memory (65,536 token slots by default):
* paged (block 16) vs contiguous reserving ``max_model_len`` per request (the vLLM paper's
  FasterTransformer / Orca (Max) baseline, §6.1), plus the contiguous ``max_tokens``
  reservation (Orca (Pow2)-like);
* a paged block-size sweep 1..32 (waste per sequence vs ``block_size / 2``; block-table
  length);
and prints the tables and the paged/contiguous ratios, checks the targets (paged
utilisation >= 0.96 at block 16; paged mean_running >= 2x contiguous), and writes
``benchmarks/results/simulate.json`` plus ``simulate_*.png`` figures next to it.

Usage::

    .venv/bin/python benchmarks/memory/simulate.py [--num-requests N] [--seed S] [--out DIR]

Deterministic (seeded); about 20 s on one CPU core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

from pagedserve.sim import cli as sim_cli
from pagedserve.sim.plots import plot_all
from pagedserve.sim.simulator import SimConfig, simulate

RESULTS = Path(__file__).resolve().parents[1] / "results"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0 (targets are reported, not enforced)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    opts = ap.parse_args(argv)

    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    args = parser.parse_args(
        ["--num-requests", str(opts.num_requests), "--seed", str(opts.seed),
         "--sweep-block-size", "1,2,4,8,16,32", "--plot", opts.out]
    )  # fmt: skip
    t0 = time.perf_counter()
    out = sim_cli.compute(args)
    workload = sim_cli.build_workload(args)
    base = SimConfig(**out["config"])
    pow2 = simulate(
        workload, dataclasses.replace(base, allocator="contiguous", reserve="max_tokens")
    )
    wall = time.perf_counter() - t0

    sim_cli.print_text(out)
    paged = out["results"]["paged"].report
    contig = out["results"]["contiguous"].report
    r = out["ratios"]
    print(
        f"\npaged / contiguous(max_model_len): utilisation {r['utilisation']:.2f}x, "
        f"mean_running {r['mean_running']:.2f}x, tokens/step {r['tokens_per_step']:.2f}x"
    )
    p2 = pow2.report
    print(
        f"contiguous(max_tokens, Orca-Pow2-like): utilisation {p2.utilisation:.1%}, "
        f"mean_running {p2.mean_running:.1f}, external fragmentation "
        f"{p2.external_fragmentation:.1%} of the pool, frag-blocked steps "
        f"{p2.frag_blocked_steps}/{p2.steps}; paged / it: mean_running "
        f"{paged.mean_running / p2.mean_running:.2f}x"
    )
    targets = {
        "paged_utilisation_ge_0.96": paged.utilisation >= 0.96,
        "paged_mean_running_ge_2x_contiguous": paged.mean_running >= 2 * contig.mean_running,
    }
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")
    print(f"simulation wall time {wall:.1f} s")

    results = dict(out["results"])
    results["contiguous_max_tokens"] = pow2
    plot_all(results, out["sweep"], opts.out, out["snapshot_step"], args.block_size, "simulate_")
    payload = sim_cli.to_json(out)
    payload["results"]["contiguous_max_tokens"] = p2.to_dict()
    payload["ratios_vs_max_tokens"] = sim_cli.ratios(paged, p2)
    payload["targets"] = targets
    payload["wall_time_s"] = round(wall, 2)
    payload["python"] = platform.python_version()
    path = Path(opts.out) / "simulate.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path} and PNGs in {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
