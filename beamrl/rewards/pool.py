"""A process pool for reward calls with a hard per-call timeout: a call that overruns has its worker
killed and replaced, so one hanging verifier can never hang the run.

`concurrent.futures.ProcessPoolExecutor` cannot cancel a running call or kill one worker, hence this
small pool of spawn-started processes, each on its own Pipe.

Example:
    >>> with RewardWorkerPool(num_workers=2) as pool:  # doctest: +SKIP
    ...     outcomes = pool.run([RewardTask("beamrl.rewards.exact:exact_match",
    ...                                     {"completion": "4", "ground_truth": "4"}, timeout_s=5.0)])
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from beamrl.rewards.invoke import CallOutcome
from beamrl.rewards.worker import worker_main


class RewardPoolError(RuntimeError):
    """The pool itself failed (workers cannot start or load the functions); not a per-sample failure."""


@dataclass(frozen=True)
class RewardTask:
    ref: str
    call_kwargs: dict[str, Any]
    timeout_s: float


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    started: float
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0
    dispatched: float = 0.0


class RewardWorkerPool:
    """num_workers spawn processes; `preload` refs are imported at start. Use as a context manager."""

    def __init__(self, num_workers: int = 2, preload: Sequence[str] = (), start_timeout_s: float = 120.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s={start_timeout_s} must be > 0")
        self.num_workers = num_workers
        self.preload = tuple(preload)
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")  # fork would copy the trainer's threads, CUDA and locks
        self._workers: list[_Worker] = []
        self.restarts = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> RewardWorkerPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=worker_main, args=(child, self.preload, os.getpid()), daemon=True, name="beamrl-reward")
        proc.start()
        child.close()
        return _Worker(proc=proc, conn=parent, started=time.monotonic())

    def _kill(self, w: _Worker) -> None:
        if w.proc.is_alive():
            try:  # the worker leads its own process group (see worker.py): end its subprocesses too
                os.killpg(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # not yet its own group leader
                w.proc.kill()
        w.proc.join(timeout=10)
        w.conn.close()

    def _replace(self, w: _Worker) -> None:
        self._kill(w)
        self._workers[self._workers.index(w)] = self._spawn()
        self.restarts += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask idle workers to stop, wait up to timeout_s, kill what is left (busy or still starting
        workers are killed at once: their work is no longer wanted)."""
        for w in self._workers:
            if w.ready and w.task is None:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
            else:
                self._kill(w)
        deadline = time.monotonic() + timeout_s
        for w in self._workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(w)
        self._workers = []

    # -- running ---------------------------------------------------------------------------------
    def run(self, tasks: Sequence[RewardTask], batch_timeout_s: float | None = None) -> list[CallOutcome]:
        """Run every task; outcomes in task order. Each call is bounded by its task's timeout_s, the whole
        batch (when given) by batch_timeout_s; overruns become "timeout" outcomes."""
        if not self._workers:
            raise RewardPoolError("the reward pool is not started; use it as a context manager")
        results: list[CallOutcome | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        batch_deadline = None if batch_timeout_s is None else time.monotonic() + batch_timeout_s

        while pending or any(w.task is not None for w in self._workers):
            self._dispatch(tasks, pending, results)
            now = time.monotonic()
            deadlines = [w.deadline for w in self._workers if w.task is not None]
            deadlines += [w.started + self.start_timeout_s for w in self._workers if not w.ready]
            if batch_deadline is not None:
                deadlines.append(batch_deadline)
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            handles = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
            wait(handles, timeout=timeout)
            self._collect(results)
            self._enforce_deadlines(tasks, results)
            if batch_deadline is not None and time.monotonic() >= batch_deadline:
                self._abandon_batch(tasks, pending, results, batch_timeout_s)
        return [r if r is not None else CallOutcome("error", message="lost result (bug)") for r in results]

    def _dispatch(self, tasks: Sequence[RewardTask], pending: deque, results: list) -> None:
        for w in self._workers:
            if not pending:
                return
            if not w.ready or w.task is not None:
                continue
            i = pending.popleft()
            t = tasks[i]
            try:
                w.conn.send(("call", i, t.ref, t.call_kwargs))
            except (OSError, BrokenPipeError):  # worker died between calls: replace, retry the task
                pending.appendleft(i)
                self._replace(w)
                continue
            except Exception as e:  # unpicklable sample fields: nothing was written to the pipe
                results[i] = CallOutcome(
                    "error", message=f"cannot send the sample to a reward worker: {type(e).__name__}: {e}"
                )
                continue
            w.task, w.dispatched, w.deadline = i, time.monotonic(), time.monotonic() + t.timeout_s

    def _collect(self, results: list) -> None:
        for w in list(self._workers):
            dead = False
            try:
                while w.conn.poll():
                    msg = w.conn.recv()
                    if msg[0] == "ready":
                        if msg[1] is not None:
                            raise RewardPoolError(f"reward worker could not load the reward functions: {msg[1]}")
                        w.ready = True
                    else:
                        _, task_id, outcome = msg
                        if task_id == w.task:
                            results[task_id] = outcome
                            w.task = None
            except (EOFError, OSError):  # the worker's end is closed: it exited
                dead = True
            if dead or not w.proc.is_alive():
                w.proc.join(timeout=10)
                if w.task is not None:
                    results[w.task] = CallOutcome(
                        "error",
                        message=f"reward worker process died (exit code {w.proc.exitcode}) during the call",
                        elapsed_s=time.monotonic() - w.dispatched,
                    )
                elif not w.ready:
                    raise RewardPoolError(
                        f"reward worker exited during start-up (exit code {w.proc.exitcode}); see its traceback on "
                        "stderr. Workers are spawned, which re-imports the main script: guard a script's top-level "
                        "code with `if __name__ == '__main__':`"
                    )
                self._replace(w)

    def _enforce_deadlines(self, tasks: Sequence[RewardTask], results: list) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.task is not None and now >= w.deadline:
                t = tasks[w.task]
                results[w.task] = CallOutcome(
                    "timeout",
                    message=f"{t.ref} did not return within {t.timeout_s:g} s; its worker was killed",
                    elapsed_s=t.timeout_s,
                )
                self._replace(w)
            elif not w.ready and now >= w.started + self.start_timeout_s:
                raise RewardPoolError(f"reward worker did not start within {self.start_timeout_s:g} s")

    def _abandon_batch(self, tasks: Sequence[RewardTask], pending: deque, results: list, limit: float | None) -> None:
        msg = f"reward batch did not finish within {limit:g} s"
        for w in list(self._workers):
            if w.task is not None:
                results[w.task] = CallOutcome("timeout", message=msg, elapsed_s=time.monotonic() - w.dispatched)
                self._replace(w)
        while pending:
            results[pending.popleft()] = CallOutcome("timeout", message=msg + " (not started)")
