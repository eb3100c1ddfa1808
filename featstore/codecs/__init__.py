"""How values are stored, pure: dense value codecs (float32/16, bfloat16, kept fields), sparse
soft labels (``topk``, ``topp``, ``sample``, the compact ``topkq``) and ``int8``, per-token
(ragged) outputs and the tokenizer they speak, how a shard's rows are cut into chunks, and the
statistics a manifest records.
"""

from featstore.codecs._chunking import dividing_chunk
from featstore.codecs._dense import Codec, codec_by_name, keep_codec, output_codec
from featstore.codecs._parts import (CODEC_CHOICES, PartsCodec, assemble, check_output_codec, expand_fields,
                                     is_parts_codec, parts_codec)
from featstore.codecs._ragged import (LENGTHS, OFFSETS, RAGGED_FORMS, TOKEN_FIELDS, TOKEN_LENGTH, TOKEN_START,
                                      RaggedRows, RaggedWindow, Tokens, concat_rows, gather_rows, offsets, pad_value,
                                      padded)
from featstore.codecs._statistics import summarize, value_stats
from featstore.codecs._vocabulary import Vocabulary

__all__ = ["CODEC_CHOICES", "LENGTHS", "OFFSETS", "RAGGED_FORMS", "TOKEN_FIELDS", "TOKEN_LENGTH", "TOKEN_START",
           "Codec", "PartsCodec", "RaggedRows", "RaggedWindow", "Tokens", "Vocabulary", "assemble",
           "check_output_codec", "codec_by_name", "concat_rows", "dividing_chunk", "expand_fields", "gather_rows",
           "is_parts_codec", "keep_codec", "offsets", "output_codec", "pad_value", "padded", "parts_codec", "summarize",
           "value_stats"]
