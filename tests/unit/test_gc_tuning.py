"""The scheduler actor's collector settings (restored after each test)."""

from __future__ import annotations

import gc

import pytest

from pagedserve.scheduler.gc_tuning import GEN0_PER_SEAT, tune_gc


@pytest.fixture
def restore_gc():
    saved = gc.get_threshold()
    yield saved
    gc.unfreeze()
    gc.set_threshold(*saved)


def test_threshold_scales_with_the_seats_and_freezes(restore_gc):
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert tune_gc(64, 2) == (GEN0_PER_SEAT * 128, 10, 10) == (1024, 10, 10)
    assert gc.get_freeze_count() > 1000  # the imported modules' objects, at least
    assert gc.get_threshold() == (1024, 10, 10)


def test_never_below_the_current_threshold(restore_gc):
    gc.set_threshold(5000, 7, 9)
    assert tune_gc(1, 1) == (5000, 7, 9)  # 8 seats' worth is below it


@pytest.mark.parametrize(("seqs", "workers"), [(0, 1), (4, 0)])
def test_bad_counts_raise(restore_gc, seqs, workers):
    gc.set_threshold(700, 10, 10)
    with pytest.raises(ValueError, match=">= 1"):
        tune_gc(seqs, workers)
    assert gc.get_threshold() == (700, 10, 10)  # nothing changed
