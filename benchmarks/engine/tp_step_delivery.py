"""How a tensor-parallel step reaches its T ranks: rank 0's broadcast over the group (what
pagedserve does, :mod:`pagedserve.cluster.tp_group`) against a Ray call to every rank.

T Ray actors (no model) join one :class:`~pagedserve.worker.parallel.TensorParallelGroup`
(gloo on 127.0.0.1). For each payload, a real :class:`SchedulerOutput` (decode steps of B
cached sequences with one new token each, and a prefill step of new sequences), the driver
delivers it ``--steps`` times in each mode, the modes alternating in rounds:

- ``broadcast``: one Ray call to rank 0, which broadcasts ``("execute", so)`` with
  ``broadcast_object`` (pickle + gloo) to the other ranks, waiting in a follow loop;
- ``ray_calls``: one Ray call per rank carrying ``so`` (Ray pickles it once per call).

Either way every rank then joins one 8-byte all-reduce (the sharded forward's first
collective would hold the ranks together the same way) and the driver awaits rank 0's
answer: the time is from the driver's send until every rank holds the step and rank 0
answered. Reports the median and p90 in ms per payload, T and mode.

Usage::

    .venv/bin/python benchmarks/engine/tp_step_delivery.py --sizes 2 3 --steps 200

Writes ``benchmarks/results/tp_step_delivery.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from pagedserve.scheduler.outputs import CachedSequenceData, NewSequenceData, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results"


def decode_step(batch: int, step_id: int = 0) -> SchedulerOutput:
    """A decode step of ``batch`` cached sequences at ~512 tokens, one new token each."""
    cached = [
        CachedSequenceData(f"req-{i}", 32, [1000 + i], 512, [random.randrange(32000)])
        for i in range(batch)
    ]
    return SchedulerOutput(
        step_id, cached_seqs=cached, num_scheduled_tokens={c.seq_id: 1 for c in cached}
    )


def prefill_step(num_seqs: int, prompt_len: int, block_size: int = 16) -> SchedulerOutput:
    """A step admitting ``num_seqs`` new sequences of ``prompt_len`` tokens, all scheduled."""
    new = [
        NewSequenceData(
            f"new-{i}",
            [random.randrange(32000) for _ in range(prompt_len)],
            prompt_len,
            list(range(i * 64, i * 64 + -(-prompt_len // block_size))),
            0,
            SamplingParams(temperature=0.0, max_tokens=64),
        )
        for i in range(num_seqs)
    ]
    return SchedulerOutput(
        0, new_seqs=new, num_scheduled_tokens={s.seq_id: prompt_len for s in new}
    )


class Rank:
    """One rank: joins the group, then receives steps in either mode."""

    def __init__(self, rank: int, size: int, init_method: str) -> None:
        import torch

        from pagedserve.worker.config import ParallelConfig
        from pagedserve.worker.parallel import TensorParallelGroup

        torch.set_num_threads(1)
        self.group = TensorParallelGroup.join(
            ParallelConfig(size, rank, init_method, timeout_s=120), torch.device("cpu")
        )
        self.torch = torch

    def ready(self) -> int:
        return self.group.rank

    def _sync(self) -> None:
        self.group.all_reduce(self.torch.zeros(1, dtype=self.torch.int64))

    def deliver(self, so: SchedulerOutput) -> int:
        """Rank 0, ``broadcast`` mode: send ``so`` over the group."""
        self.group.broadcast_object(("execute", so))
        self._sync()
        return so.step_id

    def follow(self, n: int) -> int:
        """The other ranks, ``broadcast`` mode: receive ``n`` steps."""
        for _ in range(n):
            self.group.broadcast_object(None)  # unpickled: what a follower then runs
            self._sync()
        return n

    def receive(self, so: SchedulerOutput) -> int:
        """Every rank, ``ray_calls`` mode: the step arrived by this call."""
        self._sync()
        return so.step_id

    def leave(self) -> None:
        self.group.leave()


def measure(ranks: list[Any], so: SchedulerOutput, mode: str, steps: int) -> list[float]:
    """Milliseconds per delivery of ``so`` to every rank, ``steps`` times."""
    import ray

    times = []
    follows = [r.follow.remote(steps) for r in ranks[1:]] if mode == "broadcast" else []
    for _ in range(steps):
        t0 = time.perf_counter()
        if mode == "broadcast":
            ray.get(ranks[0].deliver.remote(so))
        else:
            refs = [r.receive.remote(so) for r in ranks]
            ray.get(refs[0])  # answered after every rank joined the all-reduce
        times.append((time.perf_counter() - t0) * 1e3)
        if mode == "ray_calls":
            ray.get(refs[1:])  # outside the timing: a real step ignores these answers
    ray.get(follows)
    return times


def run_size(size: int, payloads: dict[str, SchedulerOutput], steps: int, rounds: int) -> dict:
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    actor = ray.remote(num_cpus=0, max_concurrency=1)(Rank)
    ranks = [actor.remote(r, size, init) for r in range(size)]
    ray.get([r.ready.remote() for r in ranks])
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for name, so in payloads.items():
            samples: dict[str, list[float]] = {"broadcast": [], "ray_calls": []}
            measure(ranks, so, "broadcast", 5)  # warm-up
            measure(ranks, so, "ray_calls", 5)
            for r in range(rounds):
                order = ["broadcast", "ray_calls"] if r % 2 == 0 else ["ray_calls", "broadcast"]
                for mode in order:
                    samples[mode] += measure(ranks, so, mode, steps // rounds)
            out[name] = samples
    finally:
        ray.get([r.leave.remote() for r in ranks])
        for r in ranks:
            ray.kill(r)
    return out


def summary(ms: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(ms, n=10)
    return {"median_ms": round(statistics.median(ms), 3), "p90_ms": round(qs[-1], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 3])
    p.add_argument("--steps", type=int, default=200, help="deliveries per payload and mode")
    p.add_argument("--rounds", type=int, default=4, help="alternations of the two modes")
    p.add_argument("--out", type=Path, default=RESULTS / "tp_step_delivery.json")
    args = p.parse_args()
    import pickle

    import ray

    random.seed(0)
    payloads = {
        "decode B=1": decode_step(1),
        "decode B=32": decode_step(32),
        "decode B=256": decode_step(256),
        "prefill 8 x 512 tokens": prefill_step(8, 512),
    }
    sizes_bytes = {k: len(pickle.dumps(v)) for k, v in payloads.items()}
    from pagedserve.cluster.launcher import RAY_ENV

    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loadavg": os.getloadavg(),
        "steps": args.steps,
        "pickled_bytes": sizes_bytes,
        "results": {},
    }
    try:
        for size in args.sizes:
            raw = run_size(size, payloads, args.steps, args.rounds)
            report["results"][f"T={size}"] = {
                name: {mode: summary(ms) for mode, ms in modes.items()}
                for name, modes in raw.items()
            }
    finally:
        ray.shutdown()
    report["loadavg_end"] = os.getloadavg()
    print(f"{'payload':26} {'bytes':>8} {'T':>2} {'broadcast p50/p90 ms':>22} "
          f"{'ray calls p50/p90 ms':>22}")  # fmt: skip
    for t, rows in report["results"].items():
        for name, modes in rows.items():
            b, r = modes["broadcast"], modes["ray_calls"]
            print(f"{name:26} {sizes_bytes[name]:>8} {t[2:]:>2} "
                  f"{b['median_ms']:>10.2f} / {b['p90_ms']:<9.2f} "
                  f"{r['median_ms']:>10.2f} / {r['p90_ms']:<9.2f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
