"""The embedded `native` rollout engine: the reference Beam model + KV cache behind `RolloutEngine`."""

from beamrl.rollout.native.config import NativeEngineConfig, NativeEngineConfigError
from beamrl.rollout.native.engine import NativeEngine

__all__ = ["NativeEngine", "NativeEngineConfig", "NativeEngineConfigError"]
