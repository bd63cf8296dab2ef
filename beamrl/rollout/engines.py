"""`ENGINES`: the rollout engines a recipe can name (`rollout.engine`), and the picklable factory that builds one
inside its Ray actor.

An entry is `build(rollout: RolloutConfig, launch: EngineLaunch) -> RolloutEngine` (the engine must also be a
`WeightReceiver`). Register a new engine with `@ENGINES.register("name")`; the recipe accepts it at once.
An engine that spans nodes is built once per node (`launch.node_rank`): node rank 0 returns the engine, the
others a follower process (an object with `health(timeout)` and `shutdown()`) that serves no API.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.registry import Registry

if TYPE_CHECKING:
    from beamrl.protocols.rollout import RolloutEngine
    from beamrl.rollout.config import RolloutConfig


@dataclass(frozen=True)
class EngineLaunch:
    """What one engine needs beyond the rollout section: its weights and where and how it runs.

    device: "cpu" or "cuda". seed: the engine's own seed (run.seed + engine index; the same on all its nodes).
    return_routed_experts: the resolved `rollout.return_routed_experts` (null there follows
    algorithm.routing_replay). memory_saver: colocated GPU engines release their memory while the trainer runs.
    weights_cpu_backup: released weights are kept in host memory and restored at resume (needed when the syncs
    do not resend every weight: LoRA's adapter-only syncs); False: they are dropped, and the next full sync loads
    them (SGLang's `enable_weights_cpu_backup`, off by default).

    Where this process of the engine runs comes from the placement plan: `nnodes` and `node_rank` (an engine
    that spans nodes runs one process per node), `base_gpu_id` (its first GPU among `visible_gpus`, the GPU ids
    of its node; None = as the actor sees them). `host`, `port` and `dist_init_addr` (the leader's host:port,
    where the nodes meet) are filled in by the engine's actors at start-up, and `api_key` is the run's secret,
    required by every server that listens on more than loopback. lora: the trainer's `trainer.lora` (the engine
    accepts adapter-only syncs for it; docs/lora.md)."""

    checkpoint: str
    dtype: str
    device: str
    seed: int
    name: str
    start_timeout: float
    return_routed_experts: bool
    memory_saver: bool = False
    weights_cpu_backup: bool = True
    nnodes: int = 1
    node_rank: int = 0
    base_gpu_id: int = 0
    visible_gpus: tuple[int, ...] | None = None
    host: str = "127.0.0.1"
    port: int = 0
    dist_init_addr: str | None = None
    api_key: str | None = field(default=None, repr=False)
    lora: LoRAConfig | None = None


EngineBuilder = Callable[["RolloutConfig", EngineLaunch], "RolloutEngine"]
ENGINES: Registry[EngineBuilder] = Registry("rollout engine")


@dataclass(frozen=True)
class EngineFactory:
    """Builds one engine where it is called (inside its actor). Picklable: the builder travels by reference."""

    build: EngineBuilder
    rollout: "RolloutConfig"
    launch: EngineLaunch

    @property
    def name(self) -> str:
        return self.launch.name

    def __call__(self) -> "RolloutEngine":
        return self.build(self.rollout, self.launch)

    def with_launch(self, **changes) -> "EngineFactory":
        """The same factory with `launch` fields changed (a node's part of the plan, its address at start-up)."""
        return replace(self, launch=replace(self.launch, **changes))


def engine_factory(rollout: "RolloutConfig", launch: EngineLaunch) -> EngineFactory:
    """The factory of the engine `rollout.engine` names."""
    return EngineFactory(ENGINES.get(rollout.engine), rollout, launch)


@ENGINES.register("native")
def build_native_engine(rollout: "RolloutConfig", launch: EngineLaunch) -> "RolloutEngine":
    """The embedded pure-torch engine (docs/native-engine.md); it takes none of the SGLang settings."""
    from beamrl.rollout.native import NativeEngine, NativeEngineConfig

    return NativeEngine(NativeEngineConfig(model_path=launch.checkpoint, dtype=launch.dtype, device=launch.device,
                                           seed=launch.seed, name=launch.name, lora=launch.lora,
                                           weights_cpu_backup=launch.weights_cpu_backup))


@ENGINES.register("sglang")
def build_sglang_engine(rollout: "RolloutConfig", launch: EngineLaunch):
    """CPU, one node: SGLang's in-process CPU engine (`SGLangEngineConfig.on_cpu`: its own small pool and backend;
    the GPU-sizing fields of the section do not apply). Otherwise an HTTP server subprocess owned by the actor
    (docs/sglang.md), configured from the rollout section under the same field names: the leader (node rank 0)
    as an `SGLangHTTPEngine`, every other node of a multi-node engine as an `SGLangFollower`."""
    from beamrl.rollout.sglang import SGLangEngineConfig

    placed = dict(engine_tp=rollout.engine_tp, base_gpu_id=launch.base_gpu_id, random_seed=launch.seed,
                  dtype=launch.dtype, return_routed_experts=launch.return_routed_experts, lora=launch.lora)
    if launch.device == "cpu" and launch.nnodes == 1:
        from beamrl.rollout.sglang.engine import SGLangEngine

        return SGLangEngine(SGLangEngineConfig.on_cpu(launch.checkpoint, **placed), start_timeout=launch.start_timeout)
    server = dict(host=launch.host, port=launch.port, nnodes=launch.nnodes, node_rank=launch.node_rank,
                  dist_init_addr=launch.dist_init_addr, visible_gpus=launch.visible_gpus, api_key=launch.api_key)
    if launch.device == "cpu":  # a rehearsal of a multi-node engine: CPU servers on simulated nodes
        config = SGLangEngineConfig.on_cpu(launch.checkpoint, **placed, **server)
    else:
        config = SGLangEngineConfig(
            model_path=launch.checkpoint, mem_fraction=rollout.mem_fraction, device="cuda",
            attention_backend=rollout.attention_backend, deterministic=rollout.deterministic,
            swa_full_tokens_ratio=rollout.swa_full_tokens_ratio, enable_memory_saver=launch.memory_saver,
            enable_weights_cpu_backup=launch.memory_saver and launch.weights_cpu_backup,
            server_args=dict(rollout.server_args), **placed, **server)
    if launch.node_rank > 0:
        from beamrl.rollout.sglang.follower import SGLangFollower

        return SGLangFollower.launch(config, start_timeout=launch.start_timeout)
    from beamrl.rollout.sglang.http_engine import SGLangHTTPEngine

    return SGLangHTTPEngine.launch(config, start_timeout=launch.start_timeout)
