"""Tiny stand-ins of real tokenizers, built offline: a character vocabulary (every printable
ASCII character and newline is one token) with the special tokens, the BOS habits, the end
tokens and the chat template of a real family, so that tests meet what real tokenizers do:

    char    the tiny job's (models/tokenizer.py): <pad> <bos> <eos> first, BOS not added by
            the tokenizer, no chat template
    chatml  Qwen2.5/Qwen3's: characters first, then <|endoftext|> <|im_start|> <|im_end|>;
            no BOS (bos_token None, though config.json names one), EOS <|im_end|>, ChatML
            template with a default system message; generation_config ends on
            <|im_end|> or <|endoftext|>
    llama3  Llama 3.1 Instruct's: characters first, then <|begin_of_text|> <|end_of_text|>
            <|eot_id|> <|start_header_id|> <|end_header_id|>; the tokenizer adds BOS itself
            (a post-processor) and the template writes it too; EOS <|eot_id|>,
            generation_config ends on <|end_of_text|> or <|eot_id|>

Ids differ between them (a character's id in one is another token in the next), so text
decoded with the wrong tokenizer shows. Each returns (tokenizer, ids) where ids holds the
pad/bos/eos ids for config.json and the end ids for generation_config.json.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from pivot_hpc.models.tokenizer import CHARS, build_tokenizer

KINDS = ("char", "chatml", "llama3")

CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def _chars_then(specials: tuple[str, ...]) -> tuple[Tokenizer, dict[str, int]]:
    vocab = {ch: i for i, ch in enumerate(CHARS)}
    for s in specials:
        vocab[s] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0]))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return core, vocab


def build_family_tokenizer(kind: str) -> tuple[PreTrainedTokenizerFast, dict[str, Any]]:
    if kind == "char":
        tok = build_tokenizer()
        ids = {"pad": tok.pad_token_id, "bos": tok.bos_token_id, "eos": tok.eos_token_id}
        return tok, {**ids, "end": [tok.eos_token_id]}
    if kind == "chatml":
        specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
        core, vocab = _chars_then(specials)
        core.add_special_tokens(list(specials))
        tok = PreTrainedTokenizerFast(
            tokenizer_object=core,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            unk_token=None,
            chat_template=CHATML_TEMPLATE,
        )
        end = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
        # config.json names a BOS the tokenizer never uses, as Qwen2.5's does
        ids = {"pad": vocab["<|endoftext|>"], "bos": vocab["<|endoftext|>"], "eos": end[0]}
        return tok, {**ids, "end": end}
    if kind == "llama3":
        specials = (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|eot_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
        )
        core, vocab = _chars_then(specials)
        core.add_special_tokens(list(specials))
        bos = vocab["<|begin_of_text|>"]
        core.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)],
        )
        tok = PreTrainedTokenizerFast(
            tokenizer_object=core,
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            chat_template=LLAMA3_TEMPLATE,
        )
        end = [vocab["<|end_of_text|>"], vocab["<|eot_id|>"]]
        ids = {"pad": None, "bos": bos, "eos": vocab["<|end_of_text|>"]}
        return tok, {**ids, "end": end}
    raise ValueError(f"unknown tokenizer kind {kind!r}: valid choices {', '.join(KINDS)}")
