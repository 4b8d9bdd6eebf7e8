"""Each model's own text ↔ token ids: its tokenizer, chat template, BOS and stop ids.

The policy and the GenRM are different models (the paper's group 1: a Qwen2.5 policy
judged by GLM-Z1), so each role encodes what it reads and decodes what it writes with the
tokenizer of its own directory; a judgement decoded with the policy's vocabulary would be
noise. What real tokenizers do that the tiny one does not, and what is done about it:

- No BOS (Qwen's: `bos_token` is None though config.json names a `bos_token_id`): nothing is
  prepended. A tokenizer that adds its BOS itself (Llama 3's post-processor) is not given a
  second one; one that has a BOS but does not add it (the tiny char tokenizer) gets it.
- A chat template (tokenizer_config.json or chat_template.jinja): a prompt given as text is
  sent as one user message through it, with the generation prompt (`chat=True`, the
  default: `rl.data.apply_chat_template`, `rl.reward.genrm_chat_template`); a prompt given
  as messages always is. The template writes its own specials (Llama 3's
  `<|begin_of_text|>`), so those ids are encoded without adding more.
- Several end tokens (Qwen2.5-Instruct: `<|im_end|>` and `<|endoftext|>`; Llama 3.1:
  `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`): every id that config.json,
  generation_config.json (models/description.py) or the tokenizer names stops a sequence,
  and none of them is part of the decoded text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivot_hpc.models.tokenizer import load_tokenizer


@dataclass(frozen=True)
class Prompter:
    """One model's text ↔ ids (see the module docstring)."""

    tok: Any  # a transformers tokenizer
    stop_ids: tuple[int, ...]  # every end-of-sequence id; the first is the tokenizer's own
    chat: bool = True  # text prompts go through the chat template when there is one

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str, messages: Sequence[tuple[str, str]] = ()) -> list[int]:
        """The prompt's ids: `messages` ((role, content) pairs) or `text` as one user
        message through the chat template; without one (or with `chat` off for a text
        prompt), the text after the tokenizer's BOS if it has one."""
        if self.has_template and (messages or self.chat):
            chat = [{"role": r, "content": c} for r, c in messages] or [
                {"role": "user", "content": text}
            ]
            templated = self.tok.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=False
            )
            return list(self.tok.encode(templated, add_special_tokens=False))
        ids = list(self.tok.encode(text, add_special_tokens=True))
        bos = self.tok.bos_token_id
        if bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Generated ids as text, without end-of-sequence tokens."""
        stop = set(self.stop_ids)
        return self.tok.decode([t for t in ids if t not in stop])


def prompter_of(tok: Any, chat: bool = True) -> Prompter:
    """A Prompter over a tokenizer alone (its own EOS is the only stop id)."""
    if isinstance(tok, Prompter):
        return Prompter(tok.tok, tok.stop_ids, chat)
    eos = tok.eos_token_id
    return Prompter(tok, (eos,) if eos is not None else (), chat)


def load_prompter(model_dir: str | Path, chat: bool = True) -> Prompter:
    """The model directory's tokenizer, with every stop id its configs name."""
    from pivot_hpc.models.description import description_of
    from pivot_hpc.models.safetensors_headers import ModelDirError

    tok = load_tokenizer(model_dir)
    named = [tok.eos_token_id, *description_of(model_dir).eos_token_ids]
    stop = tuple(dict.fromkeys(int(t) for t in named if t is not None))
    if not stop:
        raise ModelDirError(
            f"{model_dir}: no end-of-sequence token (the tokenizer's eos_token, config.json's "
            "or generation_config.json's eos_token_id): name the model's end token in one of "
            "them, or every sequence runs to its token limit"
        )
    return Prompter(tok, stop, chat)
