"""Block-manager microbenchmarks (pure Python, CPU only; no model, no torch).

Reports:

* ``allocate_free``: ``allocate_slots`` of a fresh sequence (``--prompt-len`` tokens) followed
  by ``free``, in pairs per second.
* ``prefix_hit_cycle``: the admission path with a prefix-cache hit: ``get_computed_blocks`` +
  ``allocate_slots`` + ``cache_blocks`` + ``free`` of a prompt whose blocks are cached, in
  cycles per second.
* ``decode_step``: a scheduler-sized decode step: ``--num-seqs`` running sequences each append
  one token (``allocate_slots`` + ``cache_blocks``), in microseconds per step (whole batch)
  and per sequence.

Writes ``benchmarks/results/block_manager.json`` (or ``--out``).

Usage::

    .venv/bin/python benchmarks/memory/block_manager.py --num-seqs 256 --steps 512
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from pagedserve.scheduler.kv_cache_manager import KVCacheManager


def bench_allocate_free(block_size: int, prompt_len: int, iters: int) -> float:
    """Pairs (allocate_slots + free) per second."""
    m = KVCacheManager(4 * (prompt_len // block_size + 1), block_size, enable_prefix_caching=False)
    t0 = time.perf_counter()
    for i in range(iters):
        sid = f"s{i}"
        m.allocate_slots(sid, prompt_len)
        m.free(sid)
    dt = time.perf_counter() - t0
    m.check_integrity()
    return iters / dt


def bench_prefix_hit_cycle(block_size: int, prompt_len: int, iters: int) -> float:
    """Cycles (lookup hit + allocate + cache_blocks + free) per second."""
    m = KVCacheManager(4 * (prompt_len // block_size + 1), block_size)
    prompt = list(range(1000, 1000 + prompt_len))
    m.allocate_slots("warm", prompt_len)
    m.cache_blocks("warm", prompt, prompt_len)
    m.free("warm")
    t0 = time.perf_counter()
    for i in range(iters):
        sid = f"s{i}"
        hit, n = m.get_computed_blocks(prompt)
        m.allocate_slots(sid, prompt_len, hit)
        m.cache_blocks(sid, prompt, prompt_len)
        m.free(sid)
    dt = time.perf_counter() - t0
    assert n == (prompt_len - 1) // block_size * block_size
    m.check_integrity()
    return iters / dt


def bench_decode_step(
    block_size: int, prompt_len: int, num_seqs: int, steps: int
) -> tuple[float, float]:
    """(mean, p99) microseconds per step of ``num_seqs`` sequences appending one token each."""
    blocks_per_seq = -(-(prompt_len + steps) // block_size)
    m = KVCacheManager(num_seqs * blocks_per_seq + 1, block_size)
    tokens: dict[str, list[int]] = {}
    for s in range(num_seqs):
        sid = f"s{s}"
        toks = [s * 7919 + j for j in range(prompt_len)]
        hit, n = m.get_computed_blocks(toks)
        m.allocate_slots(sid, prompt_len, hit)
        m.cache_blocks(sid, toks, prompt_len)
        tokens[sid] = toks
    items = list(tokens.items())
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for sid, toks in items:
            toks.append(step)
            n = len(toks)
            m.allocate_slots(sid, n)
            m.cache_blocks(sid, toks, n)
        times.append(time.perf_counter() - t0)
    m.check_integrity()
    times.sort()
    mean_us = sum(times) / len(times) * 1e6
    p99_us = times[min(len(times) - 1, int(0.99 * len(times)))] * 1e6
    return mean_us, p99_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    ap.add_argument("--iters", type=int, default=20000, help="allocate/free pairs")
    ap.add_argument("--num-seqs", type=int, default=256, help="running sequences per step")
    ap.add_argument("--steps", type=int, default=512, help="decode steps")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "results" / "block_manager.json",
    )
    args = ap.parse_args()

    alloc_free = bench_allocate_free(args.block_size, args.prompt_len, args.iters)
    hit_cycle = bench_prefix_hit_cycle(args.block_size, args.prompt_len, args.iters // 4)
    step_us, step_p99_us = bench_decode_step(
        args.block_size, args.prompt_len, args.num_seqs, args.steps
    )
    result = {
        "benchmark": "block_manager",
        "config": vars(args) | {"out": str(args.out)},
        "python": platform.python_version(),
        "machine": platform.machine(),
        "allocate_free_pairs_per_s": round(alloc_free, 1),
        "prefix_hit_cycles_per_s": round(hit_cycle, 1),
        "decode_step_us_mean": round(step_us, 2),
        "decode_step_us_p99": round(step_p99_us, 2),
        "decode_step_us_per_seq": round(step_us / args.num_seqs, 3),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(
        f"allocate+free ({args.prompt_len} tokens, {args.prompt_len // args.block_size} blocks): "
        f"{alloc_free:,.0f} pairs/s"
    )
    print(f"prefix-hit admission cycle: {hit_cycle:,.0f} cycles/s")
    print(
        f"decode step, {args.num_seqs} seqs x 1 token: {step_us:,.1f} us mean, "
        f"{step_p99_us:,.1f} us p99 ({step_us / args.num_seqs:.2f} us/seq)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
