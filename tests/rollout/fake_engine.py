"""`FakeEngine`: a fast in-memory `RolloutEngine` + `WeightReceiver` for router/health unit tests.

It has no model: tokens, logprobs and routes are pseudo-random but shaped and aligned exactly as SGLang returns
them (held to the real engines by tests/rollout/test_engine_contract.py). Tests control its health:
`kill()` makes every call fail at once, `hang()` makes calls block until their timeout.
"""

from __future__ import annotations

import threading
import zlib

import numpy as np

from beamrl.models.beam.config import BeamConfig
from beamrl.protocols.rollout import EngineError, GenerateRequest, GenerateResult, RolloutEngine
from beamrl.protocols.weights import WeightReceiver, WeightSyncError


class FakeEngine(RolloutEngine, WeightReceiver):
    def __init__(self, config: BeamConfig, name: str = "fake", seed: int = 0) -> None:
        self.config = config
        self._name = name
        self._rng = np.random.default_rng(seed)
        self._version = 0
        self._in_session = False
        self._dead = False
        self._hang = False
        self._lock = threading.Lock()
        self.calls = 0
        self.last_timeout: float | None = None  # the timeout of the latest call (what a caller allowed it)

    @property
    def name(self) -> str:
        return self._name

    # ------------------------------------------------------------------ controls
    def kill(self) -> None:
        self._dead = True

    def hang(self, on: bool = True) -> None:
        self._hang = on

    def _enter(self, timeout: float, error_cls: type[Exception] = EngineError) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.calls += 1
        self.last_timeout = timeout
        if self._dead:
            raise error_cls(f"fake engine {self.name} is dead")
        if self._hang:
            threading.Event().wait(timeout)
            raise error_cls(f"fake engine {self.name}: timed out after {timeout:g} s")

    # ------------------------------------------------------------------ RolloutEngine
    def _routes(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        c = self.config
        out = np.full((rows, c.num_hidden_layers, c.num_experts_per_tok), -1, dtype=np.int32)
        for layer in c.moe_layers:
            for r in range(rows):
                out[r, layer] = rng.choice(c.num_experts, c.num_experts_per_tok, replace=False)
        return out

    def generate(self, requests: list[GenerateRequest], timeout: float) -> list[GenerateResult]:
        self._enter(timeout)
        results = []
        for req in requests:
            sp = req.sampling
            if sp.seed is not None or sp.temperature == 0:
                key = zlib.crc32(np.asarray(req.prompt_ids, dtype=np.int64).tobytes())
                rng = np.random.default_rng([key, self._version, 0 if sp.seed is None else sp.seed])
            else:
                rng = self._rng
            ids, finish = [], "length"
            for _ in range(sp.max_new_tokens):
                tok = int(rng.integers(1, self.config.vocab_size))
                ids.append(tok)
                # SGLang semantics: ignore_eos disables every token stop, stop_token_ids included.
                if not sp.ignore_eos and (tok in sp.stop_token_ids or tok == self.config.eos_token_id):
                    finish = "stop"
                    break
            lps = (-rng.exponential(3.0, len(ids)) - 1e-3).tolist()
            routes = self._routes(rng, len(req.prompt_ids) + len(ids) - 1) if req.return_routed_experts else None
            results.append(GenerateResult(prompt_ids=list(req.prompt_ids), output_ids=ids, output_logprobs=lps,
                                          finish_reason=finish, weight_version=self._version, routed_experts=routes,
                                          request_id=req.request_id))
        return results

    def score(self, sequences: list[list[int]], timeout: float) -> list[list[float]]:
        self._enter(timeout)
        out = []
        for s in sequences:
            if len(s) < 2:
                raise ValueError(f"score: a sequence has {len(s)} tokens; at least 2 are needed")
            rng = np.random.default_rng([zlib.crc32(np.asarray(s, dtype=np.int64).tobytes()), self._version])
            out.append((-rng.exponential(3.0, len(s) - 1)).tolist())
        return out

    def health(self, timeout: float) -> bool:
        try:
            self._enter(timeout)
            return True
        except EngineError:
            return False

    def abort_all(self, timeout: float) -> None:
        self._enter(timeout)

    def release_memory(self, tags, timeout: float) -> None:
        raise EngineError("fake engine: release_memory needs CUDA")

    def resume_memory(self, tags, timeout: float) -> None:
        raise EngineError("fake engine: resume_memory needs CUDA")

    @property
    def weight_version(self) -> int:
        return self._version

    def shutdown(self) -> None:
        self._dead = True

    # ------------------------------------------------------------------ WeightReceiver
    @property
    def tp_size(self) -> int:
        return 1

    def _need_session(self, what: str) -> None:
        if not self._in_session:
            raise WeightSyncError(f"fake engine: {what} must run between begin_weight_update() and end_weight_update()")

    def begin_weight_update(self, manifest, timeout: float) -> None:
        self._enter(timeout, WeightSyncError)
        if self._in_session:
            raise WeightSyncError("fake engine: a weight-update session is already open")
        self._in_session = True

    def update_weights_from_tensor(self, bucket, timeout: float) -> None:
        self._enter(timeout, WeightSyncError)
        self._need_session("update_weights_from_tensor")

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name, backend,
                                  timeout: float) -> None:
        self._enter(timeout, WeightSyncError)

    def update_weights_from_distributed(self, index, checksum, group_name, timeout: float) -> None:
        self._enter(timeout, WeightSyncError)
        self._need_session("update_weights_from_distributed")

    def destroy_weights_update_group(self, group_name, timeout: float) -> None:
        self._enter(timeout, WeightSyncError)

    def update_weights_from_disk(self, path, timeout: float) -> None:
        self._enter(timeout, WeightSyncError)

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        self._enter(timeout, WeightSyncError)
        self._need_session("end_weight_update")
        self._in_session = False
        self._version = int(new_version)

    def abort_weight_update(self, reason: str, timeout: float) -> str:
        self._enter(timeout, WeightSyncError)
        was, self._in_session = self._in_session, False
        return "unhealthy" if was else "untouched"
