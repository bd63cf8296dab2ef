"""`BeamConfig`: the `config.json` of SGLang's native Beam (`model_type: beam`).

Field names and defaults are exactly those of `sglang/srt/configs/beam.py` (SGLang 0.5.23), so a file
written here is read by SGLang unchanged and vice versa. Validation follows SGLang's rules, but every error
names the field, the bad value and what is allowed (SGLang's messages do not).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beamrl.dtypes import DTYPES

SLIDING = "sliding_attention"
FULL = "full_attention"
DENSE = "dense"
SPARSE = "sparse"
DEFAULT_ROPE_THETA = 10000.0


class BeamConfigError(ValueError):
    """A Beam config field is missing, mistyped or outside the allowed values."""

    def __init__(self, field_name: str, value: Any, allowed: str):
        self.field_name, self.value, self.allowed = field_name, value, allowed
        super().__init__(f"BeamConfig.{field_name}={value!r} is invalid: {allowed}")


def default_layer_types(num_layers: int) -> list[str]:
    """Full attention on every 6th layer and on the last layer, sliding-window elsewhere (SGLang default)."""
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    if num_layers:
        types[-1] = FULL
    return types


def default_mlp_layer_types(num_layers: int) -> list[str]:
    """The first min(3, L) layers dense, the rest sparse (SGLang default)."""
    n_dense = min(3, num_layers)
    return [DENSE] * n_dense + [SPARSE] * (num_layers - n_dense)


def normalize_rope_parameters(raw: dict | None) -> dict:
    """Per-layer-type RoPE dict: default RoPE on sliding layers, NoPE (None) on full layers."""
    raw = dict(raw or {})
    extra = set(raw) - {SLIDING, FULL}
    if extra:
        raise BeamConfigError("rope_parameters", raw, f"only the keys {SLIDING!r} and {FULL!r} are allowed, got {sorted(extra)}")
    if raw.get(FULL) is not None:
        raise BeamConfigError("rope_parameters", raw, f"{FULL!r} must be null (full layers are NoPE)")
    sliding = raw.get(SLIDING) or {}
    if not isinstance(sliding, dict):
        raise BeamConfigError("rope_parameters", raw, f"{SLIDING!r} must be a mapping")
    if sliding.get("rope_type", "default") != "default":
        raise BeamConfigError("rope_parameters", raw, "rope_type must be 'default'")
    theta = sliding.get("rope_theta", DEFAULT_ROPE_THETA)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise BeamConfigError("rope_parameters", raw, "rope_theta must be a positive number")
    return {SLIDING: {"rope_type": "default", "rope_theta": float(theta)}, FULL: None}


@dataclass
class BeamConfig:
    """Beam model hyper-parameters (defaults: the 501B model). See docs/model.md."""

    vocab_size: int = 151936
    hidden_size: int = 5120
    intermediate_size: int = 20480
    num_hidden_layers: int = 52
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 1_048_576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    sliding_window: int | None = 512
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    moe_intermediate_size: int = 2560
    num_experts: int = 256
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    final_logit_softcapping: float | None = 30.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architectures: list[str] = field(default_factory=lambda: ["BeamForCausalLM"])
    dtype: str = "bfloat16"
    # Keys of config.json that Beam does not define (e.g. transformers_version); kept for round trips.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    model_type = "beam"

    def __post_init__(self) -> None:
        self._check_types()
        if self.num_hidden_layers <= 0:
            raise BeamConfigError("num_hidden_layers", self.num_hidden_layers, "must be a positive integer")
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        if self.mlp_layer_types is None:
            self.mlp_layer_types = default_mlp_layer_types(self.num_hidden_layers)
        self.layer_types = list(self.layer_types)
        self.mlp_layer_types = list(self.mlp_layer_types)
        self.rope_parameters = normalize_rope_parameters(self.rope_parameters)
        self.validate()

    # ---------------------------------------------------------------- validation
    _INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size",
                   "num_experts", "num_experts_per_tok", "n_group", "topk_group")
    _FLOAT_FIELDS = ("initializer_range", "rms_norm_eps", "attention_dropout", "routed_scaling_factor")

    def _check_types(self) -> None:
        for name in self._INT_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise BeamConfigError(name, v, "must be an integer")
        for name in self._FLOAT_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise BeamConfigError(name, v, "must be a finite number")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool)):
            raise BeamConfigError("sliding_window", self.sliding_window, "must be an integer or null")
        cap = self.final_logit_softcapping
        if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0):
            raise BeamConfigError("final_logit_softcapping", cap, "must be a positive number or null")
        if self.dtype not in DTYPES:
            raise BeamConfigError("dtype", self.dtype, f"allowed: {', '.join(map(repr, DTYPES))}")

    def validate(self) -> None:
        """Apply SGLang's Beam rules (configs/beam.py:141-212); raise `BeamConfigError` naming the field."""
        L = self.num_hidden_layers
        for name, allowed in (("layer_types", (SLIDING, FULL)), ("mlp_layer_types", (DENSE, SPARSE))):
            values = getattr(self, name)
            if len(values) != L:
                raise BeamConfigError(name, values, f"must have num_hidden_layers={L} entries, got {len(values)}")
            bad = [v for v in values if v not in allowed]
            if bad:
                raise BeamConfigError(name, values, f"entries must be one of {list(allowed)}, got {bad[0]!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                     "max_position_embeddings", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                raise BeamConfigError(name, getattr(self, name), "must be positive")
        if self.head_dim % 2:
            raise BeamConfigError("head_dim", self.head_dim, "must be even (split-half RoPE)")
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 2):
            raise BeamConfigError("sliding_window", self.sliding_window, "must be >= 2 when any layer is sliding_attention")
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise BeamConfigError("num_key_value_heads", self.num_key_value_heads,
                                  f"must be positive and divide num_attention_heads={self.num_attention_heads}")
        if SPARSE in self.mlp_layer_types:
            if self.n_group <= 0 or self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
                raise BeamConfigError("n_group", self.n_group,
                                      f"must split num_experts={self.num_experts} into equal groups of at least 2 experts")
            if not 1 <= self.topk_group <= self.n_group:
                raise BeamConfigError("topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
            limit = self.topk_group * (self.num_experts // self.n_group)
            if not 1 <= self.num_experts_per_tok <= limit:
                raise BeamConfigError("num_experts_per_tok", self.num_experts_per_tok,
                                      f"must be in [1, topk_group * experts_per_group = {limit}]")
        for name, expected in (("hidden_act", "silu"), ("tie_word_embeddings", False),
                               ("attention_bias", False), ("norm_topk_prob", True)):
            if getattr(self, name) != expected:
                raise BeamConfigError(name, getattr(self, name), f"native Beam requires {expected!r}")

    # ---------------------------------------------------------------- derived
    @property
    def rope_theta(self) -> float:
        return self.rope_parameters[SLIDING]["rope_theta"]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE

    @property
    def moe_layers(self) -> list[int]:
        """Global ids of the sparse (MoE) layers, in order."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe(i)]

    def residual_scales(self, layer: int, branch: str) -> tuple[float, float]:
        """(branch, residual) scales of the depth-scaled residual: d = 2(l+1) for 'attn', 2(l+1)+1 for 'mlp'.

        Computed in Python double exactly as SGLang does (beam.py:675-686)."""
        d = 2 * (layer + 1) + (1 if branch == "mlp" else 0)
        if branch not in ("attn", "mlp"):
            raise ValueError(f"branch must be 'attn' or 'mlp', got {branch!r}")
        den = math.sqrt(d)
        return 1.0 / den, math.sqrt(d - 1) / den

    def num_parameters(self, active_only: bool = False) -> int:
        """Parameter count from the weight table (active_only: top-k experts per MoE layer)."""
        from beamrl.models.beam.weights import expected_tensors

        total = 0
        for name, spec in expected_tensors(self).items():
            n = math.prod(spec.shape)
            if active_only and ".mlp.experts." in name:
                n = n * self.num_experts_per_tok // self.num_experts if spec.shape[0] == self.num_experts else (
                    n if int(name.split(".mlp.experts.")[1].split(".")[0]) < self.num_experts_per_tok else 0)
            total += n
        return total

    # ---------------------------------------------------------------- io
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d["model_type"] = "beam"
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BeamConfig":
        data = dict(data)
        mt = data.pop("model_type", "beam")
        if mt != "beam":
            raise BeamConfigError("model_type", mt, "must be 'beam'")
        if "torch_dtype" in data and "dtype" not in data:
            data["dtype"] = data.pop("torch_dtype")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        extra = {k: data.pop(k) for k in list(data) if k not in known}
        if data.get("dtype") is None:
            data["dtype"] = "bfloat16"
        return cls(**data, extra=extra)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "BeamConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"Beam config not found: {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise BeamConfigError("config.json", str(path), f"is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise BeamConfigError("config.json", str(path), "must hold a JSON object")
        return cls.from_dict(data)

    def save(self, directory: str | Path) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    def replace(self, **changes: Any) -> "BeamConfig":
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(changes)
        return BeamConfig(**d)
