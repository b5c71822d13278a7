"""Garbage-collector settings for the scheduler actor's process (and its benchmark).

Each step creates a few short-lived objects per scheduled sequence (its
``CachedSequenceData``, its ``SequenceOutput`` and the token tuple in it) that live until
the step's answer is applied. With CPython's default first-generation threshold (700 net
container allocations), a batch of more than a few hundred sequences starts a collection in
the middle of nearly every step; it finds these objects alive and moves them to an older
generation, where they die soon after. Those promotions then start full collections, whose
cost grows with the whole heap (every sequence's token lists, every block): at 1024 running
sequences in ``benchmarks/engine/scheduler.py`` a full collection took ~12 ms every ~50 steps, the
step's p99. Two settings remove that tail:

* a first-generation threshold above what a few steps allocate (``GEN0_PER_SEAT`` objects
  per batch seat of every worker, at least CPython's default), so those objects are freed
  by reference counting before any collection sees them;
* :func:`gc.freeze` once at start-up: the objects of the imported libraries (Ray, gRPC,
  ...) move to a permanent generation that full collections no longer walk.

Reference counting still frees everything at once; only reference cycles wait longer for
a collection (the scheduler's state holds none on its hot path).
"""

from __future__ import annotations

import gc

GEN0_PER_SEAT = 8
"""First-generation threshold per batch seat: ~3 objects per sequence per step, for the
step being planned and the one being applied, with room to spare."""


def tune_gc(max_num_seqs: int, num_workers: int) -> tuple[int, int, int]:
    """Apply this module's settings to the calling process (see the module docstring).

    Args:
        max_num_seqs: batch seats of one worker (``SchedulerConfig.max_num_seqs``).
        num_workers: workers the process schedules.

    Returns:
        The thresholds now in force (:func:`gc.get_threshold`).

    Raises:
        ValueError: a count below 1.
    """
    if max_num_seqs < 1 or num_workers < 1:
        raise ValueError(
            f"max_num_seqs and num_workers must be >= 1, got {max_num_seqs}, {num_workers}"
        )
    gen0, gen1, gen2 = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(gen0, GEN0_PER_SEAT * max_num_seqs * num_workers), gen1, gen2)
    return gc.get_threshold()
