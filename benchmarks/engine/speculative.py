"""Speculative decoding (n-gram) against plain decoding, side by side, in process.

Two ``pagedserve.LLM`` engines on the same model, one with
``speculative_config={"method": "ngram", ...}``, run the same requests in alternation
(``--rounds`` times, the prefix cache reset before each run, the fastest run kept: this
machine's load only adds time). Two workloads, greedy:

* ``repetitive``: batch 1, chat prompts asking to repeat or lightly edit a given text or
  code (the answer copies the prompt: prompt lookup's case);
* ``sharegpt``: the first human turn of ShareGPT conversations (``--sharegpt``, the file
  ``benchmarks/common/sharegpt.py`` prepares), at each of ``--batches`` requests at once,
  ``ignore_eos``; a batch below ``--min-requests`` runs that many requests in groups.

Per point: TPOT (the mean over requests of (last token - first token) / (tokens - 1),
from the scheduler's ``request_time_per_output_token_seconds``), output tokens/s, the
acceptance rate and mean accepted length, and whether both engines produced the same
tokens. Prints a table and writes ``results/speculative.json``.

Usage::

    .venv/bin/python benchmarks/engine/speculative.py --batches 1,4,16 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from pagedserve import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results"
SHAREGPT = Path("benchmarks/.data/ShareGPT_V3_unfiltered_cleaned_split.json")

CODE = """def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)


def variance(xs):
    m = mean(xs)
    total = 0
    for x in xs:
        total += (x - m) ** 2
    return total / len(xs)
"""
TEXT = (
    "Paged attention stores the key and value cache in fixed-size blocks, so a sequence "
    "takes memory as it grows and blocks can be shared between sequences. The scheduler "
    "keeps a block table for every sequence and the kernel reads the cache through it."
)
REPETITIVE = [
    "Repeat this code exactly:\n" + CODE,
    "Rename the function mean to average everywhere in this code and print all of it:\n" + CODE,
    "Repeat this text word for word:\n" + TEXT,
    "Rewrite this text with 'sequence' replaced by 'request':\n" + TEXT,
]


def sharegpt_prompts(path: Path, n: int, tokenizer: Any, max_len: int) -> list[str]:
    """``n`` first human turns of at most ``max_len`` tokens, in a seeded order."""
    convs = json.loads(path.read_text())
    random.Random(0).shuffle(convs)
    out = []
    for c in convs:
        turns = c.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = turns[0]["value"]
        if 4 <= len(tokenizer(text)["input_ids"]) <= max_len:
            out.append(text)
        if len(out) == n:
            break
    return out


def run_once(llm: LLM, prompts: list[str], sampling: SamplingParams) -> dict[str, Any]:
    """One run: wall time, tokens, TPOT and speculation counters of this run alone."""
    sched = llm.scheduler
    if not sched.reset_prefix_cache():
        raise RuntimeError("the engine is not idle")
    h0 = sched.metrics.histograms["request_time_per_output_token_seconds"].snapshot()
    s0 = sched.stats().spec_decode
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sampling)
    wall = time.perf_counter() - t0
    h1 = sched.metrics.histograms["request_time_per_output_token_seconds"].snapshot()
    s1 = sched.stats().spec_decode
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = s1.num_drafts - s0.num_drafts
    proposed = s1.num_draft_tokens - s0.num_draft_tokens
    accepted = s1.num_accepted_tokens - s0.num_accepted_tokens
    n = h1.count - h0.count
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_per_s": tokens / wall,
        "tpot_ms": 1e3 * (h1.sum - h0.sum) / n if n else float("nan"),
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def compare(
    engines: dict[str, LLM], prompts: list[str], sampling: SamplingParams, rounds: int
) -> dict[str, Any]:
    """Both engines on ``prompts``, alternating, ``rounds`` each; the fastest of each."""
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for name, llm in engines.items():
            r = run_once(llm, prompts, sampling)
            if name not in best or r["wall_s"] < best[name]["wall_s"]:
                best[name] = r
    plain, spec = best["plain"], best["ngram"]
    same = sum(a == b for a, b in zip(plain["token_ids"], spec["token_ids"]))
    for r in best.values():
        del r["token_ids"]
    return {
        "plain": plain,
        "ngram": spec,
        "tpot_speedup": plain["tpot_ms"] / spec["tpot_ms"],
        "throughput_ratio": spec["tok_per_s"] / plain["tok_per_s"],
        "same_outputs": f"{same}/{len(prompts)}",
    }


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Groups of one batch size as one point: summed walls and tokens, mean TPOT and
    acceptance figures, the ratios recomputed."""
    out: dict[str, Any] = {}
    for name in ("plain", "ngram"):
        rs = [p[name] for p in parts]
        wall = sum(r["wall_s"] for r in rs)
        tokens = sum(r["tokens"] for r in rs)
        out[name] = {
            "wall_s": wall,
            "tokens": tokens,
            "tok_per_s": tokens / wall,
            "tpot_ms": sum(r["tpot_ms"] for r in rs) / len(rs),
            "acceptance_rate": sum(r["acceptance_rate"] for r in rs) / len(rs),
            "mean_accepted_length": sum(r["mean_accepted_length"] for r in rs) / len(rs),
        }
    same = [p["same_outputs"].split("/") for p in parts]
    return {
        **out,
        "tpot_speedup": out["plain"]["tpot_ms"] / out["ngram"]["tpot_ms"],
        "throughput_ratio": out["ngram"]["tok_per_s"] / out["plain"]["tok_per_s"],
        "same_outputs": f"{sum(int(a) for a, _ in same)}/{sum(int(b) for _, b in same)}",
        "groups": len(parts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--batches", default="1,4,16", help="ShareGPT batch sizes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repetitive-max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--min-requests",
        type=int,
        default=4,
        help="ShareGPT: batches below this run several groups (default: %(default)s)",
    )
    ap.add_argument("--sharegpt", type=Path, default=SHAREGPT)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = ap.parse_args()
    opts = dict(num_blocks=2048, device="cpu", num_threads=args.threads, max_model_len=1024)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "ngram_min": args.ngram_min,
        "ngram_max": args.ngram_max,
    }
    engines = {
        "plain": LLM(args.model, **opts),
        "ngram": LLM(args.model, speculative_config=spec, **opts),
    }
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    for llm in engines.values():
        llm.chat([[{"role": "user", "content": "Hi"}]], warm)
    rows: list[dict[str, Any]] = []
    sampling = SamplingParams(max_tokens=args.repetitive_max_tokens, temperature=0.0)
    for i, prompt in enumerate(REPETITIVE):
        r = compare(engines, [prompt], sampling, args.rounds)
        rows.append({"workload": f"repetitive[{i}]", "batch": 1, **r})
        print_row(rows[-1])
    batches = [int(b) for b in args.batches.split(",") if b]
    if batches and args.sharegpt.exists():
        tok = engines["plain"].tokenizer
        groups = {b: max(1, args.min_requests // b) for b in batches}
        pool = sharegpt_prompts(args.sharegpt, max(b * g for b, g in groups.items()), tok, 256)
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for b in batches:
            # NOTE: small batches run several groups of b requests, one after the other,
            # so that one prompt's answer does not decide the figure.
            parts = [
                compare(engines, pool[i * b : (i + 1) * b], sampling, args.rounds)
                for i in range(groups[b])
            ]
            rows.append({"workload": "sharegpt", "batch": b, **merge(parts)})
            print_row(rows[-1])
    elif batches:
        print(f"no ShareGPT file at {args.sharegpt}: skipped (benchmarks/common/sharegpt.py)")
    for llm in engines.values():
        llm.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    info = engines["plain"].info
    meta = {"dtype": info.dtype, "kv_cache_dtype": info.kv_cache_dtype}
    args.out.write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "engine": meta, "rows": rows},
            indent=1,
        )
    )
    print(f"wrote {args.out}")


def print_row(r: dict[str, Any]) -> None:
    p, s = r["plain"], r["ngram"]
    print(
        f"{r['workload']:<14} batch {r['batch']:>3}: TPOT {p['tpot_ms']:7.1f} -> "
        f"{s['tpot_ms']:7.1f} ms ({r['tpot_speedup']:.2f}x), tok/s {p['tok_per_s']:6.1f} -> "
        f"{s['tok_per_s']:6.1f} ({r['throughput_ratio']:.2f}x), acceptance "
        f"{s['acceptance_rate']:.2f}, mean accepted length {s['mean_accepted_length']:.2f}, "
        f"same outputs {r['same_outputs']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
