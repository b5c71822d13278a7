"""Host cost of one worker step's input preparation (``prepare_inputs``), in milliseconds.

256 decoding sequences (one new token each) at several context lengths, block size 16:
the flattening of a step into input_ids / positions / slot_mapping / block_tables that the
worker does before every model call. Prints one line per context length; writes no file
(the figure is quoted in ``benchmarks/RESULTS.md``). Usage::

    .venv/bin/python benchmarks/engine/input_prep.py
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.input_batch import SequenceState, prepare_inputs


def main(num_seqs: int = 256, block_size: int = 16, repeats: int = 10) -> None:
    sampling = SamplingParams()
    for ctx in (1024, 8192, 32768):
        nb = ctx // block_size
        states = [
            SequenceState(f"r{i}", list(range(ctx)), ctx - 1, list(range(i, i + nb)), ctx - 1,
                         sampling, 0, 0)
            for i in range(num_seqs)
        ]  # fmt: skip
        batch = [(s, 1) for s in states]
        prepare_inputs(batch, block_size, 10**6, torch.device("cpu"))
        start = time.perf_counter()
        for _ in range(repeats):
            prepare_inputs(batch, block_size, 10**6, torch.device("cpu"))
        ms = (time.perf_counter() - start) / repeats * 1000
        print(f"{num_seqs} seqs x {ctx:>6} tokens of context: {ms:.2f} ms per step")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    main(args.num_seqs, repeats=args.repeats)
