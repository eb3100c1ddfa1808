"""What featstore writes into Zarr v3 and accepts from it: arrays, chunk keys, the shard decoder,
manifests and stored schemas."""

