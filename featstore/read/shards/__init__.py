"""Bytes and caches: where a shard's bytes come from (a local store's files mapped, a remote
store's objects fetched, the node's disk cache), the shared-memory cache of decoded shards, the
arena that maps a window's shards back to back, the sources that read a window's rows of one
version in one process (:class:`ShardSource`, :class:`ProcessReads`), the spans in flight, and
the rows a window holds (:class:`InPlace`, :class:`ArenaRows`: what a batch is gathered from).

The names are imported when first used: ``featstore cache list`` reads the disk cache without torch.
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports

if TYPE_CHECKING:  # the names as the type checker sees them (at runtime: imported on first use)
    from featstore.read.shards._cache import (DiskCacheOptions as DiskCacheOptions,
                                              clear_disk_cache as clear_disk_cache, held_open as held_open,
                                              list_disk_cache as list_disk_cache, process_local as process_local,
                                              shm_root as shm_root)
    from featstore.read.shards._gather import (ArenaRows as ArenaRows, BatchRows as BatchRows, InPlace as InPlace,
                                               SpanRows as SpanRows, piece_tokens as piece_tokens,
                                               window_rows as window_rows)
    from featstore.read.shards._objects import (scope_identity as scope_identity)
    from featstore.read.shards._sources import (Caches as Caches, Epoch as Epoch, FixedView as FixedView,
                                                InThread as InThread, Labelled as Labelled,
                                                ProcessReads as ProcessReads, ShardSource as ShardSource, Span as Span,
                                                SpanRead as SpanRead, StreamSources as StreamSources, Unit as Unit,
                                                UnitRows as UnitRows, Viewed as Viewed,
                                                default_cache_bytes as default_cache_bytes, read_spans as read_spans)

_NAMES = {"DiskCacheOptions": "_cache", "clear_disk_cache": "_cache", "held_open": "_cache",
    "list_disk_cache": "_cache", "process_local": "_cache", "shm_root": "_cache", "ArenaRows": "_gather",
    "BatchRows": "_gather", "InPlace": "_gather", "SpanRows": "_gather", "piece_tokens": "_gather",
    "window_rows": "_gather", "scope_identity": "_objects", "Caches": "_sources", "Epoch": "_sources",
    "FixedView": "_sources", "InThread": "_sources", "Labelled": "_sources", "ProcessReads": "_sources",
    "ShardSource": "_sources", "Span": "_sources", "SpanRead": "_sources", "StreamSources": "_sources",
    "Unit": "_sources", "UnitRows": "_sources", "Viewed": "_sources", "default_cache_bytes": "_sources",
    "read_spans": "_sources"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
