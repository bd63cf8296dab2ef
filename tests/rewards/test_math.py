import pytest

from beamrl.rewards.math import dapo_math, extract_answer, last_boxed


@pytest.mark.parametrize(
    "completion, gold, correct",
    [
        (r"The answer is $\boxed{\frac12}$.", "0.5", True),
        (r"First \boxed{3}, no wait: \boxed{\frac{1}{2}}", r"\frac{1}{2}", True),  # last boxed wins
        (r"\boxed{\sqrt8}", r"2\sqrt2", True),
        ("Reasoning...\nAnswer: 34", "34", True),  # DAPO's "Answer:" line
        (r"\boxed{3}", "4", False),  # wrong answer
        (r"\boxed{3.14}", r"\pi", False),
        ("I think it is 4", "4", False),  # no boxed/Answer: not accepted
    ],
)
def test_dapo_math_cases(completion, gold, correct):
    out = dapo_math(completion, gold)
    assert out.score == (1.0 if correct else 0.0)
    assert out.metrics["acc"] == (1.0 if correct else 0.0)


def test_incorrect_score_parameter_and_has_answer():
    out = dapo_math("no answer", "4", incorrect_score=-1.0)
    assert out.score == -1.0 and out.metrics["has_answer"] == 0.0
    assert dapo_math(r"\boxed{4}", r"\boxed{4}").score == 1.0  # boxed gold accepted


def test_extraction():
    assert last_boxed(r"\boxed{a{b}c} and \boxed{d}") == "d"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed(r"\boxed{ok} then \boxed{unclosed") == "ok"
    assert extract_answer("x\nAnswer: $7$.\n") == "7"
    assert extract_answer("nothing") is None
