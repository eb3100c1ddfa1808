"""How a shard's rows are cut into inner chunks: pure arithmetic.

A Zarr shard holds a whole number of equal inner chunks, so the chunk's rows must divide the
shard's. featstore never changes a shard size the user asked for: it picks the inner chunk to
divide it (:func:`dividing_chunk`: the largest divisor at most the ~1 MiB target and at least a
quarter of it, or the whole shard when that is small), and a shard size with no such divisor is
refused naming sizes that work (:func:`nearest_multiples`), never rounded.
"""

from __future__ import annotations

#: A divisor smaller than ``target // MIN_SHARE`` makes chunks too small to be worth it (each
#: chunk is a separate compression frame, index entry and read step).
MIN_SHARE = 4
#: A shard of at most this many bytes may be one chunk (a reader then fetches it whole).
WHOLE_SHARD_BYTES = 4 * 2**20


def dividing_chunk(rows: int, target: int, row_bytes: int = 0) -> int | None:
    """Rows per inner chunk for a shard of ``rows``: ``rows`` itself when it is at most
    ``target``, else its largest divisor in ``[target // MIN_SHARE, target]``, else ``rows``
    when the whole shard is at most :data:`WHOLE_SHARD_BYTES`; None when none of these exists.

    >>> dividing_chunk(500, 512), dividing_chunk(4096, 512), dividing_chunk(1000, 128), dividing_chunk(4099, 256, 4096)
    (500, 512, 125, None)
    """
    if rows <= target:
        return rows
    for d in range(target, max(1, target // MIN_SHARE) - 1, -1):
        if rows % d == 0:
            return d
    return rows if rows * row_bytes <= WHOLE_SHARD_BYTES else None


def nearest_multiples(rows: int, step: int) -> tuple[int, int]:
    """The multiples of ``step`` just below (at least ``step``) and just above ``rows``.

    >>> nearest_multiples(4099, 256)
    (4096, 4352)
    """
    below = max(step, rows // step * step)
    above = -(-rows // step) * step
    if above == below:
        above += step
    return below, above
