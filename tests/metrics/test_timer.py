from beamrl.metrics import Timer


def test_timer_accumulates_and_pops():
    ticks = iter([0.0, 1.5, 10.0, 10.25, 20.0, 22.0])
    t = Timer(clock=lambda: next(ticks))
    with t("rollout"):
        pass
    with t("sync"):
        pass
    with t("rollout"):
        pass
    assert t.seconds("rollout") == 3.5
    assert t.pop() == {"time/rollout_s": 3.5, "time/sync_s": 0.25}
    assert t.pop() == {}
