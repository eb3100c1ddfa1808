"""How values are stored, pure: dense value codecs (float32/16, bfloat16, kept fields), sparse
soft labels (``topk``, ``topp``, ``sample``, the compact ``topkq``) and ``int8``, per-token
(ragged) outputs and the tokenizer they speak, how a shard's rows are cut into chunks, and the
statistics a manifest records.
"""

from featstore.codecs._chunking import dividing_chunk
from featstore.codecs._dense import Codec, codec_by_name, keep_codec, output_codec
from featstore.codecs._parts import CODEC_CHOICES, PartsCodec, check_output_codec, is_parts_codec, parts_codec
from featstore.codecs._ragged import Tokens
from featstore.codecs._statistics import summarize, value_stats
from featstore.codecs._topk import TopK
from featstore.codecs._vocabulary import Vocabulary

__all__ = ["CODEC_CHOICES", "Codec", "PartsCodec", "Tokens", "check_output_codec", "codec_by_name", "dividing_chunk",
           "is_parts_codec", "keep_codec", "output_codec", "parts_codec", "summarize", "value_stats",
           "TopK", "Vocabulary"]
