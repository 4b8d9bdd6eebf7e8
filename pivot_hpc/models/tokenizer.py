"""A character-level tokenizer built locally with `tokenizers` (no download).

Every printable ASCII character plus newline is one token, so any text of the synthetic
task (and any GenRM rationale) round-trips exactly. Loaded back with
`PreTrainedTokenizerFast.from_pretrained` (docs/platform.md: AutoTokenizer would pick
Qwen2Tokenizer, which silently drops spaces and newlines for a custom vocab).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD = "<pad>"
BOS = "<bos>"
EOS = "<eos>"
SPECIALS = (PAD, BOS, EOS)
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII


def build_tokenizer() -> PreTrainedTokenizerFast:
    """pad=0, bos=1, eos=2, then one id per character (98 tokens in all)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    # Split into single characters; "isolated" keeps every character, spaces included.
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD
    )
    return tok


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def encode_prompt(tok, text: str, messages: Sequence[tuple[str, str]] = ()) -> list[int]:
    """The prompt's token ids: the tokenizer's BOS (when it has one) + `text`; or, when the
    prompt came as a chat (`messages`: (role, content) pairs, e.g. DAPO-Math-17k's) and the
    tokenizer has a chat template, that template with the generation prompt (its own
    special tokens included). The live roles use models/prompting.py, which also sends
    text prompts through a chat template."""
    from pivot_hpc.models.prompting import prompter_of

    return prompter_of(tok, chat=False).encode(text, messages)


def decode_response(tok, ids: Sequence[int]) -> str:
    """A generated response as text, without its end-of-sequence token."""
    eos = tok.eos_token_id
    return tok.decode([t for t in ids if t != eos])
