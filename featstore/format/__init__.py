"""What featstore writes into Zarr v3 and accepts from it: arrays (per sample or per token),
compression, chunk keys (spread over prefixes), the mark of versions whose shards lie elsewhere,
the shard digest and the fast shard decoder; and the stored objects' schemas (manifests,
receipts, shard records, tags, claims).

The array and decoder names are imported when first used: their modules import zarr, which the
quick commands (``featstore list``, ``info``, ...) never need.
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports
from featstore.format._manifests import (RECORDS_PER_OBJECT, SCHEMA, SCHEMA_VERSION, SERVED_SOURCES, ArraySpec, Base,
                                         Layout, Manifest, ShardReceipt, ShardRecords, ViewsSpec)
from featstore.format._objects import Pending, ReceiptRun
from featstore.format._keys import chunk_key, shard_digest

if TYPE_CHECKING:
    from featstore.format._arrays import SpreadStore, create_arrays, open_array
    from featstore.format._shard_decoder import decode_shard_rows, shard_format, shard_index

__getattr__, __dir__ = lazy_exports(__name__, {
    "SpreadStore": "_arrays", "create_arrays": "_arrays", "open_array": "_arrays",
    "decode_shard_rows": "_shard_decoder", "shard_format": "_shard_decoder", "shard_index": "_shard_decoder"})

__all__ = ["RECORDS_PER_OBJECT", "SCHEMA", "SCHEMA_VERSION", "SERVED_SOURCES",
           "ArraySpec", "Base", "Layout", "Manifest", "Pending",
           "ReceiptRun", "ShardReceipt", "ShardRecords", "SpreadStore", "ViewsSpec", "chunk_key", "create_arrays",
           "decode_shard_rows", "open_array", "shard_digest", "shard_format", "shard_index"]
