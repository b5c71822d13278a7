"""``pagedserve simulate``: replay a workload through the paged and the contiguous allocators.

Both get the same KV memory (``--num-slots`` token slots); the command reports utilisation,
internal waste, external fragmentation, requests in flight and throughput per allocator, the
paged/contiguous ratios, and optionally a paged block-size sweep and PNG figures.

Usage::

    pagedserve simulate                                # default workload, both allocators
    pagedserve simulate --reserve max_tokens --output json
    pagedserve simulate --workload trace.jsonl --allocator paged
    pagedserve simulate --sweep-block-size 1,2,4,8,16,32 --plot out/

(also ``python -m pagedserve.sim.cli ...``). Metrics are defined in
:class:`pagedserve.sim.simulator.SimReport`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from pagedserve.sim.contiguous import RESERVE_MODES
from pagedserve.sim.simulator import SimConfig, SimReport, SimResult, simulate
from pagedserve.sim.simulator import sweep_block_sizes as _sweep
from pagedserve.sim.workload import (
    WorkloadRequest,
    WorkloadSpec,
    default_workload,
    load_workload,
)

_RATIO_KEYS = ("utilisation", "mean_running", "max_running", "tokens_per_step", "steps")
_TEXT_ROWS = (
    ("utilisation", "{:.1%}"),
    ("internal_waste", "{:.1%}"),
    ("external_fragmentation", "{:.1%}"),
    ("frag_blocked_steps", "{:d}"),
    ("mean_occupancy", "{:.1%}"),
    ("mean_running", "{:.1f}"),
    ("max_running", "{:d}"),
    ("tokens_per_step", "{:.1f}"),
    ("completed", "{:d}"),
    ("preemptions", "{:d}"),
    ("steps", "{:d}"),
    ("mean_tail_waste", "{:.1f}"),
    ("prefix_hit_tokens", "{:d}"),
)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated int list: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"block sizes must be >= 1: {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the simulate options to ``p``."""
    p.add_argument("--allocator", choices=["paged", "contiguous", "both"], default="both")
    p.add_argument("--block-size", type=int, default=16, help="paged tokens per block")
    p.add_argument(
        "--num-slots",
        type=int,
        default=65536,
        help="KV token slots for either allocator (paged: num_slots // block_size blocks)",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--reserve",
        choices=RESERVE_MODES,
        default="max_model_len",
        help="contiguous reservation: max_model_len slots, or prompt + max_tokens",
    )
    p.add_argument("--workload", default="default", help="'default' or a FILE.jsonl")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests (default workload: 1000; a file: its first N)",
    )
    p.add_argument("--seed", type=int, default=0, help="default workload seed")
    p.add_argument(
        "--arrival-rate",
        type=float,
        default=WorkloadSpec.arrival_rate,
        help="default workload: mean arrivals per step",
    )
    p.add_argument(
        "--parallel-fraction",
        type=float,
        default=0.0,
        help="default workload: share of requests with n=4 samples",
    )
    p.add_argument(
        "--prefix-fraction",
        type=float,
        default=0.0,
        help="default workload: share of requests with a shared 256-token prefix",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="paged: no prefix sharing")
    p.add_argument(
        "--sweep-block-size",
        type=_int_list,
        default=None,
        metavar="1,2,4,...",
        help="also run paged at each block size",
    )
    p.add_argument(
        "--check-every",
        type=int,
        default=1000,
        help="run the allocator integrity check every N steps (0: only at the end)",
    )
    p.add_argument("--output", choices=["text", "json"], default="text")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures to DIR")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "simulate",
        help="compare paged vs contiguous KV allocation on a workload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return p


def build_workload(args: argparse.Namespace) -> tuple[WorkloadRequest, ...]:
    """The workload the options ask for.

    Raises:
        ValueError: bad options, a missing file or an invalid record (naming its line).
    """
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.workload == "default":
        spec = WorkloadSpec(
            num_requests=args.num_requests or WorkloadSpec.num_requests,
            seed=args.seed,
            max_model_len=args.max_model_len,
            arrival_rate=args.arrival_rate,
            parallel_fraction=args.parallel_fraction,
            prefix_fraction=args.prefix_fraction,
        )
        return default_workload(spec)
    try:
        workload = load_workload(args.workload)
    except FileNotFoundError:
        raise ValueError(f"workload file not found: {args.workload}") from None
    return workload[: args.num_requests] if args.num_requests else workload


def ratios(paged: SimReport, contiguous: SimReport) -> dict[str, float]:
    """paged / contiguous for the headline figures (``inf`` over a zero)."""
    out = {}
    for key in _RATIO_KEYS:
        a, b = getattr(paged, key), getattr(contiguous, key)
        out[key] = a / b if b else float("inf")
    return out


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """Run everything the options ask for.

    Returns:
        ``{"workload": summary, "results": {label: SimResult}, "ratios": {...} | None,
        "sweep": [SimReport], "snapshot_step": int, "config": {...}}``.
    """
    workload = build_workload(args)
    snapshot_step = workload[len(workload) // 2].arrival_step
    kinds = ["paged", "contiguous"] if args.allocator == "both" else [args.allocator]
    results: dict[str, SimResult] = {}
    base = SimConfig(
        num_slots=args.num_slots,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        reserve=args.reserve,
        enable_prefix_caching=not args.no_prefix_caching,
        check_every=args.check_every,
        snapshot_step=snapshot_step if args.plot else None,
    )
    for kind in kinds:
        results[kind] = simulate(workload, dataclasses.replace(base, allocator=kind))
    both = "paged" in results and "contiguous" in results
    sweep = _sweep(workload, args.sweep_block_size, base) if args.sweep_block_size else ()
    n = len(workload)
    summary = {
        "num_requests": n,
        "mean_prompt_len": sum(r.prompt_len for r in workload) / n,
        "mean_output_len": sum(r.output_len for r in workload) / n,
        "last_arrival_step": workload[-1].arrival_step,
        "source": args.workload,
        "seed": args.seed if args.workload == "default" else None,
    }
    return {
        "config": {k: v for k, v in dataclasses.asdict(base).items() if k != "allocator"},
        "workload": summary,
        "results": results,
        "ratios": ratios(results["paged"].report, results["contiguous"].report) if both else None,
        "sweep": list(sweep),
        "snapshot_step": snapshot_step,
    }


def to_json(out: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready form of :func:`compute`'s result (reports only, no series)."""
    return {
        "config": out["config"],
        "workload": out["workload"],
        "results": {k: r.report.to_dict() for k, r in out["results"].items()},
        "ratios": out["ratios"],
        "sweep": [{**r.to_dict(), "half_block_size": r.block_size / 2} for r in out["sweep"]],
    }


def print_text(out: dict[str, Any]) -> None:
    """Rich tables of the comparison and the sweep."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    w = out["workload"]
    cfg = out["config"]
    console.print(
        f"workload {w['source']}: {w['num_requests']} requests, mean prompt "
        f"{w['mean_prompt_len']:.0f}, mean output {w['mean_output_len']:.0f} tokens; "
        f"{cfg['num_slots']} KV slots, block {cfg['block_size']}, reserve {cfg['reserve']}"
    )
    results = out["results"]
    table = Table(title="paged vs contiguous (same KV memory)")
    table.add_column("metric")
    for label in results:
        table.add_column(label, justify="right")
    if out["ratios"]:
        table.add_column("paged / contiguous", justify="right")
    for key, fmt in _TEXT_ROWS:
        row = [key] + [fmt.format(getattr(r.report, key)) for r in results.values()]
        if out["ratios"]:
            row.append(f"{out['ratios'][key]:.2f}x" if key in _RATIO_KEYS else "")
        table.add_row(*row)
    console.print(table)
    if out["sweep"]:
        t = Table(title="paged block-size sweep")
        for col in (
            "block",
            "util",
            "tail/seq",
            "B/2",
            "(B-1)/2",
            "table",
            "running",
            "preempt",
            "steps",
        ):
            t.add_column(col, justify="right")
        for r in out["sweep"]:
            t.add_row(
                str(r.block_size),
                f"{r.utilisation:.2%}",
                f"{r.mean_tail_waste:.2f}",
                f"{r.block_size / 2:.1f}",
                f"{(r.block_size - 1) / 2:.1f}",
                f"{r.mean_block_table_len:.1f}",
                f"{r.mean_running:.1f}",
                str(r.preemptions),
                str(r.steps),
            )
        console.print(t)


def run(args: argparse.Namespace) -> int:
    """Execute ``pagedserve simulate``; returns the exit status.

    Raises:
        ValueError: invalid options or workload (the CLI prints it and exits 2).
    """
    out = compute(args)
    if args.output == "json":
        print(json.dumps(to_json(out), indent=2))
    else:
        print_text(out)
    if args.plot:
        from pagedserve.sim.plots import plot_all

        paths = plot_all(
            out["results"], out["sweep"], args.plot, out["snapshot_step"], args.block_size
        )
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m pagedserve.sim.cli``)."""
    parser = argparse.ArgumentParser(
        prog="pagedserve simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
