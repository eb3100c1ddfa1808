"""Model A's inputs read a batch ahead in the consuming process, as ``compute``'s fetch thread
reads them in a shard task: the dataset's ``__getitem__`` of the next batch runs on a thread of
its own while A's forward runs (torch releases the GIL in its kernels), instead of before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from featstore.compute import Inputs, read_inputs


class InputPrefetch:
    """The batches an epoch will read, in order (:meth:`plan`), one read ahead at a time.

    :meth:`get` returns the items of a batch (with their input digests when ``digests``: what
    the version stores beside A's outputs): the one read ahead when it is the next planned,
    else read now (a planned batch the reader skipped, because the fill had stored its shard
    meanwhile, is passed over). A dataset error is raised by :meth:`get`, naming the index, as
    a plain read raises it.

    >>> inputs = InputPrefetch(digests=True)
    >>> inputs.plan(train_set, [(0, 256), (256, 512)])   # doctest: +SKIP
    >>> items = inputs.get(train_set, 0, 256)              # doctest: +SKIP
    """

    def __init__(self, digests: bool) -> None:
        self.digests = digests
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="featstore-inputs")  # its thread starts on the first read
        self._dataset: Any = None
        self._todo: deque[tuple[int, int]] = deque()
        self._ahead: tuple[tuple[int, int], Future[Inputs]] | None = None

    def plan(self, dataset: Any, ranges: Iterable[tuple[int, int]]) -> None:
        """The batches ``[b0, b1)`` of ``dataset`` to read next, in order (replacing any plan)."""
        self._dataset, self._todo = dataset, deque(ranges)
        self._ahead = None  # a read still running finishes on its own; nobody takes it
        self._start_next()

    def get(self, dataset: Any, b0: int, b1: int) -> Inputs:
        """The items of ``dataset[b0:b1]`` (as A sees them) and their input digests."""
        # the read ahead is of this batch only if of the same dataset object (not merely an equal one)
        while self._ahead is not None and not (dataset is self._dataset and self._ahead[0] == (b0, b1)):
            self._ahead = None  # passed over
            self._start_next()
        if self._ahead is None:
            return read_inputs(dataset, b0, b1, self.digests)
        fut = self._ahead[1]
        self._ahead = None
        self._start_next()
        return fut.result()

    def _start_next(self) -> None:
        if self._ahead is None and self._todo:
            b0, b1 = self._todo.popleft()
            self._ahead = ((b0, b1), self._pool.submit(read_inputs, self._dataset, b0, b1, self.digests))
