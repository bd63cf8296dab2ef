import pytest

from beamrl.rewards import RewardComponentConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="a/b", fn="x:y"), "name"),
        (dict(name="a", fn=""), "fn"),
        (dict(name="a", fn="x:y", weight=float("nan")), "weight"),
        (dict(name="a", fn="x:y", timeout_s=0), "timeout_s"),
        (dict(name="a", fn="x:y", timeout_s=float("inf")), "timeout_s"),
        (dict(name="a", fn="x:y", on_error="ignore"), "on_error"),
        (dict(name="a", fn="x:y", kwargs={"completion": 1}), "shadow"),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardComponentConfig(**kwargs)
