"""The built-in byte-level tokenizer: every UTF-8 text round-trips, fixed special ids, a chat template, and it
saves and loads as an ordinary HF tokenizer directory (offline)."""

from transformers import AutoTokenizer

from beamrl.data.byte_tokenizer import NUM_BYTES, SPECIALS, VOCAB_SIZE, byte_tokenizer
from beamrl.data.prompts import load_tokenizer


def test_ids_are_the_bytes_after_the_specials_and_text_round_trips():
    tok = byte_tokenizer()
    assert len(tok) == VOCAB_SIZE == len(SPECIALS) + NUM_BYTES
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (0, 1, 2)
    text = "Solve: 3+5=? Überall ∑ 😀\n"
    ids = tok(text)["input_ids"]
    assert ids == [len(SPECIALS) + b for b in text.encode()]  # one token per byte, no specials added
    assert tok.decode(ids) == text
    assert tok.decode([*ids, 0], skip_special_tokens=True) == text


def test_chat_template_and_a_saved_directory_load_offline(tmp_path):
    tok = byte_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == "<|user|>\n2+2?\n<|assistant|>\n"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("héllo")["input_ids"] == tok("héllo")["input_ids"] and again.chat_template
    assert not byte_tokenizer(chat_template=False).chat_template
    assert load_tokenizer("byte", None)("A")["input_ids"] == [len(SPECIALS) + ord("A")]
