"""In-process engine throughput (real Scheduler + Worker, no Ray, no gRPC).

The same 16-request workload as ``benchmarks/serving.py --concurrency 16``, so the two
figures side by side show what Ray + gRPC + detokenization cost.

Usage::

    .venv/bin/python benchmarks/engine_inprocess.py
"""

import time

from transformers import AutoTokenizer

from pagedserve.cluster.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pagedserve.cluster.model_store import resolve_model
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
from pagedserve.worker.worker import Worker

d = str(resolve_model("default", progress=False))
tok = AutoTokenizer.from_pretrained(d)
w = Worker(
    WorkerConfig(
        model=ModelConfig(model=d), cache=CacheConfig(num_blocks=1024), device="cpu", num_threads=2
    )
)
info = w.get_info()
s = Scheduler(
    SchedulerConfig(), [WorkerSpec(0, info.num_blocks, info.block_size)], info.max_model_len
)
prompts = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What are the main causes of climate change?",
    "Describe how a bicycle works.",
]
for i in range(16):
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompts[i % 4]}], tokenize=False, add_generation_prompt=True
    )
    s.add_request(
        f"r{i}",
        tok(text, add_special_tokens=False)["input_ids"],
        SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
        info.eos_token_ids,
    )
t0 = time.perf_counter()
n = 0
ex = 0
steps = 0
while s.has_work(0):
    so = s.schedule(0)
    ro = w.execute_model(so)
    ex += ro.execute_time_s
    steps += 1
    n += sum(len(o.new_token_ids) for o in s.update(0, so, ro))
wall = time.perf_counter() - t0
print(
    f"{n} tokens in {wall:.2f}s = {n / wall:.1f} tok/s; worker execute {ex:.2f}s over {steps} steps"
)
