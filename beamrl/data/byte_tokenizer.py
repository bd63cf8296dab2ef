"""A byte-level HF tokenizer built in code: no files, no download, so real-text data works offline.

ids: 0 `<eos>`, 1 `<pad>`, 2 `<bos>`, then the 256 bytes (3..258): 259 tokens, any UTF-8 text round-trips. `<eos>`
is 0 to match the `tiny` preset's `eos_token_id`. It is a `transformers.PreTrainedTokenizerFast` with a chat
template, so `data.chat_template: true` and `beamrl init-checkpoint --tokenizer byte` (which saves it beside the
weights as `tokenizer.json` + `tokenizer_config.json`) work like any HF tokenizer. One token per byte makes
sequences long: it is for trying real data end to end on small models, not for quality.
"""

from __future__ import annotations

from typing import Any

SPECIALS = ("<eos>", "<pad>", "<bos>")
NUM_BYTES = 256
VOCAB_SIZE = len(SPECIALS) + NUM_BYTES
# Role-tagged turns; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def byte_tokenizer(chat_template: bool = True) -> Any:
    """The byte-level tokenizer (`chat_template=False` leaves the template out, e.g. to test that check)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(byte_chars)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS))
    eos, pad, bos = SPECIALS
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=pad, bos_token=bos,
                                   chat_template=CHAT_TEMPLATE if chat_template else None)


def _byte_of(ch: str) -> int:
    """The byte that GPT-2's byte-level alphabet maps to the printable character `ch`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(NUM_BYTES) if b not in printable]
    return others[ord(ch) - NUM_BYTES]
