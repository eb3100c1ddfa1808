"""The reader's fast path: :func:`decode_shard_rows` reads rows straight out of one shard object's
bytes, without zarr's event loop; :func:`shard_format` says whether an array has exactly the
layout it understands (else the reader goes through zarr); every chunk's crc32c is checked.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from featstore.errors import CorruptChunk
from featstore._lazy import np  # imported on first use: the quick commands never need it


if TYPE_CHECKING:  # zarr only inside shard_format: decoding a shard needs none of it
    import zarr
    from numcodecs import Zstd

#: A shard object's bytes as the reader holds them: read, or mapped from a file in place.
ShardBytes = bytes | bytearray | memoryview | mmap.mmap



# -- the reader's fast path: whole shard objects decoded without zarr -------------------------
_EMPTY = 2**64 - 1  # an empty inner chunk's offset and size in the shard index


@dataclass(frozen=True)
class ShardFormat:
    """What the reader needs to decode one shard object of an array written by featstore.

    Only the exact codec chain :func:`zarr_codecs` writes inside a ``sharding_indexed`` codec
    (little-endian bytes, zstd or nothing, crc32c; index little-endian + crc32c at the end) qualifies; any
    other array is read through zarr.
    """

    chunk_rows: int
    row_shape: tuple[int, ...]
    dtype: str
    chunks_per_shard: int
    compressed: bool = True  # zstd before the crc32c; False: the chunk bytes are the values

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's values."""
        return int(np.prod(self.row_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def stored_stride(self) -> int:
        """Bytes from one uncompressed chunk to the next in a stored shard: its values, then its
        crc32c."""
        return self.chunk_rows * self.row_bytes + 4


def shard_format(array: zarr.Array[Any]) -> ShardFormat | None:
    """The :class:`ShardFormat` of ``array``, or None when it is not featstore's exact layout."""
    try:
        from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec
        from zarr.codecs.sharding import ShardingCodecIndexLocation
        from zarr.core.chunk_grids import RegularChunkGrid
        from zarr.core.metadata import ArrayV3Metadata

        meta = array.metadata
        if not isinstance(meta, ArrayV3Metadata) or not isinstance(meta.chunk_grid, RegularChunkGrid):
            return None
        codecs = meta.codecs
        if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
            return None
        sc = codecs[0]
        inner, index = sc.codecs, sc.index_codecs
        little = "little"
        compressed = len(inner) == 3
        ok = (len(inner) in (2, 3) and isinstance(inner[0], BytesCodec)
              and str(getattr(inner[0].endian, "value", "")) == little
              and (not compressed or isinstance(inner[1], ZstdCodec)) and isinstance(inner[-1], Crc32cCodec)
              and len(index) == 2 and isinstance(index[0], BytesCodec)
              and str(getattr(index[0].endian, "value", "")) == little and isinstance(index[1], Crc32cCodec)
              and sc.index_location == ShardingCodecIndexLocation.end
              and tuple(sc.chunk_shape[1:]) == tuple(array.shape[1:]))
        if not ok:
            return None
        dtype = np.dtype(array.dtype)
        if dtype.byteorder == ">":
            return None
        shard_rows = int(meta.chunk_grid.chunk_shape[0])
        if shard_rows % int(sc.chunk_shape[0]):
            return None
        return ShardFormat(int(sc.chunk_shape[0]), tuple(int(s) for s in array.shape[1:]), dtype.str,
                           shard_rows // int(sc.chunk_shape[0]), compressed)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class ChunkRef:
    """Where a shard object lives, for the error that names it: ``name@id``, field, object key."""

    version: str = "?"
    array: str = "?"
    chunk: str = "?"


def _damaged(ref: ChunkRef, what: str) -> CorruptChunk:
    return CorruptChunk.damaged(ref.version, ref.array, ref.chunk, f"failed to decode: {what}")


def _check_crc(data: memoryview, what: str, ref: ChunkRef) -> memoryview:
    import crc32c

    if len(data) < 4:
        raise _damaged(ref, f"{what} is truncated ({len(data)} bytes)")
    body, tail = data[:-4], data[-4:]
    if crc32c.crc32c(body) != int.from_bytes(tail, "little"):
        raise _damaged(ref, f"{what} fails its crc32c checksum")
    return body


def shard_index_bytes(fmt: ShardFormat) -> int:
    """Bytes of a shard object's index (at its end): 16 per inner chunk plus a crc32c."""
    return 16 * fmt.chunks_per_shard + 4


def shard_index(tail: bytes | memoryview, fmt: ShardFormat, ref: ChunkRef = ChunkRef()) -> np.ndarray:
    """The (offset, size) of each inner chunk, from the last bytes of a shard object (checked)."""
    view = memoryview(tail)
    index_bytes = shard_index_bytes(fmt)
    if len(view) < index_bytes:
        raise _damaged(ref, f"shard object is truncated ({len(view)} bytes, index needs {index_bytes})")
    return np.frombuffer(_check_crc(view[-index_bytes:], "shard index", ref), dtype="<u8").reshape(
        fmt.chunks_per_shard, 2)


def shard_intact(data: bytes | memoryview, fmt: ShardFormat) -> bool:
    """Whether a whole shard object passes every check the decoder makes short of decoding:
    its index's crc32c, and each stored chunk inside the object with its crc32c (what a disk
    cache checks before it keeps an object). Chunks the index marks absent (the last shard's,
    past the array's end) are the decoder's to judge: it refuses any that holds rows."""
    import crc32c

    view = memoryview(data)
    try:
        index = shard_index(view, fmt)
    except CorruptChunk:
        return False
    end = len(view) - shard_index_bytes(fmt)
    for off, size in index.tolist():
        if off == _EMPTY:
            continue
        if size < 4 or off + size > end:
            return False
        chunk = view[off:off + size]
        if crc32c.crc32c(chunk[:-4]) != int.from_bytes(chunk[-4:], "little"):
            return False
    return True


def decode_shard_rows(data: ShardBytes, fmt: ShardFormat, lo: int, hi: int,
                      out: np.ndarray | None = None, ref: ChunkRef = ChunkRef(),
                      index: np.ndarray | None = None, base: int = 0) -> np.ndarray:
    """Rows ``[lo, hi)`` (shard-local) of one shard object, written into ``out`` when given
    (``hi - lo`` rows of the stored dtype: saves the reader a copy) and returned.

    Decodes only the inner chunks that cover the rows, checks every crc32c, and raises
    :class:`CorruptChunk` naming ``ref`` on any damage (never returns fill values for a missing
    chunk). ``data`` is the whole object, or, with ``index`` (from :func:`shard_index`), only its
    bytes from offset ``base`` on that cover the rows (a ranged read of a big shard).
    """
    import numcodecs

    view = memoryview(data)
    if index is None:
        index = shard_index(view, fmt, ref)
        end = len(view) - shard_index_bytes(fmt)
    else:
        end = base + len(view)
    dtype = np.dtype(fmt.dtype)
    row_items = int(np.prod(fmt.row_shape, dtype=np.int64)) if fmt.row_shape else 1
    zstd = numcodecs.Zstd()
    c0, c1 = lo // fmt.chunk_rows, -(-hi // fmt.chunk_rows)
    if out is None:
        out = np.empty((hi - lo, *fmt.row_shape), dtype=dtype.newbyteorder("="))
    elif out.shape != (hi - lo, *fmt.row_shape):
        raise ValueError(f"out has shape {out.shape}, expected {(hi - lo, *fmt.row_shape)}")
    for c in range(c0, c1):
        off, size = index[c]
        if int(off) == _EMPTY or int(off) < base or int(off) + int(size) > end:
            raise _damaged(ref, f"chunk {c} of the shard is missing or out of bounds")
        body = _check_crc(view[int(off) - base:int(off) - base + int(size)], f"chunk {c}", ref)
        r0 = max(lo - c * fmt.chunk_rows, 0)
        r1 = min(hi - c * fmt.chunk_rows, fmt.chunk_rows)
        o0 = c * fmt.chunk_rows + r0 - lo
        if fmt.compressed and r1 - r0 == fmt.chunk_rows and out[o0:o0 + r1 - r0].flags.c_contiguous:
            _decode_into(zstd, body, out[o0:o0 + r1 - r0], c, ref)  # no temporary: the rows it fills
            continue
        if fmt.compressed:
            try:
                raw = zstd.decode(body)
            except Exception as exc:  # noqa: BLE001 - numcodecs raises plain errors on bad frames
                raise _damaged(ref, f"chunk {c} does not decompress: {exc}") from exc
        else:
            raw = body  # the values themselves: copied once, straight into ``out``
        if len(raw) % dtype.itemsize:
            raise _damaged(ref, f"chunk {c} holds {len(raw)} bytes, not a whole number of values")
        arr = np.frombuffer(raw, dtype=dtype)
        if arr.size != fmt.chunk_rows * row_items:
            raise _damaged(ref, f"chunk {c} holds {arr.size} values, expected {fmt.chunk_rows * row_items}")
        out[o0:o0 + r1 - r0] = arr.reshape(fmt.chunk_rows, *fmt.row_shape)[r0:r1]
    return out


def _decode_into(zstd: Zstd, body: memoryview, dest: np.ndarray, c: int, ref: ChunkRef) -> None:
    """Decompress one whole chunk straight into ``dest`` (exactly its size, or it is damaged)."""
    if _zstd_content_size(body) != dest.nbytes:
        raise _damaged(ref, f"chunk {c} does not hold {dest.nbytes} bytes of values")
    try:
        zstd.decode(body, out=dest.reshape(-1).view(np.uint8))
    except Exception as exc:  # noqa: BLE001 - numcodecs raises plain errors on bad frames
        raise _damaged(ref, f"chunk {c} does not decompress: {exc}") from exc


def _zstd_content_size(frame: memoryview) -> int | None:
    """The decompressed size a zstd frame header declares (None when it declares none)."""
    if len(frame) < 6 or bytes(frame[:4]) != b"\x28\xb5\x2f\xfd":
        return None
    desc = frame[4]
    fcs_flag, single, dict_flag = desc >> 6, (desc >> 5) & 1, desc & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(frame) < pos + size:
        return None
    value = int.from_bytes(frame[pos:pos + size], "little")
    return value + 256 if size == 2 else value


def mapped_chunks(data: ShardBytes, fmt: ShardFormat, n_chunks: int, verify: Iterable[int],
                  ref: ChunkRef = ChunkRef()) -> np.ndarray | None:
    """The first ``n_chunks`` chunks of an uncompressed shard as one ``(chunks, chunk_rows,
    *row_shape)`` array *on* ``data`` (a memory-mapped shard object: no copy), after checking
    the crc32c of the index and of each chunk in ``verify``; None when the shard is compressed
    or its chunks are not laid out back to back (read it with :func:`decode_shard_rows` then).

    Raises :class:`CorruptChunk` naming ``ref`` on damage.
    """
    if fmt.compressed:
        return None
    view = memoryview(data)
    index = shard_index(view, fmt, ref)
    dtype = np.dtype(fmt.dtype)
    row_bytes, stride = fmt.row_bytes, fmt.stored_stride
    want = np.arange(n_chunks, dtype=np.uint64) * np.uint64(stride)
    if (n_chunks > len(index) or not np.array_equal(index[:n_chunks, 0], want)
            or not np.all(index[:n_chunks, 1] == stride) or n_chunks * stride > len(view) - len(index) * 16 - 4):
        return None
    for c in verify:
        _check_crc(view[c * stride:(c + 1) * stride], f"chunk {c}", ref)
    inner = [dtype.itemsize * int(np.prod(fmt.row_shape[i + 1:], dtype=np.int64)) for i in range(len(fmt.row_shape))]
    return np.ndarray((n_chunks, fmt.chunk_rows, *fmt.row_shape), dtype=dtype, buffer=view,
                      strides=(stride, row_bytes, *inner))
