"""The read side: :class:`FeatureDataset`, who reads what, shuffle windows, gathering, the arena,
caches (memory, disk)."""

