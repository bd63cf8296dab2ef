"""`ray_get`: `ray.get` with a mandatory timeout and a readable error. (Starting Ray: `beamrl.cluster.ray_start`.)"""

from __future__ import annotations

import ray


class ActorCallError(RuntimeError):
    """A call to a Ray actor failed or timed out; the message names the call."""


def no_answer(what: str, timeout: float) -> ActorCallError:
    """The error of a call that gave no answer within `timeout` s (Ray or express calls alike)."""
    return ActorCallError(f"{what}: no answer within {timeout:.0f} s")


def died(what: str, err: BaseException) -> ActorCallError:
    """The error of a call whose actor died."""
    return ActorCallError(f"{what}: the actor died ({err})")


def failed(what: str, cause: BaseException) -> ActorCallError:
    """The error of a call whose method raised `cause`."""
    return ActorCallError(f"{what}: {type(cause).__name__}: {cause}")


def ray_get(refs, timeout: float, what: str):
    """`ray.get` that never waits forever: raises `ActorCallError` naming `what` on timeout or actor death."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise no_answer(what, timeout) from None
    except ray.exceptions.RayActorError as e:
        raise died(what, e) from None
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise failed(what, cause) from cause
