"""Bytes and caches: where a shard's bytes come from (a local store's files mapped, a remote
store's objects fetched, the node's disk cache), the shared-memory cache of decoded shards, the
arena that maps a window's shards back to back, and the sources that read a window's rows.
"""
