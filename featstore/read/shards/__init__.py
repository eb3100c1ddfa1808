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
    from featstore.read.shards._cache import (DiskCacheOptions, clear_disk_cache, held_open, list_disk_cache,
                                              process_local, shm_root)
    from featstore.read.shards._flight import StreamSources, Unit, UnitRows, read_spans
    from featstore.read.shards._gather import ArenaRows, BatchRows, InPlace, SpanRows, sample_tokens, window_rows
    from featstore.read.shards._objects import scope_identity
    from featstore.read.shards._sources import (Caches, Epoch, FixedView, InThread, Labelled, ProcessReads,
                                                ShardSource, Span, SpanRead, Viewed, default_cache_bytes)

_NAMES = {name: module for module, names in {
    "_cache": ("DiskCacheOptions", "clear_disk_cache", "held_open", "list_disk_cache", "process_local", "shm_root"),
    "_flight": ("StreamSources", "Unit", "UnitRows", "read_spans"),
    "_gather": ("ArenaRows", "BatchRows", "InPlace", "SpanRows", "sample_tokens", "window_rows"),
    "_objects": ("scope_identity",),
    "_sources": ("Caches", "Epoch", "FixedView", "InThread", "Labelled", "ProcessReads", "ShardSource", "Span",
                 "SpanRead", "Viewed", "default_cache_bytes"),
}.items() for name in names}
__all__ = ["ArenaRows", "BatchRows", "Caches", "DiskCacheOptions", "Epoch", "FixedView", "InPlace", "InThread",
           "Labelled", "ProcessReads", "ShardSource", "Span", "SpanRead", "SpanRows", "StreamSources", "Unit",
           "UnitRows", "Viewed", "clear_disk_cache", "default_cache_bytes", "held_open", "list_disk_cache",
           "sample_tokens", "process_local", "read_spans", "scope_identity", "shm_root", "window_rows"]
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
