"""Throughput of the reward worker pool: per-call overhead (exact_match), DAPO math verification, async
concurrency (a judge that waits 50 ms per call), and what a hanging component costs a batch.

    .venv/bin/python -m benchmarks.reward_pool [--samples 512] [--workers 1 2]

(Run with -m from the repository root: the workers import this module's functions by path.)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from beamrl.rewards import RewardComponentConfig, RewardManager, RewardPoolConfig, RewardSample
from beamrl.rewards.invoke import invoke


async def judge_50ms(completion: str) -> float:
    """Stands in for an LLM judge: waits 50 ms on I/O."""
    await asyncio.sleep(0.05)
    return 1.0


def hangs(completion: str) -> float:
    time.sleep(600)
    return 1.0


def math_samples(n: int, seed: int = 0) -> list[RewardSample]:
    rng = random.Random(seed)
    forms = [
        lambda a, b: (f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a / b:.6g}"),
        lambda a, b: (f"Answer: {a + b}", str(a + b)),
        lambda a, b: (f"\\boxed{{{a}\\sqrt{{2}}}}", f"\\sqrt{{{2 * a * a}}}"),
        lambda a, b: (f"\\boxed{{{a * b + 1}}}", str(a * b)),  # wrong
    ]
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        completion, gold = rng.choice(forms)(a, b)
        out.append(RewardSample(completion="Let me think... " * 20 + completion, ground_truth=gold))
    return out


def timed(components: list[RewardComponentConfig], samples: list[RewardSample]) -> tuple[float, float, dict]:
    """(start s, batch s, metrics) of one batch after every worker has started."""
    t0 = time.perf_counter()
    with RewardManager(components, RewardPoolConfig(batch_timeout_s=600), log=lambda _: None) as rm:
        rm.wait_ready()
        start = time.perf_counter() - t0
        t1 = time.perf_counter()
        res = rm.score(samples)
        return start, time.perf_counter() - t1, res.metrics


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    samples = math_samples(args.samples)
    here = __name__ if __name__ != "__main__" else "benchmarks.reward_pool"

    t0 = time.perf_counter()
    for s in samples:
        invoke("beamrl.rewards.math:dapo_math", {"completion": s.completion, "ground_truth": s.ground_truth})
    inproc = time.perf_counter() - t0
    print(f"{'setup':<46} {'workers':>7} {'start s':>8} {'batch s':>8} {'calls/s':>9} {'mean':>6}")
    print(f"{'dapo_math in-process (no pool)':<46} {'-':>7} {'-':>8} {inproc:>8.2f} {len(samples) / inproc:>9.0f}")

    def row(label: str, workers: int, comps: list[RewardComponentConfig], key: str) -> dict:
        start, batch, m = timed(comps, samples)
        print(f"{label:<46} {workers:>7} {start:>8.2f} {batch:>8.2f} {len(samples) / batch:>9.0f} {m[key]:>6.3f}")
        return m

    for fn in ("exact_match", "dapo_math"):
        for w in args.workers:
            row(f"{fn} in pool", w, [RewardComponentConfig(name="r", fn=fn, num_workers=w)], "reward/r/mean")
    for conc in (1, 16):
        comp = RewardComponentConfig(name="j", fn=f"{here}:judge_50ms", num_workers=1, max_concurrency=conc)
        row(f"async judge 50 ms, max_concurrency {conc}", 1, [comp], "reward/j/mean")
    w = args.workers[-1]
    comps = [RewardComponentConfig(name="r", fn="dapo_math", num_workers=w),
             RewardComponentConfig(name="hang", fn=f"{here}:hangs", timeout_s=2.0)]
    m = row("dapo_math + a hanging component (2 s timeout)", w, comps, "reward/r/mean")
    print(f"  hanging component: timeouts {m['reward/hang/timeouts']:.0f}, skipped {m['reward/hang/skipped']:.0f} "
          f"(breaker tripped: {m['reward/hang/breaker_tripped']:.0f}); dapo_math timeouts {m['reward/r/timeouts']:.0f}")


if __name__ == "__main__":
    main()
