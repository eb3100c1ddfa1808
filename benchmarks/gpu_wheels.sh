#!/usr/bin/env bash
# Wheels that featstore needs beside what the lent GPU machine already has (its image has Python
# 3.12, torch, numpy, fsspec, cloudpickle, msgpack, psutil, ... but no zarr, dask or distributed,
# and no registry can be reached from it). Run this here, from the repository root; it fills
# .whl/ (git-ignored) with about 13 MB. The command that installs them there and runs the GPU
# check is in docs/benchmarks.md, section "GPU check".
set -euo pipefail
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 crc32c==2.9.post0 google-crc32c==1.9.0 \
    dask==2026.8.0 distributed==2026.8.0 partd==1.4.2 locket==1.0.0 tblib==3.2.2 tornado==6.6.1 zict==3.0.0
ls .whl
