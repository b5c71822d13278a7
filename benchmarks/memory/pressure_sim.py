"""Where the work goes under memory pressure, without a model: the pressure workload
(``benchmarks/memory/pressure.py``'s, same seed) through the real Scheduler with a fake worker.

Counts what does not depend on the machine's load: model steps, tokens computed (prefill +
decode + recompute), output tokens, preemptions, recomputed tokens, the mean running batch,
and the steps from arrival to first token (TTFT in steps), for each admission rule and
victim choice, through the engine loop that serves (:class:`EngineLoop`, overlapped as the
actor runs it by default) over an :class:`InlineWorker`; the closed loop's next requests are
added from the loop's ``on_step`` hook. A CPU decode step's time
grows with its batch, so steps alone do not give the wall time; ``tokens computed / output
token`` is the work overhead recomputation adds. Writes
``benchmarks/results/pressure_sim.json`` (or ``--out``).

Usage::

    .venv/bin/python benchmarks/memory/pressure_sim.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

from pressure import make_workload

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_loop import EngineLoop, InlineWorker
from pagedserve.scheduler.engine_messages import EngineRequest, SequenceOutput
from pagedserve.scheduler.outputs import RunnerOutput, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

RESULTS = Path(__file__).resolve().parents[1] / "results"


class FakeWorker:
    """Tracks each sequence's known tokens and samples token 1000 + known length."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for sid in so.finished_seq_ids:
            self.tokens.pop(sid, None)
        for new in so.new_seqs:
            self.tokens[new.seq_id] = len(new.token_ids)
        computed = {c.seq_id: c.num_computed_tokens for c in so.cached_seqs}
        computed.update({n.seq_id: n.num_computed_tokens for n in so.new_seqs})
        sampled = {}
        for sid, n in so.num_scheduled_tokens.items():
            if computed[sid] + n == self.tokens[sid]:
                sampled[sid] = 1000 + self.tokens[sid]
                self.tokens[sid] += 1
        return RunnerOutput(step_id=so.step_id, sampled_token_ids=sampled)


def simulate(reqs: list[dict[str, Any]], concurrency: int, args: Any, **cfg: Any) -> dict[str, Any]:
    """One run of the closed loop: ``concurrency`` requests in flight, the next one added
    when one ends (after each step, from the loop's ``on_step``), 30% cut by the client."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=64, max_model_len=args.max_model_len, **cfg),
        [WorkerSpec(0, args.num_blocks, args.block_size)],
    )
    w = FakeWorker()
    todo = list(reversed(reqs))
    live: dict[str, Any] = {}
    arrived: dict[str, int] = {}
    ttft: list[int] = []
    # TTFT in steps: the steps applied between a request's arrival and the step whose
    # answer carries its first token (0 would be a token in the first step after it).
    count = {"steps": 0, "applied": 0, "out_tokens": 0, "computed": 0}
    batch: list[int] = []

    def top_up() -> None:
        while len(live) < concurrency and todo:
            r = todo.pop()
            sp = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            s.add_request(EngineRequest(r["id"], r["prompt_ids"], sp))
            live[r["id"]] = r["cancel_after"]
            arrived[r["id"]] = count["applied"]

    def planned(_wid: int, so: SchedulerOutput, _inflight: SchedulerOutput | None) -> None:
        count["steps"] += 1
        count["computed"] += so.total_num_scheduled_tokens
        batch.append(len(so.num_scheduled_tokens))

    def sink(outs: list[SequenceOutput]) -> None:
        for o in outs:
            count["out_tokens"] += len(o.new_token_ids)
            if o.new_token_ids and o.num_output_tokens == 1:
                ttft.append(count["applied"] - arrived[o.request_id])
            if o.finish_reason is not None:
                live.pop(o.request_id, None)
            elif (cut := live.get(o.request_id)) is not None and o.num_output_tokens >= cut:
                s.abort_request(o.request_id)  # the client cancels
                live.pop(o.request_id)

    def stepped(*_: Any) -> None:
        count["applied"] += 1
        top_up()

    top_up()
    engine = EngineLoop(s, {0: InlineWorker(w.execute)}, sink, planned, stepped)
    asyncio.run(engine.run_until_idle())
    if todo or s.has_work(0):
        raise RuntimeError(f"stalled with {len(todo)} requests unsent")
    ttft.sort()
    out_tokens, computed = count["out_tokens"], count["computed"]
    return {
        "config": cfg,
        "concurrency": concurrency,
        "steps": count["steps"],
        "output_tokens": out_tokens,
        "tokens_computed": computed,
        "computed_per_output_token": computed / out_tokens,
        "preemptions": s.num_preemptions,
        "recomputed_tokens": s.num_recomputed_tokens,
        "mean_batch": statistics.fmean(batch),
        "ttft_steps_p50": ttft[len(ttft) // 2],
        "ttft_steps_p99": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "blocks_free_after": s.workers[0].kv.num_free_blocks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--out", default=str(RESULTS / "pressure_sim.json"))
    args = ap.parse_args()
    reqs = make_workload(args.num_requests, args.seed, 0.3)
    runs = [
        simulate(reqs, args.concurrency, args, admission="fits-now", preemption_victim="latest"),
        simulate(reqs, args.concurrency, args, admission="fits-now"),
        simulate(reqs, args.concurrency, args, admission_growth_ratio=0.5),
        simulate(reqs, args.concurrency, args),
        simulate(reqs, 5, args, admission="fits-now"),  # the no-preemption concurrency
    ]
    for r in runs:
        print(json.dumps(r))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
