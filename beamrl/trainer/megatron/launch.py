"""Run a function on N local processes that form one `torch.distributed` world (CPU gloo tests and tools).

`launch(fn, world_size, args)` spawns N fresh interpreters (the `spawn` start method: no forked torch or
Megatron state), gives each the usual env (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`
on a port reserved for the run, `beamrl.net.reserve_port`) plus `OMP_NUM_THREADS=1` and
`TORCHDYNAMO_DISABLE=1`, runs `fn(*args)` on every rank and returns the list of per-rank return values
(rank order).

Failures never hang: if any rank raises, exits without a result or the whole run exceeds `timeout_s`, the
other ranks (likely blocked in a collective) are terminated and `LaunchError` is raised with the failing
rank's traceback. On a timeout, every rank still running first dumps the Python stacks of all its threads
(`faulthandler`, on SIGUSR1) and the error carries them: a hang says where each rank was. `fn` must be importable by name (a module-level function) and its arguments/results
picklable. `fn` is responsible for `torch.distributed.init_process_group` (the trainer's `initialize_parallel`
does it from the env set here).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import multiprocessing as mp

from beamrl.environ import scoped_environ
from beamrl.net import reserve_port

#: Where a rank writes its threads' stacks when the parent signals it (SIGUSR1) on a timeout.
STACKS = "rank{rank}.stacks"
#: How long the ranks get to write their stacks after the signal.
STACK_DUMP_S = 2.0
#: Characters of each rank's stacks kept in the error (the innermost frames are at the end of each thread's block).
STACK_CHARS = 6000

#: Environment every rank gets unless the caller overrides it (CPU is shared; compiles cost seconds).
DEFAULT_ENV = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "MKL_NUM_THREADS": "1"}


class LaunchError(RuntimeError):
    """A rank failed, died or timed out. `rank` is the first failing rank (None on a global timeout)."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str | None = None):
        self.rank, self.remote_traceback = rank, remote_traceback
        super().__init__(message if remote_traceback is None else f"{message}\n--- rank {rank} traceback ---\n"
                                                                   f"{remote_traceback}")


def set_one_rank_world_env() -> None:
    """Environment for a 1-rank world in this process. An inherited MASTER_PORT (a parent's live store) would
    collide, so every variable is set, not defaulted. MASTER_PORT=0: rank 0 hosts the store and no other rank
    has to find it, so the OS picks the port when the store binds (no window for another process to take it)."""
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0"})


def _rank_main(fn: Callable[..., Any], args: tuple, rank: int, world_size: int, env: dict[str, str],
               result_dir: str) -> None:
    """Child entry point: set env, run fn, write ("ok", result) or ("error", traceback) to rank{r}.pkl."""
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    out = Path(result_dir) / f"rank{rank}.pkl"
    tmp = out.with_suffix(".tmp")
    stacks = open(Path(result_dir) / STACKS.format(rank=rank), "w")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the parent asks on a timeout
    try:  # OMP_NUM_THREADS from env caps torch's threads at its import (inside fn)
        payload = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - everything must reach the parent, including SystemExit
        payload = ("error", traceback.format_exc())
    try:
        data = pickle.dumps(payload)
    except Exception:  # the result is not picklable: report that instead of dying silently
        data = pickle.dumps(("error", "result of rank %d is not picklable:\n%s" % (rank, traceback.format_exc())))
    tmp.write_bytes(data)
    tmp.rename(out)  # atomic: the parent never reads a half-written file
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown only; the result is already written
        pass


def launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *, timeout_s: float = 120.0,
           env: dict[str, str] | None = None, poll_s: float = 0.05) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned ranks; return their results in rank order.

    Raises `LaunchError` (with the remote traceback) as soon as one rank fails or dies, or when `timeout_s`
    elapses; all ranks are terminated (then killed) before it returns or raises."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    child_env = dict(DEFAULT_ENV)
    # Rank 0's store binds the port; the reservation keeps every other process off it until the run is over.
    reserved = reserve_port("127.0.0.1")
    child_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(reserved.port)})
    child_env.update(env or {})
    ctx = mp.get_context("spawn")
    with reserved, tempfile.TemporaryDirectory(prefix="beamrl-launch-") as result_dir:
        procs = [ctx.Process(target=_rank_main, args=(fn, tuple(args), r, world_size, child_env, result_dir),
                             name=f"beamrl-rank{r}", daemon=True) for r in range(world_size)]
        try:
            for r, p in enumerate(procs):
                # The env must exist before the child's interpreter imports anything (unpickling `fn` imports
                # its module, often torch): torch reads OMP_NUM_THREADS and TORCHDYNAMO_DISABLE at import.
                with scoped_environ({**child_env, "RANK": str(r), "LOCAL_RANK": str(r),
                                       "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}):
                    p.start()
            results = _wait(procs, Path(result_dir), timeout_s, poll_s)
        except BaseException:
            _teardown(procs, grace_s=0.0)  # the others are likely blocked in a collective with the dead rank
            raise
        _teardown(procs)
        return results




def _read(path: Path) -> tuple[str, Any]:
    # Results of this launch's own children, in its private (0700) temporary directory: IPC, not a checkpoint.
    return pickle.loads(path.read_bytes())


def _wait(procs: list, result_dir: Path, timeout_s: float, poll_s: float) -> list[Any]:
    world = len(procs)
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    while len(results) < world:
        for r, p in enumerate(procs):
            if r in results:
                continue
            path = result_dir / f"rank{r}.pkl"
            if path.exists():
                status, value = _read(path)
                if status == "error":
                    r, value = _first_error(result_dir, world)
                    raise LaunchError(f"rank {r} of {world} raised", rank=r, remote_traceback=value)
                results[r] = value
            elif not p.is_alive():
                if path.exists():  # finished between the two checks
                    continue
                raise LaunchError(f"rank {r} of {world} died with exit code {p.exitcode} before returning a "
                                  f"result (killed by a signal or out of memory?)", rank=r)
        if len(results) == world:
            break
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if r not in results]
            raise LaunchError(f"timed out after {timeout_s:.0f} s waiting for ranks {missing} of {world} "
                              f"(a collective probably hangs){_stacks(procs, missing, result_dir)}")
        time.sleep(poll_s)
    return [results[r] for r in range(world)]


def _stacks(procs: list, ranks: list[int], result_dir: Path) -> str:
    """The Python stacks of `ranks` that are still running (each dumps them on SIGUSR1), for a timeout's error."""
    asked = []
    for r in ranks:
        p = procs[r]
        if p.pid is not None and p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
                asked.append(r)
            except ProcessLookupError:
                pass
    if not asked:
        return ""
    time.sleep(STACK_DUMP_S)
    parts = []
    for r in asked:
        try:
            text = (result_dir / STACKS.format(rank=r)).read_text()
        except OSError as e:
            text = f"(no stacks: {e})"
        parts.append(f"\n--- rank {r}: Python stacks of every thread ---\n{text[-STACK_CHARS:] or '(none written)'}")
    return "".join(parts)


def _first_error(result_dir: Path, world: int, settle_s: float = 1.0) -> tuple[int, str]:
    """The root-cause failure: when one rank raises, its peers soon fail too ("connection closed by peer") and
    may be polled first. Wait briefly, then report the error written first."""
    time.sleep(settle_s)
    errors = []
    for r in range(world):
        path = result_dir / f"rank{r}.pkl"
        if path.exists():
            status, value = _read(path)
            if status == "error":
                errors.append((path.stat().st_mtime_ns, r, value))
    _, rank, value = min(errors)
    return rank, value


def _teardown(procs: list, grace_s: float = 5.0) -> None:
    """Join finished ranks; terminate (SIGTERM) then kill (SIGKILL) any still alive. Only our own children."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
