"""`SGLangEngineConfig`: the typed launch configuration of one SGLang 0.5.23 engine serving Beam.

One config builds both the in-process `sglang.Engine(**kwargs)` and the `python -m sglang.launch_server ...`
command line, so the two adapters can never be launched differently. See docs/sglang.md.

Fields that are also recipe fields (`rollout.engine_tp`, `rollout.mem_fraction`, ...) carry the recipe's names;
`SGLANG_NAMES` is the one place where they become SGLang's own argument names (`tp_size`, ...).
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beamrl.dtypes import DTYPES as DTYPE_NAMES
from beamrl.models.beam.lora_config import LoRAConfig

# SGLang 0.5.23's deterministic-inference backends on the devices beamrl runs on (srt/arg_groups/choices.py:113-120;
# its other two, ascend and intel_xpu, are other vendors' devices). Beam's default on sm90+, trtllm_mha, is not one.
DETERMINISTIC_ATTENTION_BACKENDS = ("fa3", "fa4", "flashinfer", "triton")
# The attention backends a recipe may name: the deterministic ones, Beam's default and the CPU engine's.
ATTENTION_BACKENDS = DETERMINISTIC_ATTENTION_BACKENDS + ("trtllm_mha", "torch_native")
DEVICES = ("cuda", "cpu")
DTYPES = ("auto", *DTYPE_NAMES)  # "auto": the checkpoint's own dtype


# beamrl name -> SGLang ServerArgs name, for the fields whose names differ (the others are passed as they are).
SGLANG_NAMES = {"engine_tp": "tp_size", "mem_fraction": "mem_fraction_static",
                "return_routed_experts": "enable_return_routed_experts",
                "deterministic": "enable_deterministic_inference"}
# Set per process by the launcher from the placement plan (and the run's API key); never from `server_args`.
PLACEMENT_ARGS = ("host", "port", "nnodes", "node_rank", "dist_init_addr", "base_gpu_id", "api_key", "config")
# The CPU engine (CI, laptops, `beamrl parity` without a GPU): SGLang's torch_native attention and a small pool
# (sglang-integration.md §3). `SGLangEngineConfig.on_cpu` starts from these.
CPU_SETTINGS: dict[str, Any] = dict(
    device="cpu", attention_backend="torch_native", sampling_backend="pytorch", disable_overlap_schedule=True,
    max_total_tokens=2048, max_running_requests=4, chunked_prefill_size=256, mem_fraction=0.3,
    return_routed_experts=True)
#: The package of beamrl's out-of-tree SGLang model classes (`beamrl/rollout/sglang/models/`).
EXTERNAL_MODEL_PACKAGE = "beamrl.rollout.sglang.models"
#: The HF config field that tells that class the LoRA config (set through `json_model_override_args`).
LORA_FIELD = "beamrl_lora"


class SGLangConfigError(ValueError):
    """A field of `SGLangEngineConfig` is invalid; the message names it."""


@dataclass
class SGLangEngineConfig:
    """Launch arguments of one SGLang engine (sglang-integration.md §3-§7).

    `server_args` are passed through (`{"context_length": 4096}` -> `context_length=4096` /
    `--context-length 4096`; every value as SGLang's parser takes it, or refused where its command line cannot
    say it: `cli_args`) for options beamrl does not model; they may not override a modelled field.

    Multi-node engines (scale-out): every node runs one server with the same arguments except `node_rank`;
    `nnodes` nodes split the `engine_tp` ranks evenly and meet at `dist_init_addr` (the leader's host:port).
    `base_gpu_id` is the first GPU of this node's share among `visible_gpus` (the server's CUDA_VISIBLE_DEVICES,
    None = inherit). A server bound to an address other than loopback must have an `api_key`; it reaches SGLang
    through a private config file (`--config`), never the command line."""

    model_path: str
    engine_tp: int = 1
    mem_fraction: float | None = None
    dtype: str = "auto"
    device: str = "cuda"
    attention_backend: str | None = None
    sampling_backend: str | None = None
    return_routed_experts: bool = True
    enable_memory_saver: bool = False
    # With the memory saver: keep released weights in host memory (SGLang's default drops them; a full sync
    # reloads them). Needed when syncs do not resend every weight (LoRA's adapter-only syncs).
    enable_weights_cpu_backup: bool = False
    deterministic: bool = False
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
    #: The trainer's LoRA config (`trainer.lora`): this engine accepts adapter-only syncs for it (docs/lora.md),
    #: served by beamrl's out-of-tree Beam class, which keeps W0 of the targeted weights. None = SGLang's own class.
    lora: LoRAConfig | None = None
    log_level: str = "warning"
    host: str = "127.0.0.1"
    port: int = 30000
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    base_gpu_id: int = 0
    visible_gpus: tuple[int, ...] | None = None
    api_key: str | None = field(default=None, repr=False)
    server_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.model_path:
            raise SGLangConfigError("SGLangEngineConfig.model_path is empty")
        if self.engine_tp < 1:
            raise SGLangConfigError(f"SGLangEngineConfig.engine_tp={self.engine_tp} must be >= 1")
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise SGLangConfigError(f"SGLangEngineConfig.mem_fraction={self.mem_fraction} must be in (0, 1)")
        if self.dtype not in DTYPES:
            raise SGLangConfigError(f"SGLangEngineConfig.dtype={self.dtype!r}; allowed: {list(DTYPES)}")
        if self.device not in DEVICES:
            raise SGLangConfigError(f"SGLangEngineConfig.device={self.device!r}; allowed: {list(DEVICES)}")
        if self.swa_full_tokens_ratio is not None and not 0 < self.swa_full_tokens_ratio <= 1:
            raise SGLangConfigError(
                f"SGLangEngineConfig.swa_full_tokens_ratio={self.swa_full_tokens_ratio} must be in (0, 1]")
        if self.weight_version < 0:
            raise SGLangConfigError(f"SGLangEngineConfig.weight_version={self.weight_version} must be >= 0")
        if self.deterministic:
            # Beam's model override picks trtllm_mha when no backend is given, and SGLang then refuses
            # deterministic mode deep inside launch (sglang-integration.md §7): refuse here, by name.
            if self.attention_backend not in DETERMINISTIC_ATTENTION_BACKENDS:
                raise SGLangConfigError(
                    "SGLangEngineConfig.deterministic=True needs an explicit attention_backend "
                    f"in {list(DETERMINISTIC_ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
            if self.device == "cpu":
                raise SGLangConfigError(
                    "SGLangEngineConfig.deterministic=True is not available on device='cpu' "
                    "(the CPU engine only has the torch_native attention backend)")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise SGLangConfigError(f"SGLangEngineConfig.node_rank={self.node_rank} must be in "
                                    f"[0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise SGLangConfigError("SGLangEngineConfig.dist_init_addr (the leader's host:port) is required with "
                                    f"nnodes={self.nnodes}")
        if self.engine_tp % self.nnodes:
            raise SGLangConfigError(f"SGLangEngineConfig.engine_tp={self.engine_tp} must split evenly over "
                                    f"nnodes={self.nnodes}")
        if self.base_gpu_id < 0:
            raise SGLangConfigError(f"SGLangEngineConfig.base_gpu_id={self.base_gpu_id} must be >= 0")
        if not self.api_key and not _is_loopback(self.host):
            raise SGLangConfigError(f"SGLangEngineConfig.host={self.host!r} is reachable from other machines: set "
                                    "api_key (a per-run secret) or bind to 127.0.0.1")
        if self.api_key is not None and (not self.api_key or self.api_key.startswith("-") or
                                         any(c.isspace() for c in self.api_key)):
            # SGLang turns its --config file back into command-line arguments: a leading '-' reads as a flag
            raise SGLangConfigError("SGLangEngineConfig.api_key must be non-empty, without whitespace, and not start "
                                    "with '-'")
        if self.enable_memory_saver and self.device == "cpu":
            raise SGLangConfigError(
                "SGLangEngineConfig.enable_memory_saver=True needs CUDA (torch_memory_saver); device is 'cpu'")
        if self.enable_weights_cpu_backup and not self.enable_memory_saver:
            raise SGLangConfigError("SGLangEngineConfig.enable_weights_cpu_backup=True only applies with "
                                    "enable_memory_saver=True (it backs up the weights the memory saver releases)")
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise SGLangConfigError(f"SGLangEngineConfig.lora must be a LoRAConfig (trainer.lora), got "
                                    f"{type(self.lora).__name__}")
        clash = set(self.server_args) & (set(self._modelled_kwargs()) | set(PLACEMENT_ARGS))
        if clash:
            raise SGLangConfigError(f"SGLangEngineConfig.server_args must not override modelled fields: "
                                    f"{sorted(clash)}")
        from beamrl.rollout.sglang import cli_args

        for key, value in self.server_args.items():
            try:  # also refuses another spelling of a field (`tensor_parallel_size`), which the clash check misses
                cli_args.parse(key, value)
            except ValueError as e:
                raise SGLangConfigError(f"SGLangEngineConfig.server_args.{key}={value!r}: {e}") from None

    @property
    def tp_per_node(self) -> int:
        return self.engine_tp // self.nnodes

    @classmethod
    def on_cpu(cls, model_path: str | Path, **overrides: Any) -> "SGLangEngineConfig":
        """The CPU engine (`CPU_SETTINGS`, then `overrides`): what the RL loop, CI and `beamrl parity` run on CPU."""
        return cls(model_path=str(model_path), **{**CPU_SETTINGS, **overrides})

    # ------------------------------------------------------------------ rendering
    def _modelled_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            model_path=self.model_path, engine_tp=self.engine_tp, dtype=self.dtype, device=self.device,
            random_seed=self.random_seed, skip_tokenizer_init=True, log_level=self.log_level,
            weight_version=str(self.weight_version), return_routed_experts=self.return_routed_experts,
            enable_memory_saver=self.enable_memory_saver, enable_weights_cpu_backup=self.enable_weights_cpu_backup,
            deterministic=self.deterministic,
            enable_fp32_lm_head=self.enable_fp32_lm_head, disable_overlap_schedule=self.disable_overlap_schedule)
        optional = dict(mem_fraction=self.mem_fraction, attention_backend=self.attention_backend,
                        sampling_backend=self.sampling_backend, swa_full_tokens_ratio=self.swa_full_tokens_ratio,
                        max_total_tokens=self.max_total_tokens, max_running_requests=self.max_running_requests,
                        chunked_prefill_size=self.chunked_prefill_size)
        kw.update({k: v for k, v in optional.items() if v is not None})
        if self.nnodes > 1:
            kw.update(nnodes=self.nnodes, node_rank=self.node_rank, dist_init_addr=self.dist_init_addr)
        if self.base_gpu_id:
            kw["base_gpu_id"] = self.base_gpu_id
        kw = {SGLANG_NAMES.get(k, k): v for k, v in kw.items()}
        if self.lora is not None:
            kw["json_model_override_args"] = json.dumps({LORA_FIELD: self.lora.to_dict()})
        return kw

    def launch_env(self) -> dict[str, str]:
        """Environment variables the engine's own processes need (SGLang's hook for out-of-tree model classes,
        set only when this engine serves LoRA adapters)."""
        if self.lora is None:
            return {}
        return {"SGLANG_EXTERNAL_MODEL_PACKAGE": EXTERNAL_MODEL_PACKAGE}

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the in-process `sglang.Engine` (always token ids in/out: skip_tokenizer_init). A
        `server_args` value becomes the value SGLang's command line makes of it (`cli_args.parse`), so both launch
        paths give SGLang the same value."""
        from beamrl.rollout.sglang import cli_args

        extra = {k: cli_args.parse(k, v) for k, v in self.server_args.items()}
        return {**self._modelled_kwargs(), **extra}

    def launch_argv(self) -> list[str]:
        """Arguments after `python -m sglang.launch_server` (host/port included)."""
        from beamrl.rollout.sglang import cli_args

        kw = {**self._modelled_kwargs(), "host": self.host, "port": self.port, **self.server_args}
        return [arg for key, value in kw.items() for arg in cli_args.render(key, value)]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
