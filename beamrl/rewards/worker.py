"""The body of a reward worker process: preload the functions, then answer calls until told to stop.

Protocol over a Pipe (parent -> worker): ("call", task_id, ref, call_kwargs) or None (stop).
Worker -> parent: ("ready", error_or_None) once, then ("result", task_id, CallOutcome) per call.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection

from beamrl.rewards.invoke import invoke, resolve


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker stuck in a user function never reads the closed pipe; if the trainer dies (even by SIGKILL)
    # this still ends the worker instead of leaving it behind.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_main(conn: Connection, preload: tuple[str, ...], parent_pid: int) -> None:
    # Own process group: the pool's kill then also ends subprocesses a reward function started (sandboxes),
    # and a terminal's Ctrl-C goes to the trainer, which shuts the pool down in order.
    os.setpgrp()
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:
        for ref in preload:  # import (and warm up) now so the first call's timeout does not pay for it
            warmup = getattr(resolve(ref), "warmup", None)
            if callable(warmup):
                warmup()
    except Exception as e:
        conn.send(("ready", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):  # parent gone or interrupted: exit quietly
            return
        if msg is None:
            return
        _, task_id, ref, call_kwargs = msg
        conn.send(("result", task_id, invoke(ref, call_kwargs)))
