"""The multi-process launcher: results in rank order, and every failure mode ends the run with a traceback."""

import os
import time

import psutil
import pytest

from beamrl.trainer.megatron.launch import LaunchError, launch


def _env_and_allreduce(offset):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]), "sum": t.item(),
            "threads": os.environ["OMP_NUM_THREADS"], "dynamo": os.environ["TORCHDYNAMO_DISABLE"]}


def _rank1_raises():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 blocks here forever: the launcher must kill it


def _rank0_dies():
    if os.environ["RANK"] == "0":
        os._exit(3)
    time.sleep(60)


def _sleeps():
    time.sleep(600)


def test_results_in_rank_order_with_env():
    out = launch(_env_and_allreduce, 2, (10,), timeout_s=300)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world"] == 2 and o["sum"] == 21.0 for o in out)
    assert all(o["threads"] == "1" and o["dynamo"] == "1" for o in out)


def test_a_raising_rank_fails_the_run_with_its_traceback():
    with pytest.raises(LaunchError, match="boom on rank one") as info:
        launch(_rank1_raises, 2, timeout_s=300)
    assert info.value.rank == 1 and "ValueError" in info.value.remote_traceback  # not the 300 s timeout


def test_a_dying_rank_fails_the_run():
    with pytest.raises(LaunchError, match="rank 0 of 2 died with exit code 3"):
        launch(_rank0_dies, 2, timeout_s=300)


def test_timeout_kills_all_ranks():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="timed out") as info:
        launch(_sleeps, 2, timeout_s=8)
    assert time.monotonic() - t0 < 120  # the ranks sleep 600 s: they were killed, not waited for
    for r in (0, 1):  # the error says where each rank hung: its threads' stacks, dumped on the way out
        block = str(info.value).split(f"--- rank {r}: Python stacks of every thread ---")[1]
        assert 'in _sleeps' in block.split("--- rank")[0], str(info.value)[-3000:]
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline())]  # not the tracker
    assert not left, f"ranks still alive after the timeout: {left}"


def test_every_launch_in_the_tests_times_out_before_pytest_does():
    """A launch's own timeout must fire first: pytest-timeout's kill loses the ranks' stacks and names no rank (a
    checkpoint test's 900 s launch hung once under the 600 s pytest limit and said only "Timeout")."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    limit = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
    calls = [(str(f.relative_to(root)), int(m.group(1))) for f in (root / "tests").rglob("*.py")
             for m in re.finditer(r"\blaunch\([^\n]*?timeout_s=(\d+)", f.read_text())]
    assert calls, "no launch(..., timeout_s=N) found: the pattern is out of date"
    assert [(f, t) for f, t in calls if t >= limit] == [], f"launch timeouts must stay under pytest's {limit} s"
