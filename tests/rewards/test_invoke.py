import re

import pytest

from beamrl.rewards.invoke import invoke

from . import sample_reward_fns as fns

M = fns.__name__


def test_sync_and_async_functions():
    assert invoke(f"{M}:needs_completion", {"completion": "abc"}).score == 3.0
    out = invoke(f"{M}:async_len", {"completion": "abcd"})
    assert (out.status, out.score) == ("ok", 4.0)


def test_none_means_not_applicable():
    out = invoke(f"{M}:none_for_empty", {"completion": ""})
    assert (out.status, out.score) == ("none", None)


def test_reward_output_metrics():
    out = invoke(f"{M}:with_metrics", {"completion": "xyz"})
    assert out.status == "ok" and out.score == 0.5 and out.metrics == {"length": 3.0, "mean": 7.0}


@pytest.mark.parametrize(
    "fn, message",
    [
        ("returns_string", r"returned str 'one'; a reward function must return a finite float, None"),
        ("returns_nan", r"returned float nan"),
        ("raises_on_bad", r"raised ValueError: cannot grade 'bad'"),
    ],
)
def test_failures_become_error_outcomes(fn, message):
    out = invoke(f"{M}:{fn}", {"completion": "bad"})
    assert out.status == "error" and out.score is None
    assert re.search(message, out.message)
