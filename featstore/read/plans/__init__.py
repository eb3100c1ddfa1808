"""Who reads what, in which order: the epoch's plan as pure functions (no IO).

- :mod:`._assignment` and :mod:`._shuffle`: one version's plan per consumer (rank x DataLoader
  worker): a seeded shard permutation evaluated per position, spans, pieces, shuffle windows;
- :mod:`._mixture`: weighted mixtures of streams (Mosaic's proportion/repeat/choose), one plan;
- :mod:`._slices`: a consumer's share as slices of windows, and a window's (stratified) order;
- :mod:`._elastic`: what an interrupted run read of an epoch, and the rest over any split.

The names are imported when first used (the reader's options check a partition without numpy).
"""

from typing import TYPE_CHECKING

from featstore._lazy import lazy_exports

if TYPE_CHECKING:  # the names as the type checker sees them (at runtime: imported on first use)
    from featstore.read.plans._partitions import (PARTITIONS as PARTITIONS, Partition as Partition)
    from featstore.read.plans._assignment import (ConsumerPlan as ConsumerPlan, Piece as Piece,
                                                  UniformShards as UniformShards, consumer_plan as consumer_plan,
                                                  consumer_span as consumer_span, dropped_pieces as dropped_pieces,
                                                  rotated as rotated, round_robin_consumed as round_robin_consumed,
                                                  shard_order as shard_order)
    from featstore.read.plans._elastic import (EpochOrder as EpochOrder, ResumeState as ResumeState, Segment as Segment,
                                               Split as Split, check_global_batch as check_global_batch,
                                               check_same_order as check_same_order, epoch_share as epoch_share,
                                               progress as progress, remaining_samples as remaining_samples,
                                               resume as resume)
    from featstore.read.plans._mixture import (WEIGHTS as WEIGHTS, MixStream as MixStream, Mixture as Mixture,
                                               int_at_least as int_at_least, stream_samples as stream_samples)
    from featstore.read.plans._shuffle import (ShardPermutation as ShardPermutation)
    from featstore.read.plans._slices import (Share as Share, Slice as Slice, SliceRows as SliceRows, Window as Window,
                                              cut_pieces as cut_pieces, run_starts as run_starts,
                                              slice_reads as slice_reads, slice_rows as slice_rows)

_NAMES = {"PARTITIONS": "_partitions", "Partition": "_partitions", "ConsumerPlan": "_assignment",
    "Piece": "_assignment", "UniformShards": "_assignment", "consumer_plan": "_assignment",
    "consumer_span": "_assignment", "dropped_pieces": "_assignment", "rotated": "_assignment",
    "round_robin_consumed": "_assignment", "shard_order": "_assignment", "EpochOrder": "_elastic",
    "ResumeState": "_elastic", "Segment": "_elastic", "Split": "_elastic", "check_global_batch": "_elastic",
    "check_same_order": "_elastic", "epoch_share": "_elastic", "progress": "_elastic", "remaining_samples": "_elastic",
    "resume": "_elastic", "WEIGHTS": "_mixture", "MixStream": "_mixture", "Mixture": "_mixture",
    "int_at_least": "_mixture", "stream_samples": "_mixture", "ShardPermutation": "_shuffle", "Share": "_slices",
    "Slice": "_slices", "SliceRows": "_slices", "Window": "_slices", "cut_pieces": "_slices", "run_starts": "_slices",
    "slice_reads": "_slices", "slice_rows": "_slices"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
