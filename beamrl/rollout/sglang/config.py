"""`SGLangEngineConfig`: the typed launch configuration of one SGLang 0.5.23 engine serving Beam.

One config builds both the in-process `sglang.Engine(**kwargs)` and the `python -m sglang.launch_server ...`
command line, so the two adapters can never be launched differently. See docs/sglang.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# SGLang 0.5.23 refuses deterministic inference with any other backend (srt/arg_groups/choices.py:113-120).
DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")
DEVICES = ("cuda", "cpu")
#: The package of beamrl's out-of-tree SGLang model classes (`beamrl/rollout/sglang/models/`).
EXTERNAL_MODEL_PACKAGE = "beamrl.rollout.sglang.models"
#: The HF config field that tells that class its LoRA targets (set through `json_model_override_args`).
LORA_TARGETS_FIELD = "beamrl_lora_targets"
DTYPES = ("auto", "bfloat16", "float32", "float16")


class SGLangConfigError(ValueError):
    """A field of `SGLangEngineConfig` is invalid; the message names it."""


@dataclass
class SGLangEngineConfig:
    """Launch arguments of one SGLang engine (sglang-integration.md §3-§7).

    `extra_args` are passed through verbatim (`{"context_length": 4096}` -> `context_length=4096` /
    `--context-length 4096`; `True` -> a bare flag) for options beamrl does not model; they may not override a
    modelled field."""

    model_path: str
    tp_size: int = 1
    mem_fraction_static: float | None = None
    dtype: str = "auto"
    device: str = "cuda"
    attention_backend: str | None = None
    sampling_backend: str | None = None
    enable_return_routed_experts: bool = True
    enable_memory_saver: bool = False
    enable_deterministic_inference: bool = False
    # SGLang's Beam keeps lm_head in BF16 and, by default, runs the head GEMM in BF16 even in a float32
    # engine; this flag makes the head GEMM FP32 (the weight itself stays BF16-rounded).
    enable_fp32_lm_head: bool = False
    swa_full_tokens_ratio: float | None = None
    random_seed: int = 0
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    disable_overlap_schedule: bool = False
    weight_version: int = 0
    #: LoRA targets (`LoRAConfig.targets`) this engine accepts adapter payloads for (docs/lora.md): launches
    #: beamrl's out-of-tree Beam class, which keeps W0 of these weights. None = SGLang's own Beam class.
    lora_targets: tuple[str, ...] | None = None
    log_level: str = "warning"
    host: str = "127.0.0.1"
    port: int = 30000
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.model_path:
            raise SGLangConfigError("SGLangEngineConfig.model_path is empty")
        if self.tp_size < 1:
            raise SGLangConfigError(f"SGLangEngineConfig.tp_size={self.tp_size} must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise SGLangConfigError(
                f"SGLangEngineConfig.mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.dtype not in DTYPES:
            raise SGLangConfigError(f"SGLangEngineConfig.dtype={self.dtype!r}; allowed: {list(DTYPES)}")
        if self.device not in DEVICES:
            raise SGLangConfigError(f"SGLangEngineConfig.device={self.device!r}; allowed: {list(DEVICES)}")
        if self.swa_full_tokens_ratio is not None and not 0 < self.swa_full_tokens_ratio <= 1:
            raise SGLangConfigError(
                f"SGLangEngineConfig.swa_full_tokens_ratio={self.swa_full_tokens_ratio} must be in (0, 1]")
        if self.weight_version < 0:
            raise SGLangConfigError(f"SGLangEngineConfig.weight_version={self.weight_version} must be >= 0")
        if self.enable_deterministic_inference:
            # Beam's model override picks trtllm_mha when no backend is given, and SGLang then refuses
            # deterministic mode deep inside launch (sglang-integration.md §7): refuse here, by name.
            if self.attention_backend not in DETERMINISTIC_ATTENTION_BACKENDS:
                raise SGLangConfigError(
                    "SGLangEngineConfig.enable_deterministic_inference=True needs an explicit attention_backend "
                    f"in {list(DETERMINISTIC_ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
            if self.device == "cpu":
                raise SGLangConfigError(
                    "SGLangEngineConfig.enable_deterministic_inference=True is not available on device='cpu' "
                    "(the CPU engine only has the torch_native attention backend)")
        if self.enable_memory_saver and self.device == "cpu":
            raise SGLangConfigError(
                "SGLangEngineConfig.enable_memory_saver=True needs CUDA (torch_memory_saver); device is 'cpu'")
        if self.lora_targets is not None:
            from beamrl.models.beam.lora_config import LoRAConfig, LoRAConfigError

            try:
                LoRAConfig(targets=tuple(self.lora_targets))
            except LoRAConfigError as e:
                raise SGLangConfigError(f"SGLangEngineConfig.lora_targets: {e}") from None
        clash = set(self.extra_args) & set(self._modelled_kwargs())
        if clash:
            raise SGLangConfigError(f"SGLangEngineConfig.extra_args must not override modelled fields: {sorted(clash)}")

    @classmethod
    def cpu_test(cls, model_path: str | Path, **overrides: Any) -> "SGLangEngineConfig":
        """The small-pool CPU engine recipe (sglang-integration.md §3) used by CI and `beamrl parity`."""
        base: dict[str, Any] = dict(
            model_path=str(model_path), device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
            disable_overlap_schedule=True, max_total_tokens=2048, max_running_requests=4, chunked_prefill_size=256,
            mem_fraction_static=0.3, enable_return_routed_experts=True)
        base.update(overrides)
        return cls(**base)

    # ------------------------------------------------------------------ rendering
    def _modelled_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            model_path=self.model_path, tp_size=self.tp_size, dtype=self.dtype, device=self.device,
            random_seed=self.random_seed, skip_tokenizer_init=True, log_level=self.log_level,
            weight_version=str(self.weight_version),
            enable_return_routed_experts=self.enable_return_routed_experts,
            enable_memory_saver=self.enable_memory_saver,
            enable_deterministic_inference=self.enable_deterministic_inference,
            enable_fp32_lm_head=self.enable_fp32_lm_head,
            disable_overlap_schedule=self.disable_overlap_schedule)
        optional = dict(mem_fraction_static=self.mem_fraction_static, attention_backend=self.attention_backend,
                        sampling_backend=self.sampling_backend, swa_full_tokens_ratio=self.swa_full_tokens_ratio,
                        max_total_tokens=self.max_total_tokens, max_running_requests=self.max_running_requests,
                        chunked_prefill_size=self.chunked_prefill_size)
        kw.update({k: v for k, v in optional.items() if v is not None})
        if self.lora_targets is not None:
            kw["json_model_override_args"] = json.dumps({LORA_TARGETS_FIELD: list(self.lora_targets)})
        return kw

    def launch_env(self) -> dict[str, str]:
        """Environment variables the engine's own processes need (SGLang's hook for out-of-tree model classes,
        set only when this engine serves LoRA adapters)."""
        if self.lora_targets is None:
            return {}
        return {"SGLANG_EXTERNAL_MODEL_PACKAGE": EXTERNAL_MODEL_PACKAGE}

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the in-process `sglang.Engine` (always token ids in/out: skip_tokenizer_init)."""
        return {**self._modelled_kwargs(), **self.extra_args}

    def server_args(self) -> list[str]:
        """Arguments after `python -m sglang.launch_server` (host/port included)."""
        kw = {**self._modelled_kwargs(), "host": self.host, "port": self.port, **self.extra_args}
        argv: list[str] = []
        for key, value in kw.items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                if value:
                    argv.append(flag)
            elif value is not None:
                argv += [flag, str(value)]
        return argv
