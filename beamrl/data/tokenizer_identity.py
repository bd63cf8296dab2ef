"""What a tokenizer does, as one digest: a resumed run must tokenize its prompts as its earlier stretch did.

The recipe names a tokenizer by a path or hub id (`data.tokenizer`, or `model.checkpoint` when that is null), and a
path says nothing about the files behind it: a resume from another checkpoint directory, or from a directory whose
tokenizer was replaced, would tokenize differently without a changed field. So a run keeps the digest of its
tokenizer in its output directory (`TOKENIZER_DIGEST_FILE`), and a resume compares it (`beamrl.loop.setup`).

The digest covers the vocabulary (token -> id), the special ids, the chat template and the ids of a few probe texts
with and without the special tokens the tokenizer adds (a BOS it prepends shows there), not the files' bytes: a
tokenizer saved again, or by another `transformers` version, keeps its digest as long as it tokenizes the same. Its
limit: a change that keeps the vocabulary and alters only how words none of the probe texts contain are split (a
BPE merge order, say) is not seen.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: The file in a run's output directory that holds its tokenizer's digest.
TOKENIZER_DIGEST_FILE = "tokenizer.sha256"
#: Texts whose ids go into the digest: merges and normalisation show in them, not in the vocabulary alone.
PROBES = ("1+2=3", "12+34=46", "The answer is \\boxed{42}.", "  leading spaces\tand\ttabs\n", "naïve café 日本語 🙂",
          "Let x be the smallest positive integer such that 3x + 7 is divisible by 11. Find x^2 - 1.",
          "def f(n):\n    return sum(i * i for i in range(n))  # 0, 1, 5, 14, 30")


def _ids(tokenizer: Any, text: str, special: bool) -> list[int] | str:
    """The ids of `text`, with (`special`) or without the special tokens the tokenizer adds around a text."""
    try:
        if hasattr(tokenizer, "get_vocab"):  # an HF tokenizer
            return list(tokenizer(text, add_special_tokens=special)["input_ids"])
        return list(tokenizer.encode(text, add_bos=special))
    except ValueError:  # a tokenizer that refuses the text (the digit tokenizer): the refusal is its behaviour
        return "refused"  # not the message, which may be reworded without any change to the tokenizer


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 (hex) of what `tokenizer` does (module docstring)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {t: i for i, t in enumerate(tokenizer.vocab)}
    what = {
        "vocab": sorted((str(t), int(i)) for t, i in vocab.items()),
        "special": {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        "chat_template": getattr(tokenizer, "chat_template", None),
        "probes": [[_ids(tokenizer, p, special) for special in (False, True)] for p in PROBES],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
