"""Ray helpers: cluster start-up for a run, and `ray_get` with a mandatory timeout and a readable error."""

from __future__ import annotations

import os
from pathlib import Path

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


def init_local_ray(num_cpus: int, temp_dir: Path, object_store_mb: int = 512, runtime_env: dict | None = None) -> None:
    """Start (or join) a single-node Ray for a CPU run: quiet, loopback only, bounded object store. `runtime_env`:
    the job's (e.g. `beamrl.third_party_output.worker_runtime_env`)."""
    if ray.is_initialized():
        return
    # Single-node runs keep Ray on loopback and off the network (ray-and-friends.md §1.6, §1.5).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir.mkdir(parents=True, exist_ok=True)
    # On a heavily loaded machine the raylet can miss Ray's start-up deadline; that is worth a second try,
    # and the error after the last try is Ray's own.
    for attempt in range(3):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=True,
                     object_store_memory=object_store_mb << 20, _temp_dir=str(temp_dir.resolve()),
                     configure_logging=True, runtime_env=runtime_env)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            print(f"[beamrl] Ray start-up timed out (machine overloaded?); retrying ({attempt + 2}/3)", flush=True)
            ray.shutdown()


def connect_cluster_ray(runtime_env: dict | None = None) -> None:
    """Join the Ray cluster started by `launch/` (`RAY_ADDRESS` or `ray start` on this node)."""
    if not ray.is_initialized():
        ray.init(address="auto", logging_level="ERROR", runtime_env=runtime_env)
