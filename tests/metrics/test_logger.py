import pytest

from beamrl.metrics.logger import MetricsLogger, MultiLogger, check_metrics


class Recording:
    def __init__(self):
        self.rows, self.closed = [], False

    def log(self, step, metrics):
        self.rows.append((step, metrics))

    def close(self):
        self.closed = True


class Broken(Recording):
    def close(self):
        raise OSError("disk gone")


def test_multiplexer_fans_out_and_closes_all():
    a, b = Recording(), Broken()
    assert isinstance(a, MetricsLogger)
    m = MultiLogger([b, a])
    m.log(3, {"reward/mean": 1})
    assert a.rows == b.rows == [(3, {"reward/mean": 1.0})]
    with pytest.raises(RuntimeError, match="Broken: disk gone"):
        m.close()
    assert a.closed


@pytest.mark.parametrize("step,metrics,words", [
    (1, {"x": "abc"}, "'x' is not a number"),
    (1, {"step": 1}, "reserved"),
    (-1, {}, "non-negative"),
    (1, {"x": float("inf")}, "infinite"),
])
def test_bad_metrics(step, metrics, words):
    with pytest.raises(ValueError, match=words):
        check_metrics(step, metrics)
