"""Waiting on actor calls made either way: Ray object refs or express calls (`beamrl.loop.express`).

The groups (`beamrl.loop.groups`) wait on a set of calls that are all of one kind; these functions give both kinds
`ray.wait` / `ray.get` semantics, and the errors `ray_get` raises (`ActorCallError` naming the call)."""

from __future__ import annotations

import time
from typing import Any

import ray

from beamrl.loop.express import ExpressCall, ExpressPeerLost, ExpressTaskError, ExpressTimeout, wait_any as _wait
from beamrl.loop.ray_utils import died, failed, no_answer, ray_get

#: What a call that ended with its actor's death raises, either way.
DIED = (ray.exceptions.RayActorError, ExpressPeerLost)
#: What a call whose method raised raises, either way (its `cause` is the method's exception).
FAILED = (ray.exceptions.RayTaskError, ExpressTaskError)


def wait_any(calls: list, timeout: float) -> list:
    """The calls that have ended, waiting up to `timeout` s for at least one (`ray.wait` with num_returns=1)."""
    if calls and isinstance(calls[0], ExpressCall):
        return _wait(calls, timeout)
    return ray.wait(calls, num_returns=1, timeout=timeout)[0]


def wait_all(calls: list, timeout: float) -> list:
    """The calls that have ended within `timeout` s, waiting for all of them at most that long."""
    if calls and isinstance(calls[0], ExpressCall):
        deadline = time.monotonic() + timeout
        return [c for c in calls if c.wait(max(0.0, deadline - time.monotonic()))]
    return ray.wait(calls, num_returns=len(calls), timeout=timeout)[0]


def fetch(call, timeout: float = 0.0) -> Any:
    """An ended call's value; raises one of `DIED` or `FAILED` (or a timeout error) as the call ended."""
    if isinstance(call, ExpressCall):
        return call.result(timeout)
    return ray.get(call, timeout=timeout)


def call_result(call, timeout: float, what: str) -> Any:
    """`ray_get` for either kind: the value, or `ActorCallError` naming `what` on timeout, death or failure."""
    if not isinstance(call, ExpressCall):
        return ray_get(call, timeout, what)
    try:
        return call.result(timeout)
    except ExpressTimeout:
        call.abandon()
        raise no_answer(what, timeout) from None
    except ExpressPeerLost as e:
        raise died(what, e) from None
    except ExpressTaskError as e:
        raise failed(what, e.cause) from e.cause


def abandon(call) -> bool:
    """Give up on an express call (its reply is dropped when it comes); True. A Ray ref: False (the caller holds it
    until it ends, so its error is read, not reported by Ray as unhandled)."""
    if isinstance(call, ExpressCall):
        call.abandon()
        return True
    return False
