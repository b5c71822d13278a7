"""In-process engine throughput (real Scheduler + Worker, no Ray, no gRPC).

The same workload as ``benchmarks/serving.py`` (its chat prompts, greedy, ``ignore_eos``,
``--max-tokens`` each), all requests submitted at once, so the two figures side by side
show what Ray + gRPC + detokenization cost.

Usage::

    .venv/bin/python benchmarks/engine_inprocess.py --num-requests 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import os
import time

from serving import PROMPTS
from transformers import AutoTokenizer

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.worker import Worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model, progress=False))
    tok = AutoTokenizer.from_pretrained(model_dir)
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=model_dir),
            cache=CacheConfig(num_blocks=1024),
            device="cpu",
            num_threads=args.threads,
        )
    )
    info = worker.get_info()
    sched = Scheduler(
        SchedulerConfig(max_model_len=info.max_model_len),
        [WorkerSpec(0, info.num_blocks, info.block_size)],
    )
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for i in range(args.num_requests):
        chat = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        sched.add_request(EngineRequest(f"r{i}", ids, sampling, info.eos_token_ids))
    start = time.perf_counter()
    tokens = steps = 0
    execute_s = 0.0
    while sched.has_work(0):
        so = sched.schedule(0).output
        ro = worker.execute_model(so)
        execute_s += ro.execute_time_s
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in sched.update(0, so, ro).outputs)
    wall = time.perf_counter() - start
    print(
        f"{args.num_requests} requests: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} "
        f"tok/s; worker execute {execute_s:.2f} s over {steps} steps"
    )


if __name__ == "__main__":
    main()
