import pytest

from beamrl.data.digit_tokenizer import DigitTokenizer


def test_round_trip_and_ids():
    tok = DigitTokenizer()
    ids = tok.encode("3+5=8")
    assert ids == [6, 13, 8, 14, 11]  # '0' is id 3
    assert tok.decode(ids + [tok.eos_token_id, 7]) == "3+5=8"  # eos ends the text
    assert tok.decode([tok.bos_token_id, 4, tok.pad_token_id]) == "1"
    assert tok.encode("7", add_bos=True) == [2, 10]
    assert len(tok) == tok.vocab_size == 16


def test_errors_name_the_bad_input():
    tok = DigitTokenizer()
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("3x5")
    with pytest.raises(ValueError, match="99"):
        tok.decode([99])


def test_eos_matches_tiny_preset():
    from beamrl.models.beam import preset

    assert DigitTokenizer.eos_token_id == preset("tiny").eos_token_id
