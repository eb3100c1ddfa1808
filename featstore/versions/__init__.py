"""Versions: keys, reading a committed Version, the catalog, claim/receipts/commit, tags, gc,
fingerprints, views, export."""

