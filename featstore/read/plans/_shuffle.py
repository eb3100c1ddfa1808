"""The epoch's shard permutation, evaluated per position.

A consumer of a billion-sample version needs the shards of its own span only: a few of ~74,000
for one of 8,192 consumers. A permutation drawn whole (``rng.permutation(n)``) costs every
consumer O(shards) time and memory each epoch; this one is a keyed bijection of ``range(n)``
computed for just the positions asked for, so planning costs the same at 500 and at 500,000
shards.

It is a balanced Feistel network on the smallest even number of bits that covers ``n``, with
cycle walking (a position that maps outside ``range(n)`` is mapped again until it lands inside:
a bijection of ``range(n)``, since the network is a bijection of its whole domain, which is at
most 4n, so a walk takes ~2 steps on average). The round keys come from ``(seed, epoch)``.
"""

from __future__ import annotations

import functools

import numpy as np

#: Feistel rounds: 4 already give a pseudo-random permutation (Luby-Rackoff); 6 mix small domains.
ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class ShardPermutation:
    """A seeded permutation of ``range(n)``: position -> shard and shard -> position.

    >>> p = ShardPermutation(10, seed=0, epoch=1)
    >>> sorted(p.shards(np.arange(10)).tolist()) == list(range(10))
    True
    >>> int(p.positions(p.shards(np.array([3])))[0])
    3
    """

    def __init__(self, n: int, seed: int, epoch: int, shuffle: bool = True) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = n
        self.shuffle = shuffle and n > 1
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        # an order that is not shuffled needs no keys (a mixture's small stream asks for one per pass)
        self.keys = np.random.default_rng([seed, epoch, 0]).integers(0, 2**63, size=ROUNDS, dtype=np.uint64) \
            if self.shuffle else np.zeros(0, dtype=np.uint64)

    def _f(self, r: np.ndarray, key: np.uint64) -> np.ndarray:
        x = (r ^ key) * _M1  # splitmix64's finaliser: every input bit reaches every output bit
        x ^= x >> np.uint64(31)
        x *= _M2
        x ^= x >> np.uint64(29)
        return x & self.mask

    def _walk(self, given: np.ndarray, keys: np.ndarray, forward: bool) -> np.ndarray:
        if not self.shuffle:
            return np.array(given, dtype=np.int64)
        x = np.array(given, dtype=np.uint64)
        todo = np.ones(len(x), dtype=bool)
        while todo.any():
            left, right = x[todo] >> self.half, x[todo] & self.mask
            for key in keys:
                if forward:
                    left, right = right, left ^ self._f(right, key)
                else:
                    left, right = right ^ self._f(left, key), left
            x[todo] = (left << self.half) | right
            todo[todo] = x[todo] >= np.uint64(self.n)
        return x.astype(np.int64)

    def shards(self, positions: np.ndarray) -> np.ndarray:
        """The shard at each of ``positions`` (each in ``range(n)``) of the epoch's order."""
        return self._walk(positions, self.keys, True)

    @functools.cached_property
    def last(self) -> int:
        """Where the last shard stands in the order (a uniform layout's one short shard: every
        span of a plan locates its rows by it)."""
        return int(self.positions(np.array([self.n - 1]))[0])

    def positions(self, shards: np.ndarray) -> np.ndarray:
        """Where each of ``shards`` stands in the epoch's order (the inverse of :meth:`shards`)."""
        return self._walk(shards, self.keys[::-1], False)
