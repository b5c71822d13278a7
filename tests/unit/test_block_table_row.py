"""The worker's BlockTableRow: appends, copy-on-write replacement, growth, views."""

from __future__ import annotations

import pytest

from pagedserve.worker.input_batch import BlockTableRow


def test_extend_assign_and_growth():
    row = BlockTableRow([7, 3])
    assert len(row) == 2 and row.tolist() == [7, 3]
    row.extend(list(range(100, 140)))  # grows past the initial capacity of 16
    assert len(row) == 42 and row.tolist()[:4] == [7, 3, 100, 101] and row.tolist()[-1] == 139
    row.assign(41, [5, 6])  # CoW replaced the last block, then one more appended
    assert row.tolist()[-3:] == [138, 5, 6] and len(row) == 43
    assert row.view(3).tolist() == [7, 3, 100]
    assert row.view(1000).tolist() == row.tolist()
    assert row == row.tolist()


def test_assign_past_the_end_is_an_error():
    row = BlockTableRow([1, 2])
    with pytest.raises(ValueError, match="outside"):
        row.assign(3, [4])
