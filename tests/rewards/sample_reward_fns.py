"""Reward functions used by the reward tests (imported by path from worker processes)."""

import asyncio
import os
import time

from beamrl.rewards import RewardOutput, reward


def needs_completion(completion):
    return float(len(completion))


def sees(completion, ground_truth=None, **kwargs):
    """Reports which names reached it (as metrics: 1.0 per name)."""
    return RewardOutput(score=1.0, metrics={k: 1.0 for k in ("completion", "ground_truth", *kwargs)})


def only_completion(completion):
    return 1.0


def requires_answer(completion, answer):
    return 1.0


def optional_answer(completion, answer="x"):
    return 1.0 if answer == "x" else 0.0


def with_scale(completion, scale):
    return scale * len(completion)


async def async_len(completion):
    await asyncio.sleep(0)
    return float(len(completion))


def none_for_empty(completion):
    return None if not completion else 1.0


def raises_on_bad(completion):
    if completion == "bad":
        raise ValueError("cannot grade 'bad'")
    return 1.0


def returns_string(completion):
    return "one"


def returns_nan(completion):
    return float("nan")


def sleeps_on_hang(completion):
    if completion == "hang":
        time.sleep(600)  # far beyond any test's bound: a test that waited for it fails clearly
    return 1.0


def dies_on_die(completion):
    if completion == "die":
        os._exit(3)
    return 1.0


def dies_or_raises(completion):
    if completion == "die":
        os._exit(3)
    return raises_on_bad(completion)


def with_metrics(completion):
    return RewardOutput(score=0.5, metrics={"length": float(len(completion)), "mean": 7.0})


@reward("tests.registered_len")
def registered_len(completion):
    return float(len(completion))


not_callable = 42


def hangs_in_subprocess(completion, metadata):
    """Starts a long-lived child process (as a sandboxed verifier would), records its pid, then hangs."""
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    with open(metadata["pid_file"], "w") as f:
        f.write(str(child.pid))
    child.wait()
    return 1.0


# -- misbehaving plugins for the fault-isolation tests ------------------------------------------------------


def match_with_metric(completion, ground_truth):
    """Exact match, plus the completion length as a metric."""
    score = 1.0 if completion == str(ground_truth) else 0.0
    return RewardOutput(score=score, metrics={"length": float(len(completion))})


def raises_on_odd(completion):
    """Raises on completions of odd length (quickly: an exception is a cheap failure)."""
    if len(completion) % 2:
        raise ValueError(f"cannot grade {completion!r}")
    return 1.0


def always_hangs(completion):
    time.sleep(600)
    return 1.0


async def async_half(completion):
    await asyncio.sleep(0.05)
    return 0.5


def segfaults_on_crash(completion):
    """Dereferences NULL on "crash": the worker process dies with SIGSEGV."""
    if completion == "crash":
        import ctypes

        ctypes.string_at(0)
    return 1.0


_RUNNING = 0
_PEAK = 0


async def async_peak(completion):
    """Reports, as metric "peak", the most calls this worker process has had running at once so far."""
    global _RUNNING, _PEAK
    _RUNNING += 1
    _PEAK = max(_PEAK, _RUNNING)
    try:
        await asyncio.sleep(0.5)
    finally:
        _RUNNING -= 1
    return RewardOutput(score=1.0, metrics={"peak": float(_PEAK), "pid": float(os.getpid())})


async def async_hangs_on_hang(completion):
    if completion == "hang":
        await asyncio.sleep(600)
    return 1.0


async def async_blocks_on_block(completion):
    """Blocks the event loop (a synchronous sleep inside an async function) on "block"."""
    if completion == "block":
        time.sleep(600)
    await asyncio.sleep(0)
    return 1.0


def slow(completion):
    time.sleep(1.5)
    return 1.0
