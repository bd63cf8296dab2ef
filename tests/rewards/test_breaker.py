import pytest

from beamrl.rewards.breaker import CircuitBreaker


def test_trips_after_n_consecutive_failures_naming_the_first():
    b = CircuitBreaker(3)
    assert [b.record_failure(m) for m in ("t1", "t2")] == [False, False]
    b.record_success()  # a returned call (even an exception) ends the run
    assert [b.record_failure(m) for m in ("a", "b", "c")] == [False, False, True]
    assert b.tripped and b.reason == "a"
    assert b.record_failure("d") is False and b.reason == "a"  # trips once
    b.record_success()
    assert b.tripped  # stays open for the rest of the batch


def test_reset_closes_it_for_the_next_batch():
    b = CircuitBreaker(1)
    assert b.record_failure("x") and b.tripped
    b.reset()
    assert not b.tripped and b.reason is None and b.consecutive == 0
    assert b.record_failure("y") and b.reason == "y"


def test_zero_never_trips():
    b = CircuitBreaker(0)
    assert not any(b.record_failure(str(i)) for i in range(100)) and not b.tripped


def test_negative_is_refused():
    with pytest.raises(ValueError, match="trip_after"):
        CircuitBreaker(-1)
