"""A store URL as a small storage surface: local files, fsspec filesystems, S3 (s3fs writes, obstore reads)."""
