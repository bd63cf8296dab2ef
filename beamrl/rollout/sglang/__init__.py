"""SGLang 0.5.23 rollout engines: launch config, in-process engine, HTTP server + client, Ray actor.

Importing this package does not import sglang; each adapter imports it when it starts (docs/sglang.md)."""

from beamrl.rollout.sglang.config import SGLangConfigError, SGLangEngineConfig

__all__ = ["SGLangConfigError", "SGLangEngineConfig"]
