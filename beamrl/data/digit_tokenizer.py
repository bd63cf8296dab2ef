"""A 16-token character tokenizer for the synthetic addition task: no files, no training, fully fixed ids.

ids: 0 <eos>, 1 <pad>, 2 <bos>, 3..12 the digits '0'..'9', 13 '+', 14 '=', 15 <unk> (never produced by
`encode`; it pads the vocabulary to 16 so tensor parallelism of 2, 4, 8 or 16 divides it). `<eos>` is 0 to match the
`tiny` Beam preset's `eos_token_id`, so an engine stopping on the model's eos stops on this tokenizer's eos.
"""

from __future__ import annotations

EOS, PAD, BOS, UNK = "<eos>", "<pad>", "<bos>", "<unk>"
_VOCAB = [EOS, PAD, BOS, *"0123456789", "+", "=", UNK]


class DigitTokenizer:
    """Encode/decode strings over '0'-'9', '+', '='. Unknown characters raise ValueError naming them."""

    vocab = tuple(_VOCAB)
    eos_token_id = 0
    pad_token_id = 1
    bos_token_id = 2
    unk_token_id = 15
    eos_token, pad_token, bos_token = EOS, PAD, BOS

    def __init__(self) -> None:
        self._ids = {tok: i for i, tok in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        try:
            ids = [self._ids[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"DigitTokenizer cannot encode {e.args[0]!r} in {text!r}; allowed: 0-9 '+' '='") from None
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if not 0 <= i < len(self.vocab):
                raise ValueError(f"DigitTokenizer: token id {i} outside [0, {len(self.vocab)})")
            if i == self.eos_token_id and skip_special_tokens:
                break  # eos ends the text
            if i in (self.pad_token_id, self.bos_token_id, self.unk_token_id) and skip_special_tokens:
                continue
            out.append(self.vocab[i])
        return "".join(out)
