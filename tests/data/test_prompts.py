import pytest

from beamrl.data.digit_tokenizer import DigitTokenizer
from beamrl.data.prompts import encode_prompt, format_prompt, load_tokenizer


def _hf_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "solve", "1+1", "please"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template="{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_template_and_plain():
    msgs = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "3+5="}]
    assert format_prompt(msgs, DigitTokenizer(), None, False) == "3+5="
    assert format_prompt(msgs, DigitTokenizer(), "Q: {prompt} A:", False) == "Q: 3+5= A:"


def test_chat_template_with_hf_tokenizer():
    tok = _hf_tokenizer()
    text = format_prompt([{"role": "user", "content": "solve 1+1"}], tok, None, True)
    assert text == "<|user|> solve 1+1 <|assistant|>"
    assert encode_prompt(text, tok, True) == [3, 5, 6, 4]


def test_load_tokenizer():
    assert isinstance(load_tokenizer("digit", None), DigitTokenizer)
    with pytest.raises(ValueError, match="data.tokenizer"):
        load_tokenizer(None, None)
