"""`ray_get`: `ray.get` with a mandatory timeout and a readable error. (Starting Ray: `beamrl.cluster.ray_start`.)"""

from __future__ import annotations

import ray


class ActorCallError(RuntimeError):
    """A call to a Ray actor failed or timed out; the message names the call."""


def ray_get(refs, timeout: float, what: str):
    """`ray.get` that never waits forever: raises `ActorCallError` naming `what` on timeout or actor death."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise ActorCallError(f"{what}: no answer within {timeout:.0f} s") from None
    except ray.exceptions.RayActorError as e:
        raise ActorCallError(f"{what}: the actor died ({e})") from None
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise ActorCallError(f"{what}: {type(cause).__name__}: {cause}") from cause
