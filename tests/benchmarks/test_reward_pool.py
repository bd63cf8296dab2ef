"""CPU smoke run of benchmarks/reward_pool.py: every row runs and the fault row shows the isolation."""

import re

from benchmarks import reward_pool as bench


def test_reward_pool_benchmark_smoke(capsys):
    bench.main(["--samples", "8", "--workers", "1"])
    out = capsys.readouterr().out
    assert "async judge 50 ms, max_concurrency 16" in out and "dapo_math in pool" in out
    m = re.search(r"hanging component: timeouts (\d+), skipped (\d+) \(breaker tripped: 1\); dapo_math timeouts 0", out)
    assert m and int(m[1]) >= 3 and int(m[1]) + int(m[2]) == 8, out
