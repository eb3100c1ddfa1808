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


#: SmolLM2's vocabulary size, which :class:`ZipfLM` and :func:`big_tokenizer` share.
BIG_VOCAB = 49152


def big_tokenizer():
    """:func:`tokenizer` grown to :data:`BIG_VOCAB` tokens: the words ``w0``, ``w1``, ... after :data:`WORDS`."""
    return tokenizer(extra=tuple(f"w{i}" for i in range(BIG_VOCAB - len(SPECIALS) - len(WORDS))))


def zipf_texts(tokens: int, seed: int = 0, lo: int = 40, hi: int = 63) -> list[str]:
    """Texts of ``lo``-``hi`` words of :func:`big_tokenizer`'s ``w`` words (a text's tokens: its
    words and BOS), the word ranked ``r`` drawn with probability ``~ 1 / (r + 10)``, until they
    hold at least ``tokens`` tokens (seeded)."""
    g = torch.Generator().manual_seed(seed)
    n = BIG_VOCAB - len(SPECIALS) - len(WORDS)
    weights = 1.0 / (torch.arange(n, dtype=torch.float64) + 10.0)
    out, total = [], 0
    while total < tokens:
        k = int(torch.randint(lo, hi + 1, (), generator=g))
        out.append(" ".join(f"w{int(i)}" for i in torch.multinomial(weights, k, replacement=True, generator=g)))
        total += k + 1
    return out


class ZipfLM(torch.nn.Module):
    """A tiny deterministic language-model-shaped teacher, cheap at any length: ``forward(input_ids,
    attention_mask)`` returns ``.logits [B, L, vocab]`` = a Zipf prior over the ids (``-1.1 *
    log(id + 10)``: small ids are common tokens, as in a BPE vocabulary) plus a rank-8 field of
    the token and the one before it. Its top-50 soft labels are shaped like SmolLM2-135M's on
    the standard library's docstrings (issue 42, measured with ``topkq:50`` and zstd level 3):
    the 50 most frequent ids fill 21% of the stored ids (SmolLM2: 22%), the 500 most frequent
    66% (62%); one zstd frame of 1,005 tokens takes 94.9 B a token (SmolLM2's first 1,005
    tokens: 94.2), frames of 8,192 tokens 87.7 (81-82): never more compressible than the real
    teacher, so a size it keeps, the real one keeps too."""

    def __init__(self, vocab: int = BIG_VOCAB, rank: int = 8, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("prior", -1.1 * torch.log(torch.arange(vocab, dtype=torch.float32) + 10.0))
        self.register_buffer("now", torch.randn(vocab, rank, generator=g))
        self.register_buffer("before", torch.randn(vocab, rank, generator=g))
        self.register_buffer("field", torch.randn(rank, vocab, generator=g) * (2.0 / rank ** 0.5))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        from types import SimpleNamespace

        before = torch.nn.functional.pad(input_ids[:, :-1], (1, 0))
        return SimpleNamespace(logits=self.prior + (self.now[input_ids] + self.before[before]) @ self.field)
