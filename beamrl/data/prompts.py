"""Prompt text and token ids: a `{prompt}` template over the user messages, or the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from beamrl.data.digit_tokenizer import DigitTokenizer


BUILT_IN_TOKENIZERS = ("digit", "byte")


def load_tokenizer(name: str | None, model_checkpoint: str | None) -> Any:
    """'digit' -> DigitTokenizer; 'byte' -> the byte-level HF tokenizer (`byte_tokenizer.py`); otherwise an HF
    tokenizer from `name` (a directory, or a hub id in the HF cache) or the model checkpoint directory.
    `beamrl.recipe.preflight.load_run_tokenizer` wraps this with errors that name the recipe field."""
    if name == "digit":
        return DigitTokenizer()
    if name == "byte":
        from beamrl.data.byte_tokenizer import byte_tokenizer

        return byte_tokenizer()
    source = name or model_checkpoint
    if source is None:
        raise ValueError("data.tokenizer is null and model.checkpoint is not set: name a tokenizer ('digit', 'byte' "
                         "or an HF tokenizer directory / hub id)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def format_prompt(messages: list[dict[str, str]], tokenizer: Any, template: str | None, chat_template: bool) -> str:
    """The text to tokenize. Without a chat template, the user messages are joined by blank lines and put
    into `template` (default: as is)."""
    if chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = "\n\n".join(m["content"] for m in messages if m["role"] == "user")
    return template.format(prompt=text) if template else text


def encode_prompt(text: str, tokenizer: Any, chat_template: bool) -> list[int]:
    """Token ids of a formatted prompt. A chat template already contains the special tokens it wants."""
    if isinstance(tokenizer, DigitTokenizer):
        return tokenizer.encode(text)
    return list(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])
