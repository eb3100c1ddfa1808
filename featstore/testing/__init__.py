"""Test helpers that featstore ships for backends and users: real S3-compatible servers on loopback."""
