"""Who reads what, in which order: the epoch's plan as pure functions (no IO).

- :mod:`._assignment` and :mod:`._shuffle`: one version's plan per consumer (rank x DataLoader
  worker): a seeded shard permutation evaluated per position, spans, pieces, shuffle windows;
- :mod:`._mixture`: weighted mixtures of streams (Mosaic's proportion/repeat/choose), one plan;
- :mod:`._slices`: a consumer's share as slices of windows, and a window's (stratified) order;
- :mod:`._elastic`: what an interrupted run read of an epoch, and the rest over any split.
"""
