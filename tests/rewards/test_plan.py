from beamrl.rewards import RewardComponentConfig, RewardPoolConfig, load_reward_fn
from beamrl.rewards.plan import MAX_AUTO_WORKERS, default_num_workers, format_plan, plan_components

from . import sample_reward_fns as fns

M = fns.__name__


def test_default_workers_share_the_cpus_and_cover_the_breaker():
    assert default_num_workers(is_async=False, breaker_after=3, num_components=4, cpus=2) == 3  # breaker floor
    assert default_num_workers(is_async=False, breaker_after=3, num_components=2, cpus=16) == 8  # CPU share
    assert default_num_workers(is_async=False, breaker_after=0, num_components=1, cpus=256) == MAX_AUTO_WORKERS
    assert default_num_workers(is_async=False, breaker_after=0, num_components=4, cpus=2) == 1
    # async: the share alone (its calls already run concurrently inside each worker)
    assert default_num_workers(is_async=True, breaker_after=3, num_components=4, cpus=2) == 1
    assert default_num_workers(is_async=True, breaker_after=3, num_components=1, cpus=4) == 4


def test_component_count_beats_pool_count_beats_auto():
    comps = [
        RewardComponentConfig(name="own", fn=f"{M}:only_completion", num_workers=5),
        RewardComponentConfig(name="pooled", fn=f"{M}:only_completion"),
        RewardComponentConfig(name="aio", fn=f"{M}:async_len", max_concurrency=7),
    ]
    fns_ = [load_reward_fn(c.fn, c.kwargs) for c in comps]
    plans = plan_components(comps, fns_, RewardPoolConfig(num_workers=2), cpus=64)
    assert [(p.num_workers, p.max_concurrency, p.is_async) for p in plans] == [(5, 1, False), (2, 1, False),
                                                                             (2, 7, True)]
    auto = plan_components(comps, fns_, RewardPoolConfig(), cpus=64)
    assert [p.num_workers for p in auto] == [5, 8, 8]
    text = format_plan(auto, RewardPoolConfig(batch_timeout_s=42), cpus=64)
    assert "batch timeout 42 s (reward_pool.batch_timeout_s)" in text and "64 CPU(s)" in text
    assert "aio: " in text and "8 worker(s) x 7 async calls each" in text and "21 worker process(es)" in text
