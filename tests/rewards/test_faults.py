"""Reward plugins under faults: one bad component never costs the others their scores or the batch its time.

Wall-time bounds here are generous (a loaded 2-core CI box): they separate "about one per-call timeout" from
"the batch timeout", nothing finer. Everything else is asserted on exact counts and scores.
"""

import time

import pytest

from beamrl.rewards import RewardComponentConfig, RewardManager, RewardPoolConfig, RewardSample

from . import sample_reward_fns as fns

M = fns.__name__


def comp(name, fn, **kw):
    return RewardComponentConfig(name=name, fn=f"{M}:{fn}", **kw)


def samples(completions, truths=None):
    truths = truths or ["x"] * len(completions)
    return [RewardSample(completion=c, ground_truth=g) for c, g in zip(completions, truths, strict=True)]


def statuses(res, name):
    return [s.status for s in res.components[name]]


def test_hanging_component_costs_the_others_nothing_and_the_batch_about_one_timeout():
    """The issue's scenario: match (with a metric), raise-on-some, hang (2 s per-call timeout), async 0.5."""
    comps = [
        comp("match", "match_with_metric"),
        comp("raiser", "raises_on_odd"),
        comp("hang", "always_hangs", timeout_s=2.0),
        comp("async", "async_half"),
    ]
    completions = [str(i % 13) for i in range(64)]
    truths = [str(i % 7) for i in range(64)]
    batch = samples(completions, truths)
    notices = []
    results, walls = [], []
    with RewardManager(comps, RewardPoolConfig(batch_timeout_s=60.0), log=notices.append) as rm:
        rm.wait_ready()
        hang_workers = rm.plans[2].num_workers
        for _ in range(2):  # two steps: the breaker trips in each; the second one retries first
            t0 = time.monotonic()
            results.append(rm.score(batch))
            walls.append(time.monotonic() - t0)

    match = [1.0 if c == g else 0.0 for c, g in zip(completions, truths)]
    raises = [len(c) % 2 == 1 for c in completions]
    for res, wall in zip(results, walls):
        m = res.metrics
        # Healthy components: every score exact, nothing timed out.
        assert res.scores("match") == match and m["reward/match/timeouts"] == 0 and m["reward/match/errors"] == 0
        assert m["reward/match/length"] == sum(map(len, completions)) / 64  # its own metric survives
        assert res.scores("async") == [0.5] * 64 and m["reward/async/mean"] == 0.5
        assert m["reward/async/timeouts"] == 0 and m["reward/async/skipped"] == 0
        # The raising component: exactly its own exceptions, each a cheap failure that never trips the breaker.
        assert statuses(res, "raiser") == ["error" if r else "ok" for r in raises]
        assert m["reward/raiser/errors"] == sum(raises) and m["reward/raiser/timeouts"] == 0
        assert m["reward/raiser/breaker_tripped"] == 0
        # The hanging component: its first calls time out together, the breaker skips the rest.
        assert m["reward/hang/breaker_tripped"] == 1
        assert 3 <= m["reward/hang/timeouts"] <= hang_workers
        assert m["reward/hang/timeouts"] + m["reward/hang/skipped"] == 64
        assert res.scores("hang") == [0.0] * 64  # on_error="zero"
        assert "did not return within 2 s" in res.breaker_trips["hang"]
        assert res.totals == [a + (0.0 if r else 1.0) + 0.0 + 0.5 for a, r in zip(match, raises)]
        # Bounded by the per-call timeouts (about one, plus restarting the hung workers: ~5 s idle), not by the 60 s
        # batch timeout. The bound leaves room for a loaded 2-core machine (a helper saw 20 s at load 22).
        assert wall < 45.0, f"a batch took {wall:.1f} s; the hanging component's per-call timeout is 2 s"
    # Once per batch: the trip (naming the component and its first failure), then the retry, then the trip.
    breaker = [n for n in notices if "'hang'" in n]
    assert len(breaker) == 3, notices
    assert all("did not return within 2 s" in n and "tripped after 3" in n for n in breaker[::2])
    assert breaker[1] == "reward 'hang': retrying in this batch (its breaker had tripped in the previous one)"
    # and once per batch the raising component's failures, with the first one (the tripped component has no such line)
    raised = [n for n in notices if "'raiser'" in n]
    assert len(raised) == 2 and len(notices) == 5, notices
    assert all(f"{sum(raises)} of its 64 calls in this batch failed ({sum(raises)} errors" in n
               and "cannot grade" in n for n in raised)


@pytest.mark.parametrize("fn, bad, why", [("segfaults_on_crash", "crash", "SIGSEGV"),
                                          ("dies_on_die", "die", "exit code 3")])
def test_a_crashing_plugin_costs_only_its_calls_and_its_restarted_worker(fn, bad, why):
    comps = [comp("len", "needs_completion"), comp("crashy", fn, num_workers=2)]
    mixed = [bad, "a", "bb", bad, "ccc", "dddd"]  # never 3 crashes in a row: the breaker stays closed
    notices = []
    with RewardManager(comps, log=notices.append) as rm:
        first = rm.score(samples(mixed))
        all_bad = rm.score(samples([bad] * 10))
        again = rm.score(samples(mixed))
        restarts = rm.pool.restarts
    for res, batch in ((first, mixed), (all_bad, [bad] * 10), (again, mixed)):
        assert res.scores("len") == [float(len(c)) for c in batch]  # the healthy component: exact, every time
        assert res.metrics["reward/len/errors"] + res.metrics["reward/len/crashes"] == 0
    for res in (first, again):
        assert statuses(res, "crashy") == ["crash" if c == bad else "ok" for c in mixed]
        assert res.metrics["reward/crashy/crashes"] == 2 and res.metrics["reward/crashy/breaker_tripped"] == 0
        assert why in res.components["crashy"][0].message
    # Every call crashes: the breaker trips after 3 crashes in a row and the rest are skipped, not crashed.
    m = all_bad.metrics
    assert m["reward/crashy/breaker_tripped"] == 1 and 3 <= m["reward/crashy/crashes"] <= 4
    assert m["reward/crashy/crashes"] + m["reward/crashy/skipped"] == 10
    assert restarts["len"] == 0 and restarts["crashy"] == 2 + m["reward/crashy/crashes"] + 2
    assert sum("circuit breaker tripped after" in n for n in notices) == 1
    assert sum("retrying" in n for n in notices) == 1


def test_async_calls_run_concurrently_up_to_max_concurrency():
    comps = [comp("peak", "async_peak", num_workers=1, max_concurrency=8)]
    with RewardManager(comps) as rm:
        rm.wait_ready()
        res = rm.score(samples([str(i) for i in range(16)]))
    peaks = [s.metrics["peak"] for s in res.components["peak"]]
    assert max(peaks) == 8  # concurrent (a one-at-a-time worker gives 1), never above the bound
    assert len({s.metrics["pid"] for s in res.components["peak"]}) == 1  # all on the one worker


def test_an_async_timeout_cancels_only_that_call():
    comps = [comp("ah", "async_hangs_on_hang", timeout_s=1.0, num_workers=1, max_concurrency=8)]
    with RewardManager(comps) as rm:
        res = rm.score(samples(["hang", "a", "b", "hang", "c"]))
        assert rm.pool.restarts["ah"] == 0  # cancelled inside the worker, which lives on
    assert statuses(res, "ah") == ["timeout", "ok", "ok", "timeout", "ok"]
    assert "the call was cancelled" in res.components["ah"][0].message


def test_an_async_function_that_blocks_its_event_loop_gets_its_worker_killed():
    comps = [comp("ab", "async_blocks_on_block", timeout_s=1.0, num_workers=1, max_concurrency=4)]
    with RewardManager(comps) as rm:
        blocked = rm.score(samples(["block"]))
        after = rm.score(samples(["a", "b"]))
        assert rm.pool.restarts["ab"] == 1
    assert statuses(blocked, "ab") == ["timeout"]
    assert "event loop did not answer" in blocked.components["ab"][0].message
    assert statuses(after, "ab") == ["ok", "ok"]


def test_the_batch_timeout_cuts_only_the_component_that_is_too_slow():
    comps = [comp("slow", "slow", timeout_s=10.0, num_workers=1), comp("fast", "needs_completion", num_workers=1)]
    batch = samples(["a", "bb", "ccc", "dddd", "eeeee", "ffffff"])
    with RewardManager(comps, RewardPoolConfig(batch_timeout_s=4.0)) as rm:
        rm.wait_ready()
        res = rm.score(batch)
    assert res.scores("fast") == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and res.metrics["reward/fast/timeouts"] == 0
    slow = statuses(res, "slow")
    assert slow[0] == "ok" and slow[-1] == "timeout" and set(slow) == {"ok", "timeout"}  # 1.5 s a call, 4 s limit
    assert "not started: this component's own earlier calls" in res.components["slow"][-1].message


def test_a_disabled_breaker_lets_every_call_run():
    comps = [comp("hang", "always_hangs", timeout_s=1.0, num_workers=2, breaker_after=0)]
    with RewardManager(comps) as rm:
        res = rm.score(samples(["a"] * 4))
    assert statuses(res, "hang") == ["timeout"] * 4 and res.metrics["reward/hang/breaker_tripped"] == 0


def test_calls_queued_on_a_sync_worker_keep_their_own_timeout_and_outlive_a_hang():
    """A sync worker is sent several calls at once (`pool.SYNC_QUEUE_DEPTH`); each call's timeout counts from when it
    starts, and the calls queued behind one that hangs run on the replacement worker."""
    comps = [comp("slow", "slow", timeout_s=2.5, num_workers=1),
             comp("hang", "sleeps_on_hang", timeout_s=1.0, num_workers=1)]
    with RewardManager(comps) as rm:
        rm.wait_ready()
        res = rm.score(samples(["a", "hang", "b", "c"]))
        restarts = rm.pool.restarts
    assert statuses(res, "slow") == ["ok"] * 4  # 4 x 1.5 s on one worker: 6 s in all, each call within its 2.5 s
    assert statuses(res, "hang") == ["ok", "timeout", "ok", "ok"]
    assert "did not return within 1 s" in res.components["hang"][1].message
    assert restarts == {"slow": 0, "hang": 1}


def test_a_sync_worker_queues_calls_only_within_the_depth_and_byte_bounds():
    """Queued calls must fit the pipe (a send that blocks behind a hanging call would hang the trainer): an idle
    worker takes a full message (or one call of any size), a busy sync worker more only while its unanswered
    messages stay within the bounds, and only once half of them is free again."""
    from beamrl.rewards.plan import ComponentPlan
    from beamrl.rewards.pool import SYNC_QUEUE_BYTES, SYNC_QUEUE_DEPTH, _Call, _ComponentWorkers, _Worker

    sync = _ComponentWorkers(ComponentPlan("s", f"{M}:slow", False, 5.0, 1, 1, 3))
    w = _Worker(proc=None, conn=None, started=0.0)
    assert sync.room(w) == (SYNC_QUEUE_DEPTH, SYNC_QUEUE_BYTES)  # idle
    w.calls[0] = _Call(0, 0.0, 1.0, nbytes=SYNC_QUEUE_BYTES // 4)
    assert sync.room(w) == (SYNC_QUEUE_DEPTH - 1, SYNC_QUEUE_BYTES * 3 // 4)
    w.calls[0].nbytes = SYNC_QUEUE_BYTES // 2 + 1
    assert sync.room(w) == (0, 0)  # less than half of the bytes free
    w.calls[0].nbytes = 1
    for i in range(1, SYNC_QUEUE_DEPTH // 2 + 1):
        w.calls[i] = _Call(i, 0.0, None, nbytes=1)
    assert sync.room(w) == (0, 0)  # less than half of the depth free
    concurrent = _ComponentWorkers(ComponentPlan("a", f"{M}:async_len", True, 5.0, 1, 4, 3))
    w = _Worker(proc=None, conn=None, started=0.0, calls={i: _Call(i, 0.0, 1.0) for i in range(3)})
    assert concurrent.room(w) == (1, None)  # async workers: up to max_concurrency calls, any size (always read)


def _piped_pool(num_workers, max_concurrency=1):
    """A pool of `num_workers` stand-in workers (ready, reading the other ends of real pipes), for `_dispatch`."""
    import multiprocessing as mp

    from beamrl.rewards.plan import ComponentPlan
    from beamrl.rewards.pool import RewardWorkerPool, _Worker

    plan = ComponentPlan("s", f"{M}:slow", max_concurrency > 1, 5.0, num_workers, max_concurrency, 3)
    pool = RewardWorkerPool([plan])
    c = pool._components["s"]
    ends = []
    for _ in range(num_workers):
        parent, child = mp.Pipe(duplex=True)
        c.workers.append(_Worker(proc=None, conn=parent, started=0.0, ready=True))
        ends.append(child)
    return pool, c, ends


def _messages(end):
    out = []
    while end.poll():
        out.append(end.recv())
    return out


def test_a_batch_reaches_each_sync_worker_as_one_message_and_only_its_first_call_is_timed():
    """64 calls over 3 idle sync workers: one message per worker with an equal share, every call once, in order;
    on each worker only the first call runs (has a deadline), the others start as the one before them answers."""
    from beamrl.rewards.pool import RewardTask

    pool, c, ends = _piped_pool(3)
    tasks = [RewardTask("s", {"completion": str(i)}) for i in range(64)]
    c.pending.extend(range(64))
    pool._dispatch(c, tasks, [None] * 64)
    messages = [_messages(e) for e in ends]
    assert [len(m) for m in messages] == [1, 1, 1]
    sent = [[i for i, _ in m[0][1]] for m in messages]
    assert sorted(len(ids) for ids in sent) == [21, 21, 22] and sorted(sum(sent, [])) == list(range(64))
    assert all(ids == sorted(ids) for ids in sent) and not c.pending
    for w, ids in zip(c.workers, sent):
        assert list(w.calls) == ids
        assert [w.calls[i].deadline is not None for i in ids] == [True] + [False] * (len(ids) - 1)


def test_an_unpicklable_sample_fails_only_its_own_call_in_a_batch():
    from beamrl.rewards.pool import RewardTask

    pool, c, ends = _piped_pool(1)
    tasks = [RewardTask("s", {"completion": "a"}), RewardTask("s", {"completion": lambda: 0}),
             RewardTask("s", {"completion": "b"})]
    c.pending.extend(range(3))
    results = [None] * 3
    pool._dispatch(c, tasks, results)
    (message,) = _messages(ends[0])
    assert [i for i, _ in message[1]] == [0, 2]
    assert results[1].status == "error" and "cannot send the sample to a reward worker" in results[1].message
    assert results[0] is None and results[2] is None
