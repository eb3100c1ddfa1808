"""A tiny language-model world for the Hugging Face tests: a word-level tokenizer built in
process, sentences over its words, and a randomly initialised Llama built from a config (no
weights, nothing from a hub)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

WORDS = ("the a one two three cat dog bird sees eats runs over under and then it is big small red blue "
         "green old new fast slow house tree river stone light dark day night here there").split()
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")


def tokenizer(eos: str = "</s>", extra: tuple[str, ...] = ()):
    """A word-level fast tokenizer over :data:`WORDS` (ids 0-3 special), BOS added to each text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate((*SPECIALS, *WORDS, *extra))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token=eos, unk_token="<unk>",
                                   pad_token="<pad>", name_or_path="tiny-words")


def sentences(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[str]:
    """``n`` sentences of ``lo``-``hi`` words (seeded)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi + 1, (), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)))
    return out


def llama(vocab: int, layers: int = 2, hidden: int = 32, seed: int = 0):
    """A randomly initialised LlamaForCausalLM (float32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()
