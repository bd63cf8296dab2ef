"""Production placement: a Ray actor owns one SGLang HTTP server on its node; callers talk HTTP to it.

`launch_ray_engine(config, ...)` creates the actor (with the GPUs the engine needs, optionally in a placement
group bundle), waits for its server to be healthy, and returns a `RayEngineHandle`: an `SGLangHTTPEngine`
pointed at `http://<actor node ip>:<port>`, so generation and weight updates go straight to the server
(multi-node capable) and every call keeps its HTTP timeout. `shutdown()` stops the server and kills the actor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from beamrl.models.beam.config import BeamConfig
from beamrl.protocols.rollout import EngineError
from beamrl.rollout.sglang.config import SGLangEngineConfig
from beamrl.rollout.sglang.http_engine import SGLangHTTPEngine


class SGLangServerActor:
    """Body of the Ray actor (wrapped with `ray.remote` in `launch_ray_engine`)."""

    def __init__(self, config: SGLangEngineConfig, start_timeout: float) -> None:
        import ray

        from beamrl.rollout.sglang.server import SGLangServer

        # Bind on every interface; clients on other nodes reach it through the node IP.
        self.config = dataclasses.replace(config, host="0.0.0.0")
        self.node_ip = ray.util.get_node_ip_address()
        self.server = SGLangServer(self.config).start(start_timeout)

    def url(self) -> str:
        return f"http://{self.node_ip}:{self.config.port}"

    def log_path(self) -> str:
        return str(self.server.log_path)

    def is_running(self) -> bool:
        return self.server.is_running()

    def stop(self) -> None:
        self.server.stop()


class RayEngineHandle(SGLangHTTPEngine):
    """HTTP client of an actor-owned server; also stops the actor on `shutdown()`."""

    def __init__(self, actor: Any, url: str, beam_config: BeamConfig, config: SGLangEngineConfig) -> None:
        super().__init__(url, beam_config, tp_size=config.engine_tp, weight_version=config.weight_version,
                         memory_saver=config.enable_memory_saver, dtype=config.dtype, model_path=config.model_path)
        self.actor = actor

    def shutdown(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - the actor may already be dead; kill it below anyway
            pass
        ray.kill(self.actor)
        super().shutdown()


def launch_ray_engine(config: SGLangEngineConfig, start_timeout: float = 900.0, num_cpus: float = 1,
                      placement_group: Any = None, bundle_index: int | None = None) -> RayEngineHandle:
    """Start one engine in a Ray actor (num_gpus = engine_tp on CUDA) and return its handle."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": config.engine_tp if config.device == "cuda" else 0}
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index or 0)
    actor = ray.remote(SGLangServerActor).options(**options).remote(config, start_timeout)
    try:
        url = ray.get(actor.url.remote(), timeout=start_timeout + 60)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor)
        raise EngineError(f"Ray SGLang actor did not start within {start_timeout + 60:.0f} s") from None
    except ray.exceptions.RayActorError as e:
        raise EngineError(f"Ray SGLang actor failed to start: {e}") from None
    return RayEngineHandle(actor, url, BeamConfig.from_json_file(config.model_path), config)
