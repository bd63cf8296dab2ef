"""`ENGINES`: the rollout engines a recipe can name (`rollout.engine`), and the picklable factory that builds one
inside its Ray actor.

An entry is `build(rollout: RolloutConfig, launch: EngineLaunch) -> RolloutEngine` (the engine must also be a
`WeightReceiver`). Register a new engine with `@ENGINES.register("name")`; the recipe accepts it at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.registry import Registry

if TYPE_CHECKING:
    from beamrl.protocols.rollout import RolloutEngine
    from beamrl.rollout.config import RolloutConfig


@dataclass(frozen=True)
class EngineLaunch:
    """What one engine needs beyond the rollout section: its weights and where and how it runs.

    device: "cpu" or "cuda". seed: the engine's own seed (run.seed + engine index). return_routed_experts: the
    resolved `rollout.return_routed_experts` (null there follows algorithm.routing_replay). memory_saver: colocated
    GPU engines release their memory while the trainer runs. lora: the trainer's `trainer.lora` (the engine accepts
    adapter-only syncs for it; docs/lora.md)."""

    checkpoint: str
    dtype: str
    device: str
    seed: int
    name: str
    port: int
    start_timeout: float
    return_routed_experts: bool
    memory_saver: bool = False
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


def engine_factory(rollout: "RolloutConfig", launch: EngineLaunch) -> EngineFactory:
    """The factory of the engine `rollout.engine` names."""
    return EngineFactory(ENGINES.get(rollout.engine), rollout, launch)


@ENGINES.register("native")
def build_native_engine(rollout: "RolloutConfig", launch: EngineLaunch) -> "RolloutEngine":
    """The embedded pure-torch engine (docs/native-engine.md); it takes none of the SGLang settings."""
    from beamrl.rollout.native import NativeEngine, NativeEngineConfig

    return NativeEngine(NativeEngineConfig(model_path=launch.checkpoint, dtype=launch.dtype, device=launch.device,
                                           seed=launch.seed, name=launch.name, lora=launch.lora))


@ENGINES.register("sglang")
def build_sglang_engine(rollout: "RolloutConfig", launch: EngineLaunch) -> "RolloutEngine":
    """CPU: SGLang's in-process CPU engine (`SGLangEngineConfig.on_cpu`: its own small pool and backend; the
    GPU-sizing fields of the section do not apply). GPU: an HTTP server subprocess owned by the actor
    (docs/sglang.md), configured from the rollout section under the same field names."""
    from beamrl.rollout.sglang import SGLangEngineConfig

    if launch.device == "cpu":
        from beamrl.rollout.sglang.engine import SGLangEngine

        config = SGLangEngineConfig.on_cpu(launch.checkpoint, dtype=launch.dtype, random_seed=launch.seed,
                                           return_routed_experts=launch.return_routed_experts, lora=launch.lora)
        return SGLangEngine(config, start_timeout=launch.start_timeout)
    from beamrl.rollout.sglang.http_engine import SGLangHTTPEngine

    config = SGLangEngineConfig(
        model_path=launch.checkpoint, engine_tp=rollout.engine_tp, mem_fraction=rollout.mem_fraction,
        dtype=launch.dtype, device="cuda", attention_backend=rollout.attention_backend,
        return_routed_experts=launch.return_routed_experts, deterministic=rollout.deterministic,
        swa_full_tokens_ratio=rollout.swa_full_tokens_ratio, enable_memory_saver=launch.memory_saver,
        random_seed=launch.seed, port=launch.port, server_args=dict(rollout.server_args), lora=launch.lora)
    return SGLangHTTPEngine.launch(config, start_timeout=launch.start_timeout)
