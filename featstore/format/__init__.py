"""What featstore writes into Zarr v3 and accepts from it: arrays (per sample or per token),
compression, chunk keys (spread over prefixes), the mark of versions whose shards lie elsewhere,
the shard digest and the fast shard decoder; and the stored objects' schemas (manifests,
receipts, shard records, tags, claims).

The array and decoder names are imported when first used: their modules import zarr, which the
quick commands (``featstore list``, ``info``, ...) never need.
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports
from featstore.format._keys import (RESERVED_FIELDS, SPREAD_FOLDER, VIEWS_GROUP, chunk_key, logical_key, mark_metadata,
                                    shard_digest, spread_folder, spread_key, view_path)
from featstore.format._manifests import (RECORDS_PER_OBJECT, SCHEMA, SCHEMA_VERSION, SERVED_SOURCES, ArraySpec,
                                         ArrayStats, Base, Layout, Manifest, ShardReceipt, ShardRecords, ViewsSpec,
                                         check_spread, decode_records, encode_records, newer_manifest)
from featstore.format._objects import Pending, ReceiptRun, gc_mark_json, ref_json, ref_target, tag_json, tag_target

if TYPE_CHECKING:  # zarr's: imported when first asked for
    from featstore.format._arrays import (MetadataStore, SpreadStore, check_array_metadata, check_compression,
                                          choose_compression, chunk_label, consolidate, consolidated_groups,
                                          create_arrays, create_views_group, open_array, open_for_write, zstd_saving)
    from featstore.format._shard_decoder import (ChunkRef, ShardFormat, decode_shard_rows, mapped_chunks, shard_format,
                                                 shard_index, shard_index_bytes, shard_intact)

_LAZY = {name: "_arrays" for name in (
    "MetadataStore", "SpreadStore", "check_array_metadata", "check_compression", "choose_compression", "chunk_label",
    "consolidate", "consolidated_groups", "create_arrays", "create_views_group", "open_array", "open_for_write",
    "zstd_saving")}
_LAZY.update({name: "_shard_decoder" for name in (
    "ChunkRef", "ShardFormat", "decode_shard_rows", "mapped_chunks", "shard_format", "shard_index",
    "shard_index_bytes", "shard_intact")})
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["RECORDS_PER_OBJECT", "RESERVED_FIELDS", "SCHEMA", "SCHEMA_VERSION", "SERVED_SOURCES", "SPREAD_FOLDER",
           "VIEWS_GROUP", "ArraySpec", "ArrayStats", "Base", "ChunkRef", "Layout", "Manifest", "MetadataStore",
           "Pending", "ReceiptRun", "ShardFormat", "ShardReceipt", "ShardRecords", "SpreadStore", "ViewsSpec",
           "check_array_metadata", "check_compression", "check_spread", "choose_compression", "chunk_key",
           "chunk_label", "consolidate", "consolidated_groups", "create_arrays", "create_views_group", "decode_records",
           "decode_shard_rows", "encode_records", "gc_mark_json", "logical_key", "mapped_chunks", "mark_metadata",
           "newer_manifest", "open_array", "open_for_write", "ref_json", "ref_target", "shard_digest", "shard_format",
           "shard_index", "shard_index_bytes", "shard_intact", "spread_folder", "spread_key", "tag_json", "tag_target",
           "view_path", "zstd_saving"]
