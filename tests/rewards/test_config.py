import pytest
from pydantic import ValidationError

from beamrl.rewards import RewardComponentConfig, RewardPoolConfig


@pytest.mark.parametrize(
    "kwargs, field, message",
    [
        (dict(name="a/b", fn="x:y"), "name", "pattern"),
        (dict(name="a", fn=""), "fn", "at least 1"),
        (dict(name="a", fn="  "), "fn", "blank"),
        (dict(name="a", fn="x:y", weight=float("nan")), "weight", "finite"),
        (dict(name="a", fn="x:y", timeout_s=0), "timeout_s", "greater than 0"),
        (dict(name="a", fn="x:y", timeout_s=float("inf")), "timeout_s", "finite"),
        (dict(name="a", fn="x:y", on_error="ignore"), "on_error", "'zero', 'skip' or 'raise'"),
        (dict(name="a", fn="x:y", kwargs={"completion": 1}), "kwargs", "shadow injected fields"),
        (dict(name="a", fn="x:y", kwargs={"not an id": 1}), "kwargs", "identifier"),
        (dict(name="a", fn="x:y", kwargs={"f": lambda: 1}), "kwargs", "cannot be pickled"),
        (dict(name="a", fn="x:y", num_workers=0), "num_workers", "greater than 0"),
        (dict(name="a", fn="x:y", max_concurrency=0), "max_concurrency", "greater than 0"),
        (dict(name="a", fn="x:y", breaker_after=-1), "breaker_after", "greater than or equal to 0"),
        (dict(name="a", fn="x:y", timeout=3), "timeout", "Extra inputs"),
    ],
)
def test_component_validation_names_the_field(kwargs, field, message):
    with pytest.raises(ValidationError) as e:
        RewardComponentConfig(**kwargs)
    err = e.value.errors()[0]
    assert err["loc"] == (field,) and message in err["msg"]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"num_workers": 0}, "num_workers"), ({"batch_timeout_s": 0}, "batch_timeout_s"),
     ({"batch_timeout_s": float("inf")}, "batch_timeout_s"), ({"start_timeout_s": -1}, "start_timeout_s"),
     ({"workers": 2}, "workers")],
)
def test_pool_validation_names_the_field(kwargs, field):
    with pytest.raises(ValidationError) as e:
        RewardPoolConfig(**kwargs)
    assert e.value.errors()[0]["loc"] == (field,)


def test_defaults():
    c = RewardComponentConfig(name="a", fn="x:y")
    assert (c.weight, c.timeout_s, c.on_error, c.kwargs) == (1.0, 30.0, "zero", {})
    assert (c.num_workers, c.max_concurrency, c.breaker_after) == (None, 16, 3)
    p = RewardPoolConfig()
    assert (p.num_workers, p.batch_timeout_s, p.start_timeout_s) == (None, 300.0, 120.0)
