"""A's inputs read a batch ahead (featstore.online._inputs): the items are the dataset's, in
the order asked, whatever was planned; a dataset's error reaches the caller naming the index."""

from __future__ import annotations

import threading

import pytest

from featstore import ComputeFailed
from featstore.online._inputs import InputPrefetch
from featstore.versions import item_digests


class Recording:
    """A map-style dataset that records which thread read each index."""

    def __init__(self, n: int, bad: int | None = None) -> None:
        self.n, self.bad, self.threads = n, bad, {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i == self.bad:
            raise ValueError("unreadable image")
        self.threads[i] = threading.current_thread().name
        return {"input": i}


def items(b0, b1):
    return [{"input": i} for i in range(b0, b1)]


def test_planned_batches_are_read_ahead_on_their_own_thread_in_order():
    data, inputs = Recording(40), InputPrefetch(digests=True)
    ranges = [(0, 10), (10, 20), (20, 30), (30, 40)]
    inputs.plan(data, ranges)
    got = [inputs.get(data, *r) for r in ranges]
    assert [g.items for g in got] == [items(*r) for r in ranges]
    # each item's input digest, taken on the read-ahead thread too
    assert all((g.digests == item_digests(items(*r))).all() for g, r in zip(got, ranges, strict=True))
    assert all(name.startswith("featstore-inputs") for name in data.threads.values())


def test_skipped_unplanned_and_replanned_batches_read_what_is_asked():
    data, inputs = Recording(40), InputPrefetch(digests=False)
    inputs.plan(data, [(0, 10), (10, 20), (20, 30), (30, 40)])
    assert inputs.get(data, 20, 30).items == items(20, 30)  # two planned batches passed over
    assert inputs.get(data, 30, 40).items == items(30, 40)
    assert inputs.get(data, 5, 7).items == items(5, 7)  # nothing planned any more: read now
    assert data.threads[5] == threading.current_thread().name
    other = Recording(40)
    inputs.plan(data, [(0, 10)])
    assert inputs.get(other, 0, 10).items == items(0, 10)  # another dataset than planned: read from it
    assert 0 in other.threads


def test_a_dataset_error_read_ahead_is_raised_by_get_naming_the_sample():
    data, inputs = Recording(40, bad=13), InputPrefetch(digests=False)
    inputs.plan(data, [(0, 10), (10, 20)])
    assert inputs.get(data, 0, 10).items == items(0, 10)
    with pytest.raises(ComputeFailed, match=r"dataset\[13\] raised ValueError: unreadable image; fix the dataset"):
        inputs.get(data, 10, 20)
