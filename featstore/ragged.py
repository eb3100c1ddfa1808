"""Per-token (ragged) outputs, the public module: :class:`Tokens` (and the :class:`Vocabulary` of
the tokenizer they speak), padding and masks for Model A,
and the functions that turn a batch's flat token rows into padded ones (see
:mod:`featstore.codecs` for how they are stored).

>>> import torch
>>> from featstore.ragged import pack
>>> flat, lengths = pack(torch.arange(6).reshape(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]]))
>>> flat.tolist(), lengths.tolist()
([0, 1, 3], [2, 1])
"""

from featstore.codecs import (LENGTHS, OFFSETS, RAGGED_FORMS, TOKEN_FIELDS, TOKEN_LENGTH, TOKEN_START, RaggedRows,
                              RaggedWindow, Tokens, attention_mask, batch_mask, concat_rows, gather_rows, offsets, pack,
                              pad_sequences, pad_value, padded, token_layout)
from featstore.codecs import Vocabulary, vocabulary_digest

__all__ = ["LENGTHS", "OFFSETS", "RAGGED_FORMS", "TOKEN_FIELDS", "TOKEN_LENGTH", "TOKEN_START", "RaggedRows",
           "RaggedWindow", "Tokens", "attention_mask", "batch_mask", "concat_rows", "gather_rows", "offsets", "pack",
           "pad_sequences", "pad_value", "padded", "token_layout", "Vocabulary", "vocabulary_digest"]
