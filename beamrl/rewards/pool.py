"""Worker processes for reward calls: one set of workers per component, hard per-call timeouts, a circuit
breaker per component.

Isolation: each component's calls queue only for that component's own workers, so a component that hangs
or crashes uses up its own workers and never delays, times out or drops another component's calls. A sync
call that overruns its timeout has its worker killed (with the worker's process group) and replaced; a
worker that dies (segfault, `os._exit`) costs the calls it was running and is replaced. Async functions run
up to `max_concurrency` calls at once per worker, each cancelled at its own timeout inside the worker.

Calls travel to a worker in batches: one message holds every call the worker is given at once (an equal share of
the component's pending calls, up to `SYNC_QUEUE_DEPTH` unanswered calls and `SYNC_QUEUE_BYTES` of unanswered
messages per sync worker, so a send never blocks behind a call that hangs). A sync worker runs them one after
another and answers each as it finishes, so a batch costs one message per worker out and one small answer per call
back. Only the call the worker is running has a deadline; the next one's starts when the previous answer arrives,
so every call still gets its own `timeout_s`. When the running call overruns (or the worker dies), the calls queued
behind it never started: they go back to the component's queue for the replacement worker.

`concurrent.futures.ProcessPoolExecutor` cannot cancel a running call or kill one worker, hence this small
pool of spawn-started processes, each on its own Pipe, all driven by one `multiprocessing.connection.wait`.

Example:
    >>> plan = ComponentPlan("acc", "beamrl.rewards.exact:exact_match", False, 5.0, 2, 1, 3)
    >>> with RewardWorkerPool([plan]) as pool:  # doctest: +SKIP
    ...     run = pool.run([RewardTask("acc", {"completion": "4", "ground_truth": "4"})], batch_timeout_s=60)
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from beamrl.rewards.breaker import CircuitBreaker
from beamrl.rewards.invoke import CallOutcome
from beamrl.rewards.plan import ComponentPlan
from beamrl.rewards.worker import worker_main

# An async call is cancelled by its worker at timeout_s; the parent kills the worker only if no answer came
# this much later (the event loop is blocked, e.g. by a synchronous sleep inside an `async def`).
ASYNC_KILL_GRACE_S = 5.0
# Calls a one-at-a-time worker holds at once (the running one and those queued behind it), and the bytes of the
# messages they came in while any is unanswered: well below a pipe's buffer (64 KiB on Linux), so a send to a busy
# worker never blocks. An idle worker is reading: it takes one message of up to SYNC_QUEUE_BYTES (or a single call
# of any size).
SYNC_QUEUE_DEPTH = 64
SYNC_QUEUE_BYTES = 32 * 1024


class RewardPoolError(RuntimeError):
    """The pool itself failed (workers cannot start or load the functions); not a per-sample failure."""


@dataclass(frozen=True)
class RewardTask:
    """One call: the component (by name) and the keyword arguments for its function."""

    component: str
    call_kwargs: dict[str, Any]


@dataclass
class PoolRun:
    """outcomes: one per task, in task order. breaker_trips: component -> the failure that tripped it."""

    outcomes: list[CallOutcome]
    breaker_trips: dict[str, str]


@dataclass
class _Call:
    task: int
    dispatched: float  # when it started (a queued call of a sync worker: when the call before it answered)
    deadline: float | None  # when the parent stops waiting and kills the worker; None: queued, not started
    nbytes: int = 0  # the pickled call message


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    started: float
    ready: bool = False
    calls: dict[int, _Call] = field(default_factory=dict)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _overdue(w: _Worker, now: float) -> bool:
    return any(call.deadline is not None and now >= call.deadline for call in w.calls.values())


class _ComponentWorkers:
    """One component's workers, its queue of calls in the current batch, and its breaker."""

    def __init__(self, plan: ComponentPlan) -> None:
        self.plan = plan
        self.workers: list[_Worker] = []
        self.pending: deque[int] = deque()
        self.breaker = CircuitBreaker(plan.breaker_after)
        self.restarts = 0

    @property
    def busy(self) -> bool:
        return any(w.calls for w in self.workers)

    def room(self, w: "_Worker") -> tuple[int, int | None]:
        """How many more calls `w` takes now, and within how many bytes of message: an idle worker up to
        `SYNC_QUEUE_DEPTH` calls in `SYNC_QUEUE_BYTES` (or one call of any size: it is reading); an async one up to
        `max_concurrency` calls; a busy sync one up to `SYNC_QUEUE_DEPTH` calls while the messages it has not
        answered stay within `SYNC_QUEUE_BYTES`, so a send never blocks on a full pipe behind a call that hangs (and
        only once half of both is free again)."""
        if self.plan.max_concurrency > 1:  # its reader thread reads every message at once: no bound on bytes
            return self.plan.max_concurrency - len(w.calls), None
        calls, nbytes = SYNC_QUEUE_DEPTH - len(w.calls), SYNC_QUEUE_BYTES - sum(c.nbytes for c in w.calls.values())
        if w.calls and (2 * calls < SYNC_QUEUE_DEPTH or 2 * nbytes < SYNC_QUEUE_BYTES):
            return 0, 0  # refilled once half of it is free: more calls per message, fewer messages
        return calls, nbytes

    def start_next(self, w: "_Worker", now: float) -> None:
        """A sync worker answered its running call: the first queued call starts now, with its own deadline."""
        if self.plan.max_concurrency == 1 and w.calls:
            head = next(iter(w.calls.values()))
            if head.deadline is None:
                head.dispatched, head.deadline = now, self.call_deadline(now)

    def requeue_unstarted(self, w: "_Worker") -> None:
        """Put the calls queued on `w` that never started back at the front of the queue, in order."""
        unstarted = [i for i, call in w.calls.items() if call.deadline is None]
        for i in unstarted:
            del w.calls[i]
        self.pending.extendleft(reversed(unstarted))

    def call_deadline(self, now: float) -> float:
        return now + self.plan.timeout_s + (ASYNC_KILL_GRACE_S if self.plan.max_concurrency > 1 else 0.0)


class RewardWorkerPool:
    """Workers for each `ComponentPlan`; each loads its component's function at start. Use as a context
    manager. `start_timeout_s` bounds a worker's start (import and warmup)."""

    def __init__(self, plans: Sequence[ComponentPlan], start_timeout_s: float = 120.0) -> None:
        if not plans:
            raise ValueError("RewardWorkerPool needs at least one ComponentPlan")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s={start_timeout_s} must be > 0")
        for p in plans:
            if p.num_workers < 1 or p.max_concurrency < 1:
                raise ValueError(f"reward {p.name!r}: num_workers={p.num_workers} and max_concurrency="
                                 f"{p.max_concurrency} must be >= 1")
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")  # fork would copy the trainer's threads, CUDA and locks
        self._components = {p.name: _ComponentWorkers(p) for p in plans}
        if len(self._components) != len(plans):
            raise ValueError(f"duplicate component names in {[p.name for p in plans]}")
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> RewardWorkerPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Spawn every worker (does not wait for them: the first `run` does)."""
        for c in self._components.values():
            while len(c.workers) < c.plan.num_workers:
                c.workers.append(self._spawn(c.plan))
        self._started = True

    def wait_ready(self) -> None:
        """Block until every worker has loaded its function (each bounded by start_timeout_s); raises
        `RewardPoolError` for a worker that fails to start."""
        if not self._started:
            raise RewardPoolError("the reward pool is not started; use it as a context manager")
        comps = list(self._components.values())
        while True:
            starting = [(c, w) for c in comps for w in c.workers if not w.ready]
            if not starting:
                return
            deadline = min(w.started + self.start_timeout_s for _, w in starting)
            wait([h for _, w in starting for h in (w.conn, w.proc.sentinel)],
                 timeout=max(0.0, deadline - time.monotonic()))
            for c, w in starting:
                self._collect(c, w, [])  # a starting worker runs no calls
            for c in comps:
                self._enforce_deadlines(c, [])

    @property
    def restarts(self) -> dict[str, int]:
        """Workers replaced so far (killed at a timeout or died), per component."""
        return {name: c.restarts for name, c in self._components.items()}

    def processes(self, component: str | None = None) -> list[Any]:
        """The current worker processes (of one component, or all)."""
        comps = [self._components[component]] if component else self._components.values()
        return [w.proc for c in comps for w in c.workers]

    def _spawn(self, plan: ComponentPlan) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=worker_main, args=(child, plan.ref, plan.max_concurrency, os.getpid()),
                                 daemon=True, name=f"beamrl-reward-{plan.name}")
        proc.start()
        child.close()
        return _Worker(proc=proc, conn=parent, started=time.monotonic())

    @staticmethod
    def _kill(w: _Worker) -> None:
        if w.proc.is_alive():
            try:  # the worker leads its own process group (see worker.py): end its subprocesses too
                os.killpg(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # not yet its own group leader
                w.proc.kill()
        w.proc.join(timeout=10)
        w.conn.close()

    def _replace(self, c: _ComponentWorkers, w: _Worker) -> None:
        self._kill(w)
        c.workers[c.workers.index(w)] = self._spawn(c.plan)
        c.restarts += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask idle workers to stop, wait up to timeout_s, kill what is left (busy or still starting
        workers are killed at once: their work is no longer wanted)."""
        workers = [w for c in self._components.values() for w in c.workers]
        for w in workers:
            if w.ready and not w.calls:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
            else:
                self._kill(w)
        deadline = time.monotonic() + timeout_s
        for w in workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(w)
        for c in self._components.values():
            c.workers = []
        self._started = False

    # -- running ---------------------------------------------------------------------------------
    def run(self, tasks: Sequence[RewardTask], batch_timeout_s: float | None = None) -> PoolRun:
        """Run every task on its component's workers. Each call is bounded by its component's timeout_s,
        the whole batch (when given) by batch_timeout_s. Breakers are closed at the start of the batch."""
        if not self._started:
            raise RewardPoolError("the reward pool is not started; use it as a context manager")
        results: list[CallOutcome | None] = [None] * len(tasks)
        comps = list(self._components.values())
        for c in comps:
            c.breaker.reset()
            c.pending.clear()
        for i, t in enumerate(tasks):
            if t.component not in self._components:
                raise KeyError(f"task {i} names no reward component {t.component!r}; components: "
                               f"{', '.join(self._components)}")
            self._components[t.component].pending.append(i)
        batch_deadline = None if batch_timeout_s is None else time.monotonic() + batch_timeout_s

        while any(c.pending or c.busy for c in comps):
            for c in comps:
                self._dispatch(c, tasks, results)
            if not any(c.pending or c.busy for c in comps):
                break
            now = time.monotonic()
            deadlines = [call.deadline for c in comps for w in c.workers for call in w.calls.values()
                         if call.deadline is not None]
            deadlines += [w.started + self.start_timeout_s for c in comps for w in c.workers if not w.ready]
            if batch_deadline is not None:
                deadlines.append(batch_deadline)
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            wait([h for c in comps for w in c.workers for h in (w.conn, w.proc.sentinel)], timeout=timeout)
            for c in comps:
                for w in list(c.workers):
                    self._collect(c, w, results)
            for c in comps:
                self._enforce_deadlines(c, results)
            if batch_deadline is not None and time.monotonic() >= batch_deadline:
                self._abandon_batch(comps, results, batch_timeout_s)
        outcomes = [r if r is not None else CallOutcome("error", message="lost result (bug)") for r in results]
        return PoolRun(outcomes, {c.plan.name: c.breaker.reason for c in comps if c.breaker.tripped})

    def _dispatch(self, c: _ComponentWorkers, tasks: Sequence[RewardTask], results: list) -> None:
        """Send the component's pending calls to its workers with room, one message per worker: each takes an
        equal share of what is pending (within its room), so the calls spread over the workers."""
        if c.breaker.tripped:
            why = (f"skipped: the circuit breaker of reward {c.plan.name!r} tripped after {c.plan.breaker_after} "
                   f"consecutive timeouts/crashes in this batch (first: {c.breaker.reason})")
            while c.pending:
                results[c.pending.popleft()] = CallOutcome("skipped", message=why)
            return
        tried: set[int] = set()
        while c.pending:
            free = [(w, room) for w in c.workers if w.ready and id(w) not in tried and (room := c.room(w))[0] > 0]
            if not free:
                return
            w, (calls, nbytes) = max(free, key=lambda x: x[1][0])  # the least loaded worker first
            tried.add(id(w))
            share = -(-len(c.pending) // len(free))
            message = self._message(c, tasks, results, min(share, calls), nbytes, idle=not w.calls)
            if message is None:  # the next call does not fit this busy worker's pipe: another may take it
                continue
            ids, payload = message
            for _ in ids:
                c.pending.popleft()
            try:
                w.conn.send_bytes(payload)
            except OSError:  # the worker died since the last look: settle it; the calls wait for another worker
                c.pending.extendleft(reversed(ids))
                self._worker_died(c, w, results)
                continue
            now = time.monotonic()
            sync = c.plan.max_concurrency == 1
            per, extra = divmod(len(payload), len(ids))
            for k, i in enumerate(ids):
                queued = sync and bool(w.calls)  # a sync worker's next call waits its turn (the batch's too)
                w.calls[i] = _Call(task=i, dispatched=now, deadline=None if queued else c.call_deadline(now),
                                   nbytes=per + (extra if k == 0 else 0))

    @staticmethod
    def _message(c: _ComponentWorkers, tasks: Sequence[RewardTask], results: list, n: int, nbytes: int | None,
                 idle: bool) -> tuple[list[int], bytes] | None:
        """Up to `n` calls from the front of the component's queue as one pickled message within `nbytes` (an idle
        worker takes one call of any size); None if not even one call fits. A call whose sample cannot be pickled
        leaves the queue with an error outcome."""
        while c.pending:
            ids = list(itertools.islice(c.pending, n))
            try:  # pickled here (what `Connection.send` does), so its size is known before it is sent
                payload = ForkingPickler.dumps(("calls", [(i, tasks[i].call_kwargs) for i in ids], c.plan.timeout_s))
            except Exception:  # some sample fields are unpicklable: find them, one call at a time
                RewardWorkerPool._drop_unpicklable(c, tasks, results, ids)
                continue
            if nbytes is None or len(payload) <= nbytes or (len(ids) == 1 and idle):
                return ids, payload
            if len(ids) == 1:
                return None
            n = max(1, len(ids) * nbytes // len(payload))  # fewer calls: strictly fewer each time
        return None

    @staticmethod
    def _drop_unpicklable(c: _ComponentWorkers, tasks: Sequence[RewardTask], results: list, ids: list[int]) -> None:
        """The calls among `ids` whose samples cannot be pickled get an error outcome and leave the queue."""
        bad = 0
        for i in ids:
            try:
                ForkingPickler.dumps(tasks[i].call_kwargs)
            except Exception as e:  # nothing was written to the pipe
                c.pending.remove(i)
                results[i] = CallOutcome(
                    "error", message=f"cannot send the sample to a reward worker: {type(e).__name__}: {e}"
                )
                bad += 1
        if not bad:
            raise RewardPoolError(f"reward {c.plan.name!r}: a batch of calls could not be pickled, yet each call can")

    def _collect(self, c: _ComponentWorkers, w: _Worker, results: list) -> None:
        """Read what `w` sent; handle its death (all of its data is read first)."""
        alive = w.proc.is_alive()
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    if msg[1] is not None:
                        raise RewardPoolError(f"reward {c.plan.name!r}: a worker could not load {c.plan.ref}: {msg[1]}")
                    w.ready = True
                    continue
                _, task_id, outcome = msg
                if w.calls.pop(task_id, None) is None:
                    continue  # already settled (a timeout raced the answer)
                c.start_next(w, time.monotonic())
                results[task_id] = outcome
                if outcome.status == "timeout":  # an async call cancelled at its timeout
                    c.breaker.record_failure(outcome.message or "timeout")
                else:
                    c.breaker.record_success()
        except (EOFError, OSError):  # the worker's end is closed: it exited
            alive = False
        if not alive:
            self._worker_died(c, w, results)

    def _worker_died(self, c: _ComponentWorkers, w: _Worker, results: list) -> None:
        w.proc.join(timeout=10)
        if not w.ready and not w.calls:
            raise RewardPoolError(
                f"a worker of reward {c.plan.name!r} exited during start-up ({_exit_reason(w.proc.exitcode)}); see "
                "its traceback on stderr. Workers are spawned, which re-imports the main script: guard a script's "
                "top-level code with `if __name__ == '__main__':`"
            )
        c.requeue_unstarted(w)  # a sync worker's queued calls never ran: the replacement runs them
        if w.calls:
            now = time.monotonic()
            message = f"{c.plan.ref}: its reward worker process died ({_exit_reason(w.proc.exitcode)}) during the call"
            if len(w.calls) > 1:
                message += f" ({len(w.calls)} calls were in flight on that worker)"
            for call in w.calls.values():
                results[call.task] = CallOutcome("crash", message=message, elapsed_s=now - call.dispatched)
            w.calls.clear()
            c.breaker.record_failure(message)  # one event, however many calls the worker ran
        self._replace(c, w)

    def _enforce_deadlines(self, c: _ComponentWorkers, results: list) -> None:
        now = time.monotonic()
        for w in list(c.workers):
            if not w.ready:
                if now >= w.started + self.start_timeout_s:
                    raise RewardPoolError(f"a worker of reward {c.plan.name!r} did not start within "
                                          f"{self.start_timeout_s:g} s (reward_pool.start_timeout_s)")
                continue
            if not _overdue(w, now):
                continue
            self._collect(c, w, results)  # an answer may have come since the last look
            if w not in c.workers or not _overdue(w, now):
                continue
            c.requeue_unstarted(w)  # only the running call overran; the queued ones get the replacement worker
            limit = c.plan.timeout_s
            if c.plan.max_concurrency == 1:
                message = f"{c.plan.ref} did not return within {limit:g} s; its worker was killed"
            else:
                message = (f"{c.plan.ref}: its worker's event loop did not answer within {limit:g} s + "
                           f"{ASYNC_KILL_GRACE_S:g} s (blocked by synchronous code in an async function?); the worker "
                           f"was killed with {len(w.calls)} call(s) in flight")
            for call in w.calls.values():
                results[call.task] = CallOutcome("timeout", message=message, elapsed_s=now - call.dispatched)
            w.calls.clear()
            c.breaker.record_failure(message)
            self._replace(c, w)

    def _abandon_batch(self, comps: list[_ComponentWorkers], results: list, limit: float | None) -> None:
        message = f"reward batch did not finish within {limit:g} s (reward_pool.batch_timeout_s)"
        unstarted = f"{message}; not started: this component's own earlier calls used the time"
        now = time.monotonic()
        for c in comps:
            for w in list(c.workers):
                if w.calls:
                    for call in w.calls.values():
                        why = message if call.deadline is not None else unstarted  # queued on the worker
                        results[call.task] = CallOutcome("timeout", message=why, elapsed_s=now - call.dispatched)
                    w.calls.clear()
                    self._replace(c, w)
            while c.pending:
                results[c.pending.popleft()] = CallOutcome("timeout", message=unstarted)
