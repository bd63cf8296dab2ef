import pytest

from beamrl.data.formats import RowFormatError, parse_dapo, parse_prompt_answer

DAPO_ROW = {
    "data_source": "math_dapo",
    "prompt": [{"role": "user", "content": "Solve 1+1. Answer: $Answer"}],
    "ability": "MATH",
    "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "abc"},
}


def test_dapo_schema():
    p = parse_dapo(DAPO_ROW, 0)
    assert p.messages == DAPO_ROW["prompt"] and p.ground_truth == "2" and p.data_source == "math_dapo"
    assert p.metadata == {"ability": "MATH", "reward_model": {"style": "rule-lighteval/MATH_v2"},
                          "extra_info": {"index": "abc"}}


@pytest.mark.parametrize("broken,words", [
    ({"prompt": "plain text"}, "list of {role, content}"),
    ({"reward_model": {"style": "x"}}, "ground_truth"),
    ({"prompt": None}, "'prompt'"),
])
def test_dapo_errors(broken, words):
    with pytest.raises(RowFormatError, match="row 7") as e:
        parse_dapo({**DAPO_ROW, **broken}, 7)
    assert words in str(e.value)


def test_prompt_answer():
    p = parse_prompt_answer({"prompt": "2+2=", "answer": 4, "level": 1}, 0)
    assert p.ground_truth == "4" and p.data_source == "jsonl-prompt-answer" and p.metadata == {"level": 1}
    with pytest.raises(RowFormatError, match="'answer'"):
        parse_prompt_answer({"prompt": "x"}, 3)
