"""Call several engines at once with one deadline, so a wedged or dead engine cannot hang the trainer.

Each call runs in its own daemon thread (a daemon, unlike a ThreadPoolExecutor worker, never blocks
interpreter exit if the engine never answers). After the deadline the caller moves on with a
`ReceiverCallError` naming every engine that failed or did not answer; a wedged thread is abandoned. A single call
to an engine whose calls keep their own deadline (a proxy: `WeightReceiver.bounded_calls`) runs in the caller's
thread instead (the quickstart's one engine: three thread starts per sync saved).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from beamrl.protocols.weights import PendingCall, WeightSyncError


class ReceiverCallError(WeightSyncError):
    """One or more engines failed or timed out; `failures` maps engine name -> message."""

    def __init__(self, what: str, failures: dict[str, str]) -> None:
        self.failures = dict(failures)
        detail = "; ".join(f"{who}: {msg.removeprefix(f'{who}: ')}" for who, msg in failures.items())
        super().__init__(f"{what} failed on {len(failures)} engine(s): {detail}")


def call_error_message(exc: BaseException) -> str:
    """How a failed call is reported: a `WeightSyncError`'s own message, any other exception with its type."""
    return str(exc) if isinstance(exc, WeightSyncError) else f"{type(exc).__name__}: {exc}"


def check_reply(reply: object) -> None:
    """SGLang-style `(success, message)` replies: any `success=False` is an error, never ignored."""
    if isinstance(reply, tuple) and len(reply) == 2 and isinstance(reply[0], bool) and not reply[0]:
        raise WeightSyncError(str(reply[1]))
    if isinstance(reply, dict) and reply.get("success") is False:
        raise WeightSyncError(str(reply.get("message", reply)))


def wait_replies(what: str, pending: Sequence[tuple[str, PendingCall]], deadline: float) -> None:
    """Wait for calls issued without waiting (`WeightReceiver.call_async`), until `deadline` (time.monotonic) at most;
    every engine whose call failed or did not answer is named in one `ReceiverCallError`."""
    failures: dict[str, str] = {}
    for label, call in pending:
        try:
            check_reply(call.wait(max(deadline - time.monotonic(), 1e-3)))
        except WeightSyncError as exc:
            failures[label] = str(exc)
    if failures:
        raise ReceiverCallError(what, failures)


def bounded(receivers: Sequence[object]) -> bool:
    """Whether every receiver's calls keep their own deadline (`WeightReceiver.bounded_calls`)."""
    return all(getattr(r, "bounded_calls", False) for r in receivers)


def run_concurrently(what: str, calls: Sequence[tuple[str, Callable[[], object]]], timeout: float,
                     fail_fast: bool = True, bounded_calls: bool = False) -> None:
    """Run every `(who, fn)` concurrently; raise `ReceiverCallError` if any fail or are still running after
    `timeout` s. With `fail_fast` it returns once one call has failed (the sync is lost anyway; a dead engine must
    not cost the whole timeout): calls still running then are reported as abandoned. Without, it waits for every
    call (e.g. aborting sessions: each engine's own outcome matters). `bounded_calls`: each call returns or raises
    within `timeout` by itself (`bounded(receivers)`); a single one then runs in the caller's thread (one engine:
    no thread to start and join per call), failing the same way."""
    if timeout <= 0:
        raise ValueError(f"timeout for {what} must be > 0 s, got {timeout}")
    if bounded_calls and len(calls) == 1:
        who, fn = calls[0]
        try:
            check_reply(fn())
        except Exception as exc:  # as a thread reports it
            raise ReceiverCallError(what, {who: call_error_message(exc)}) from exc
        return
    errors: dict[str, str] = {}
    done = threading.Condition()
    completed: set[str] = set()

    def target(who: str, fn: Callable[[], object]) -> None:
        try:
            check_reply(fn())
        except BaseException as exc:  # reported to the caller, never swallowed
            with done:
                errors[who] = call_error_message(exc)
        finally:
            with done:
                completed.add(who)
                done.notify_all()

    threads = [threading.Thread(target=target, args=call, name=f"beamrl-sync:{what}:{call[0]}", daemon=True)
               for call in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    with done:
        while len(completed) < len(threads) and not (errors and fail_fast):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            done.wait(remaining)
        failures: dict[str, str] = {}
        for who, _ in calls:
            if who in errors:
                failures[who] = errors[who]
            elif who not in completed:
                failures[who] = (f"abandoned {what} after another party failed" if errors else
                                 f"no reply to {what} within {timeout:g} s (engine dead or wedged)")
    if failures:
        raise ReceiverCallError(what, failures)
