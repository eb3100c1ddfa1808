"""How values are stored, pure: dense value codecs (float32/16, bfloat16, kept fields), sparse
soft labels (``topk``, ``topp``, ``sample``, the compact ``topkq``) and ``int8``, per-token
(ragged) outputs and the tokenizer they speak, how a shard's rows are cut into chunks, and the
statistics a manifest records.
"""

from featstore.codecs._chunking import MIN_SHARE, dividing_chunk, nearest_multiples
from featstore.codecs._dense import (Codec, codec_by_name, finite_rows, keep_codec, largest_finite, output_codec,
                                     unrepresentable)
from featstore.codecs._parts import (CODEC_CHOICES, PartsCodec, assemble, check_array_name, check_output_codec,
                                     check_part, expand_fields, is_parts_codec, part_array, parts_codec, unpadded)
from featstore.codecs._ragged import (LENGTHS, MIN_SHARD_TOKENS, OFFSETS, RAGGED_FORMS, TOKEN_FIELDS, TOKEN_LENGTH,
                                      TOKEN_START, RaggedRows, RaggedWindow, Tokens, attention_mask, batch_mask,
                                      concat_rows, gather_rows, offsets, pack, pack_topk, pad_sequences, pad_value,
                                      padded, token_layout)
from featstore.codecs._sparse import RULES, sparse_weights
from featstore.codecs._statistics import NONFINITE_KEPT, max_abs_error, merge_stats, summarize, value_stats
from featstore.codecs._topk import TopK
from featstore.codecs._vocabulary import Vocabulary, vocabulary_digest

__all__ = ["CODEC_CHOICES", "LENGTHS", "MIN_SHARD_TOKENS", "MIN_SHARE", "NONFINITE_KEPT", "OFFSETS", "RAGGED_FORMS",
           "RULES", "TOKEN_FIELDS", "TOKEN_LENGTH", "TOKEN_START", "Codec", "PartsCodec", "RaggedRows", "RaggedWindow",
           "Tokens", "TopK", "Vocabulary", "assemble", "attention_mask", "batch_mask", "check_array_name",
           "check_output_codec", "check_part", "codec_by_name", "concat_rows", "dividing_chunk", "expand_fields",
           "finite_rows", "gather_rows", "is_parts_codec", "keep_codec", "largest_finite", "max_abs_error",
           "merge_stats", "nearest_multiples", "offsets", "output_codec", "pack", "pack_topk", "pad_sequences",
           "pad_value", "padded", "part_array", "parts_codec", "sparse_weights", "summarize", "token_layout",
           "unpadded", "unrepresentable", "value_stats", "vocabulary_digest"]
