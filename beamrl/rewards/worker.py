"""The body of a reward worker process: load one component's function, then answer calls until told to stop.

Protocol over a Pipe (parent -> worker): ("calls", [(task_id, call_kwargs), ...], timeout_s), a batch of calls in
one message, or None (stop). Worker -> parent: ("ready", error_or_None) once, then ("result", task_id, CallOutcome)
per call, sent as soon as that call finishes (the parent times the next call of a batch from this answer).

With max_concurrency 1 calls run one at a time (the parent kills the worker when one overruns). Otherwise
the function is async and up to max_concurrency calls run at once on one event loop; each is cancelled at its
own timeout here (the parent kills the worker only when the loop itself stops answering).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from multiprocessing.connection import Connection

from beamrl.rewards.invoke import invoke, invoke_async, resolve


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker stuck in a user function never reads the closed pipe; if the trainer dies (even by SIGKILL)
    # this still ends the worker instead of leaving it behind.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _serve_one_at_a_time(conn: Connection, ref: str) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):  # parent gone or interrupted: exit quietly
            return
        if msg is None:
            return
        _, calls, _timeout_s = msg
        for task_id, call_kwargs in calls:  # in order, each answered at once
            conn.send(("result", task_id, invoke(ref, call_kwargs)))


async def _serve_concurrently(conn: Connection, ref: str) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def read() -> None:  # a blocking recv must not stall the loop: read on a thread, hand over to the loop
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = None
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg is None:
                return

    async def answer(task_id: int, call_kwargs: dict, timeout_s: float) -> None:
        outcome = await invoke_async(ref, call_kwargs, timeout_s)
        conn.send(("result", task_id, outcome))  # only this thread sends

    threading.Thread(target=read, daemon=True, name="beamrl-reward-reader").start()
    running: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones
    while True:
        msg = await inbox.get()
        if msg is None:
            return
        _, calls, timeout_s = msg
        for task_id, call_kwargs in calls:
            task = asyncio.create_task(answer(task_id, call_kwargs, timeout_s))
            running.add(task)
            task.add_done_callback(running.discard)


def worker_main(conn: Connection, ref: str, max_concurrency: int, parent_pid: int) -> None:
    # Own process group: the pool's kill then also ends subprocesses a reward function started (sandboxes),
    # and a terminal's Ctrl-C goes to the trainer, which shuts the pool down in order.
    os.setpgrp()
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:  # import (and warm up) now so the first call's timeout does not pay for it
        warmup = getattr(resolve(ref), "warmup", None)
        if callable(warmup):
            warmup()
    except Exception as e:
        conn.send(("ready", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    if max_concurrency == 1:
        _serve_one_at_a_time(conn, ref)
    else:
        try:
            asyncio.run(_serve_concurrently(conn, ref))
        except KeyboardInterrupt:
            return
