"""`RolloutConfig`: the recipe's `rollout` section, owned by the rollout engines and read under these names.

The sampling fields become each request's `SamplingParams` (same names), `engine` picks an entry of `ENGINES`,
and the SGLang fields reach `SGLangEngineConfig` under the same names (`engine_tp`, `mem_fraction`,
`deterministic`, `server_args`, ...). `check_model` holds the engine's model-fit rules (SGLang 0.5.23 TP sharding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from beamrl.config import ConfigError, Section, registry_choice
from beamrl.rollout.engines import ENGINES
from beamrl.rollout.sglang.config import (ATTENTION_BACKENDS, DETERMINISTIC_ATTENTION_BACKENDS, PLACEMENT_ARGS,
                                          SGLANG_NAMES)

if TYPE_CHECKING:
    from beamrl.models.beam import BeamConfig

# SGLang ServerArgs that a first-class field (or another section) already sets: naming them in `server_args`
# would give a setting two sources. SGLang name -> the field to set instead.
SERVER_ARGS_OWNED = {
    **{sglang: f"rollout.{ours}" for ours, sglang in SGLANG_NAMES.items()},
    "attention_backend": "rollout.attention_backend", "swa_full_tokens_ratio": "rollout.swa_full_tokens_ratio",
    "model_path": "model.checkpoint", "random_seed": "run.seed", "dtype": "model.dtype",
    "device": "cluster.device", "enable_memory_saver": "trainer.sleep_during_rollout",
    "enable_weights_cpu_backup": "trainer.sleep_during_rollout",
}
# SGLang ServerArgs that beamrl sets for every engine, with no setting of their own: the engine API beamrl speaks
# depends on them.
SERVER_ARGS_FIXED = ("skip_tokenizer_init", "log_level", "weight_version", "enable_fp32_lm_head",
                     "disable_overlap_schedule")
# Fields only the SGLang engine reads: the native engine must leave them at their defaults.
SGLANG_ONLY = ("engine_tp", "server_args", "attention_backend", "deterministic", "mem_fraction",
               "swa_full_tokens_ratio")


class RolloutConfig(Section):
    """Rollout engines and sampling. `server_args` are extra SGLang ServerArgs (fields here win)."""

    engine: registry_choice(ENGINES) = "sglang"  # type: ignore[valid-type]
    num_engines: int = Field(1, gt=0)
    engine_tp: int = Field(1, gt=0)
    mem_fraction: float = Field(0.85, gt=0, lt=1)
    max_new_tokens: int = Field(gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    n_samples_per_prompt: int = Field(gt=0)
    prompts_per_step: int = Field(gt=0)
    return_routed_experts: bool | None = Field(None, description="null = algorithm.routing_replay")
    server_args: dict[str, Any] = Field(default_factory=dict)
    swa_full_tokens_ratio: float = Field(0.8, gt=0, le=1)
    deterministic: bool = False
    attention_backend: Literal[ATTENTION_BACKENDS] | None = None  # type: ignore[valid-type]
    # Fault tolerance (docs/rl-loop.md): a dead engine is restarted, resynced and its requests re-issued; restart
    # attempts over the whole run beyond this budget end the run. Engines are health-checked every
    # `health_check_interval_s` while a rollout waits on them (and, when on several nodes, at its start).
    max_engine_restarts: int = Field(3, ge=0)
    health_check_interval_s: float = Field(30.0, gt=0)

    @property
    def num_gpus(self) -> int:
        return self.num_engines * self.engine_tp

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.n_samples_per_prompt

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError("top_k", self.top_k, "-1 (off) or >= 1")
        for key in self.server_args:
            if key in PLACEMENT_ARGS:
                raise ConfigError(f"server_args.{key}", self.server_args[key], "set by beamrl for each engine process "
                                  "from the placement plan (cluster, engine_tp) and the run's API key; remove it")
            if key in SERVER_ARGS_OWNED:
                raise ConfigError(f"server_args.{key}", self.server_args[key],
                                  f"set {SERVER_ARGS_OWNED[key]} instead (first-class field)")
            if key in SERVER_ARGS_FIXED:
                raise ConfigError(f"server_args.{key}", self.server_args[key],
                                  "nothing: beamrl sets it for every engine")
        if self.engine == "sglang" and self.server_args:
            from beamrl.rollout.sglang.cli_args import check

            # an unknown key, another spelling of a field (which the checks above would miss) or a value SGLang's
            # command line cannot say or its parser refuses: named now, not at launch
            check(self.server_args)
        if self.engine == "native":
            defaults = {name: RolloutConfig.model_fields[name].get_default(call_default_factory=True)
                        for name in SGLANG_ONLY}
            for name in SGLANG_ONLY:
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(name, getattr(self, name), "SGLang-only setting; the native engine takes none "
                                      "(engine_tp=1)")
        if self.deterministic and self.attention_backend not in DETERMINISTIC_ATTENTION_BACKENDS:
            raise ConfigError("attention_backend", self.attention_backend,
                              f"deterministic inference needs an explicit backend among "
                              f"{list(DETERMINISTIC_ATTENTION_BACKENDS)} (Beam's default trtllm_mha is not one)")
        return self

    def check_model(self, c: "BeamConfig") -> None:
        """Raise `ConfigError` if SGLang cannot shard Beam `c` over `engine_tp`: TP divides the attention heads;
        the KV heads divide by it or it is a multiple of them (SGLang then replicates KV heads); TP divides both
        MLP widths (SGLang's MoE is TP-sharded)."""
        et = self.engine_tp
        if c.num_attention_heads % et:
            raise ConfigError("engine_tp", et, f"must divide num_attention_heads={c.num_attention_heads}")
        kv = c.num_key_value_heads
        if kv % et and et % kv:
            raise ConfigError("engine_tp", et, f"KV heads must split evenly: num_key_value_heads={kv} divisible "
                              f"by engine_tp, or engine_tp a multiple of {kv} (KV heads replicated)")
        if c.moe_layers and c.moe_intermediate_size % et:
            raise ConfigError("engine_tp", et, f"must divide moe_intermediate_size={c.moe_intermediate_size}")
        if len(c.moe_layers) < c.num_hidden_layers and c.intermediate_size % et:
            raise ConfigError("engine_tp", et, f"must divide intermediate_size={c.intermediate_size}")
