"""The seam between the RL loop and rollout engines (SGLang or the embedded `native` engine).

Everything crosses it as token ids; text never does. Every method takes a timeout and raises
`EngineError` (never hangs) when the engine fails or does not answer in time.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np


class EngineError(RuntimeError):
    """An engine call failed or timed out; the message carries the engine's own words."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling controls shared by every engine. top_k=-1 and top_p=1.0 disable truncation."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be -1 (off) or >= 1")


@dataclass
class GenerateRequest:
    """One prompt to complete. `return_routed_experts` asks for R3 routes of every forwarded token."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False
    request_id: str | None = None


@dataclass
class GenerateResult:
    """What an engine returns for one request.

    `output_logprobs[i]` is log_softmax(softcapped FP32 logits / T) of `output_ids[i]`, before top-k/top-p.
    `routed_experts` (when asked) is int32 [prompt_len + output_len - 1, num_hidden_layers, top_k]: row t is
    token t's forward (the last sampled token is never forwarded); rows of dense layers are -1 (masked).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    routed_experts: np.ndarray | None = None
    request_id: str | None = None


class RolloutEngine(abc.ABC):
    """A rollout engine: generation, scoring, lifecycle and weight-update sessions."""

    @abc.abstractmethod
    def generate(self, requests: list[GenerateRequest], timeout: float) -> list[GenerateResult]:
        """Complete every request (batched as the engine likes); results in request order."""

    @abc.abstractmethod
    def score(self, sequences: list[list[int]], timeout: float) -> list[list[float]]:
        """Prompt logprobs: for each sequence, logprob of token i given tokens < i for i >= 1 (T = 1)."""

    @abc.abstractmethod
    def health(self, timeout: float) -> bool:
        """True when the engine answers within `timeout`."""

    @abc.abstractmethod
    def abort_all(self, timeout: float) -> None:
        """Abort every running or queued request (they finish with finish_reason 'abort')."""

    @abc.abstractmethod
    def release_memory(self, tags: list[str] | None, timeout: float) -> None:
        """Colocated mode: free 'weights' / 'kv_cache' / 'cuda_graph' (None = all). The engine must be idle."""

    @abc.abstractmethod
    def resume_memory(self, tags: list[str] | None, timeout: float) -> None:
        """Colocated mode: re-allocate what `release_memory` freed, in the order the caller gives."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights now served (bumped by every finished weight-update session)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and free its resources; idempotent."""
