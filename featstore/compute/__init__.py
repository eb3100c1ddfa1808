"""The compute side: the driver, the shard task inside Dask, the cluster, devices and transfers, extending a parent."""
