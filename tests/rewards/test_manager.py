import time

import pytest

from beamrl.processes import running
from beamrl.rewards import RewardComponentConfig, RewardError, RewardManager, RewardPoolConfig, RewardSample

from . import sample_reward_fns as fns

M = fns.__name__


def comp(name, fn, **kw):
    return RewardComponentConfig(name=name, fn=f"{M}:{fn}", **kw)


def pool(workers):
    return RewardPoolConfig(num_workers=workers)


def samples(*completions):
    return [RewardSample(completion=c, ground_truth="x") for c in completions]


def test_weighted_components_none_metrics_and_async():
    comps = [
        comp("len", "needs_completion", weight=0.5),
        comp("alen", "async_len", weight=2.0),
        comp("app", "none_for_empty", weight=10.0),
        comp("m", "with_metrics", weight=1.0),
        comp("scaled", "with_scale", kwargs={"scale": 3.0}),
    ]
    with RewardManager(comps, pool(1)) as rm:  # one worker per component
        res = rm.score(samples("ab", "", "abcd"))
    n = [2, 0, 4]
    expected = [0.5 * k + 2.0 * k + (10.0 if k else 0.0) + 0.5 + 3.0 * k for k in n]
    assert res.totals == pytest.approx(expected)
    assert res.scores("app") == [1.0, None, 1.0]  # None: not applicable, counted 0 in the total
    assert res.metrics["reward/app/mean"] == 1.0 and res.metrics["reward/app/none"] == 1.0
    assert res.metrics["reward/app/count"] == 2.0
    assert res.metrics["reward/len/mean"] == pytest.approx(2.0)
    assert res.metrics["reward/m/length"] == pytest.approx(2.0)  # the function's own metric, averaged
    assert res.metrics["reward/m/fn.mean"] == 7.0 and res.metrics["reward/m/mean"] == 0.5  # no clobbering
    assert res.metrics["reward/total/mean"] == pytest.approx(sum(expected) / 3)
    assert res.failed == [False, False, False]
    with pytest.raises(KeyError, match="components: len"):
        res.scores("nope")


def test_exceptions_and_bad_returns_are_counted_and_the_run_continues():
    comps = [
        comp("zero", "raises_on_bad", on_error="zero"),
        comp("skip", "raises_on_bad", on_error="skip"),
        comp("str", "returns_string"),
        comp("die", "dies_on_die"),
    ]
    notices = []
    with RewardManager(comps, pool(1), log=notices.append) as rm:
        res = rm.score(samples("ok", "bad", "die", "ok"))
        first_batch = list(notices)
        again = rm.score(samples("ok"))  # the pool still works after failures and a dead worker
    # every component with failed calls says so on the console, once per batch, with its first failure
    assert len(first_batch) == 4, first_batch
    zero, skip, text, die = first_batch
    assert "'zero': 1 of its 4 calls in this batch failed (1 error), " in zero  # no zero counts
    assert "on_error='skip'" in skip and "'str': 4 of its 4 calls" in text and "must return a finite float" in text
    assert "'die': 1 of its 4 calls" in die and "(1 crash)" in die and "died (exit code 3)" in die
    assert notices[4:] == [n for n in notices[4:] if "'str'" in n] and len(notices) == 5  # only str fails again
    assert res.scores("zero") == [1.0, 0.0, 1.0, 1.0]
    assert res.scores("skip") == [1.0, None, 1.0, 1.0]
    assert res.excluded == [False, True, False, False]  # only a failed "skip" component leaves a sample out
    assert res.failed == [True, True, True, True]  # ('str' fails on every sample, scored 0)
    assert res.metrics["reward/zero/errors"] == 1.0 and res.metrics["reward/zero/mean"] == 0.75
    assert res.metrics["reward/skip/errors"] == 1.0 and res.metrics["reward/skip/mean"] == 1.0
    assert res.metrics["reward/str/errors"] == 4.0
    assert "must return a finite float" in res.components["str"][0].message
    assert res.components["die"][2].status == "crash" and "died (exit code 3)" in res.components["die"][2].message
    assert res.metrics["reward/die/crashes"] == 1.0 and res.metrics["reward/die/errors"] == 0.0
    assert res.failed == [True, True, True, True]  # returns_string fails everywhere
    assert again.scores("zero") == [1.0]


def test_on_error_raise_stops():
    with RewardManager([comp("strict", "raises_on_bad", on_error="raise")], pool(1)) as rm:
        with pytest.raises(RewardError, match=r"'strict'.*sample 1.*cannot grade 'bad'"):
            rm.score(samples("ok", "bad"))


def test_hanging_function_is_killed_quickly_and_pool_shuts_down():
    with RewardManager([comp("hang", "sleeps_on_hang", timeout_s=1.0)], pool(2)) as rm:
        procs = rm.pool.processes()
        t0 = time.monotonic()
        res = rm.score(samples("hang", "ok", "ok", "hang", "ok"))
        took = time.monotonic() - t0
        procs += rm.pool.processes()
    assert took < 120, f"a 600 s hang with a 1 s timeout took {took:.1f} s"  # generous: shared 2-core CI box
    assert [c.status for c in res.components["hang"]] == ["timeout", "ok", "ok", "timeout", "ok"]
    assert res.metrics["reward/hang/timeouts"] == 2.0 and res.scores("hang")[0] == 0.0
    assert "did not return within 1 s" in res.components["hang"][0].message
    assert rm.pool.restarts["hang"] >= 2
    assert not any(p.is_alive() for p in procs)  # clean shutdown: no worker left behind


def test_batch_timeout_bounds_the_whole_batch():
    with RewardManager([comp("hang", "sleeps_on_hang", timeout_s=500.0)], pool(1)) as rm:
        t0 = time.monotonic()
        res = rm.score(samples("hang", "ok"), batch_timeout_s=1.0)
        assert time.monotonic() - t0 < 120  # the 1 s batch bound, not the 500 s per-call one
    assert [c.status for c in res.components["hang"]] == ["timeout", "timeout"]


def test_bad_component_fails_at_construction():
    from beamrl.rewards import RewardLoadError

    with pytest.raises(RewardLoadError, match="answer"):
        RewardManager([comp("a", "requires_answer")])
    with pytest.raises(ValueError, match="cannot be pickled"):
        RewardManager([comp("a", "with_scale", kwargs={"scale": lambda: 1})])
    with pytest.raises(ValueError, match="duplicate"):
        RewardManager([comp("a", "only_completion"), comp("a", "only_completion")])


def test_timeout_also_kills_subprocesses_of_the_function(tmp_path):
    pid_file = tmp_path / "child.pid"
    with RewardManager([comp("sandbox", "hangs_in_subprocess", timeout_s=1.0)], pool(1)) as rm:
        res = rm.score([RewardSample(completion="x", metadata={"pid_file": str(pid_file)})])
    assert res.components["sandbox"][0].status == "timeout"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and running(child):
        time.sleep(0.05)
    assert not running(child), "the function's subprocess outlived its killed worker"


def test_a_failure_traceback_is_shown_once_per_component_then_its_first_line():
    notices = []
    with RewardManager([comp("zero", "raises_on_bad", on_error="zero")], pool(1), log=notices.append) as rm:
        for _ in range(3):
            rm.score(samples("bad", "ok"))
    assert len(notices) == 3
    first, *later = notices
    assert "\n" in first and "raised" in first  # the traceback under its first line, once
    assert all("\n" not in n and "raised" in n for n in later), later


def test_a_crash_without_a_traceback_does_not_use_up_the_one_traceback():
    notices = []
    with RewardManager([comp("c", "dies_or_raises", on_error="zero")], pool(1), log=notices.append) as rm:
        for batch in ("die", "bad", "bad"):
            rm.score(samples(batch, "ok"))
    crash, first_error, later_error = notices
    assert "crash" in crash and "\n" not in crash
    assert "\n" in first_error and "\n" not in later_error
