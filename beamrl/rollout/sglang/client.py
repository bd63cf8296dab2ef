"""`SGLangClient`: what beamrl's two ways of reaching SGLang 0.5.23 share, written once.

`SGLangEngine` (the in-process `sglang.Engine`) and `SGLangHTTPEngine` (a server, over HTTP) call one API. This base
holds everything above the transport: the generation payloads and their parsing, and the weight-update session
(`SGLangSyncGuard`'s manifest and per-bucket checks, LoRA adapter sessions, the commit, the rollback from the host
mirror, the served version). A subclass gives the transport:

- `_generate_raw(body, timeout)`: one `/generate` call, its outputs as a list;
- `_call(endpoint, fields, timeout, error_cls)`: one call of SGLang's API by its endpoint name (the HTTP path, and
  the tokenizer manager's method of the same name), raising `error_cls` with SGLang's own message when refused;
- `_load_flat_bucket(bucket, timeout)`: `update_weights_from_tensor` of one flattened bucket (the payload differs:
  objects in process, strings of CUDA-IPC handles over HTTP); `_undo_bucket(bucket)` readies a host-mirror bucket
  for it (default: as it is).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from beamrl.models.beam.config import BeamConfig
from beamrl.protocols.rollout import EngineError, GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from beamrl.protocols.weights import UNTOUCHED, WeightReceiver, WeightSyncError
from beamrl.rollout.sglang import payloads
from beamrl.rollout.sglang.lora_status import STATUS_NAME, check_adapter_applied, decode_status
from beamrl.rollout.sglang.sync_guard import SGLangSyncGuard


class SGLangClient(RolloutEngine, WeightReceiver):
    """The transport-independent half of an SGLang engine (module docstring). Subclasses set `beam_config`,
    `_guard`, `_version` and `_adapters_before` in their constructor."""

    beam_config: BeamConfig
    _guard: SGLangSyncGuard
    _version: int
    _adapters_before: int  # LoRA: adapters the model class had applied when this adapter session began

    # ------------------------------------------------------------------ the transport
    @abstractmethod
    def _generate_raw(self, body: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        """One generate call with `body` (`payloads.generate_payload`); its outputs, one per request."""

    @abstractmethod
    def _call(self, endpoint: str, fields: dict[str, Any] | None, timeout: float,
              error_cls: type[Exception] = WeightSyncError) -> Any:
        """SGLang's `endpoint` with the request `fields`; `error_cls` when it fails or refuses."""

    @abstractmethod
    def _load_flat_bucket(self, bucket, timeout: float) -> None:
        """`update_weights_from_tensor` of one flattened bucket (`FlatBucket`)."""

    def _undo_bucket(self, bucket):
        """A bucket of the host mirror, ready for `_load_flat_bucket`."""
        return bucket

    # ------------------------------------------------------------------ generation
    def generate(self, requests: list[GenerateRequest], timeout: float) -> list[GenerateResult]:
        self._guard.require_serving("generate", EngineError)
        c = self.beam_config
        outs = self._generate_raw(payloads.generate_payload(requests), timeout)
        if len(outs) != len(requests):
            raise EngineError(f"{self.name} returned {len(outs)} outputs for {len(requests)} requests")
        return [payloads.parse_generate_output(o, r, c.num_hidden_layers, c.num_experts_per_tok, c.mlp_layer_types)
                for o, r in zip(outs, requests)]

    def score(self, sequences: list[list[int]], timeout: float) -> list[list[float]]:
        self._guard.require_serving("score", EngineError)
        for i, s in enumerate(sequences):
            if len(s) < 2:
                raise ValueError(f"score: sequence {i} has {len(s)} tokens; at least 2 are needed")
        reqs = [GenerateRequest(prompt_ids=list(s), sampling=SamplingParams(max_new_tokens=1)) for s in sequences]
        outs = self._generate_raw(payloads.generate_payload(reqs, logprob_start_len=0), timeout)
        return [payloads.parse_prompt_logprobs(o, len(s)) for o, s in zip(outs, sequences)]

    def generate_with_prompt_logprobs(self, requests: list[GenerateRequest], timeout: float
                                      ) -> list[tuple[GenerateResult, list[float]]]:
        """Generate and also return each prompt's logprobs (parity tools)."""
        c = self.beam_config
        outs = self._generate_raw(payloads.generate_payload(requests, logprob_start_len=0), timeout)
        return [(payloads.parse_generate_output(o, r, c.num_hidden_layers, c.num_experts_per_tok, c.mlp_layer_types),
                 payloads.parse_prompt_logprobs(o, len(r.prompt_ids))) for o, r in zip(outs, requests)]

    @property
    def weight_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ weight updates
    @property
    def sync_failure(self) -> str | None:
        """Why the engine does not serve after a failed weight sync (None: it serves)."""
        return self._guard.failure

    def begin_weight_update(self, manifest, timeout: float) -> None:
        """Check the session's manifest (`SGLangSyncGuard`), then open SGLang's session."""
        self._guard.begin(manifest, self._version)
        try:
            if self._guard.adapter_session:
                self._adapters_before = self.lora_status(timeout)["applied"]
            self._call("begin_weight_update", {"selector": "all"}, timeout)
        except BaseException:
            self._guard.aborted(f"{self.name} refused begin_weight_update", restored=False)
            raise

    def update_weights_from_tensor(self, bucket, timeout: float) -> None:
        self._guard.check_tensor_bucket(bucket)  # index, layout, checksum: before SGLang sees the bytes
        self._load_flat_bucket(bucket, timeout)
        self._guard.tensor_bucket_loaded(bucket)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout: float) -> None:
        self._call("init_weights_update_group",
                   {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                    "world_size": world_size, "group_name": group_name, "backend": backend}, timeout)

    def update_weights_from_distributed(self, index: int, checksum, group_name: str, timeout: float) -> None:
        """SGLang receives the broadcast itself, laid out as the manifest announced bucket `index`."""
        layout = self._guard.distributed_bucket(index)
        self._call("update_weights_from_distributed",
                   {"names": layout.names, "dtypes": layout.dtypes, "shapes": layout.shapes, "group_name": group_name,
                    "flush_cache": False, "load_format": "flattened_bucket"}, timeout)
        self._guard.distributed_bucket_loaded(index)

    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None:
        self._call("destroy_weights_update_group", {"group_name": group_name}, timeout)

    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        self._call("update_weights_from_disk", {"model_path": str(path)}, timeout)
        self._guard.disk_loaded(str(path))

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        """Commit: every announced bucket arrived intact (and an adapter session merged exactly one adapter); then
        close SGLang's session, set the version and flush the prefix cache (routes/KV of old weights). A failed
        commit is aborted (rolled back, or the engine stops serving)."""
        try:
            self._guard.settle(new_version)
            if self._guard.adapter_session:
                check_adapter_applied(self.lora_status(timeout), self._adapters_before, self.name)
        except WeightSyncError as exc:
            outcome = self.abort_weight_update(str(exc), timeout)
            raise WeightSyncError(f"{self.name}: session closed without serving version {new_version} "
                                  f"({outcome}): {exc}") from None
        self._call("end_weight_update", {}, timeout)
        self._guard.committed()
        self.update_weight_version(new_version, timeout)
        self._call("flush_cache", None, timeout)

    def abort_weight_update(self, reason: str, timeout: float) -> str:
        """Undo the session's buckets from the host mirror where possible, then close SGLang's session without a
        version change; otherwise the engine stops serving (`SGLangSyncGuard`)."""
        if self._guard.session is None:
            return UNTOUCHED
        if self._guard.adapter_merged:
            try:
                if self.lora_status(timeout)["applied"] == self._adapters_before:
                    self._guard.adapter_refused()  # nothing was merged: nothing to undo
            except WeightSyncError:
                pass  # cannot tell: undo as if it had been merged
        undo = self._guard.undo_buckets()
        restored = False
        if undo is not None:
            try:
                for bucket in undo:
                    self._load_flat_bucket(self._undo_bucket(bucket), timeout)
                restored = True
            except WeightSyncError:
                restored = False
        try:
            self._call("end_weight_update", {}, timeout)
        except WeightSyncError:
            restored = False
        return self._guard.aborted(reason, restored)

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        if int(new_version) < 0:
            raise WeightSyncError(f"weight version must be >= 0, got {new_version}")
        self._call("update_weight_version", {"new_version": str(int(new_version)), "abort_all_requests": False},
                   timeout)
        self._version = int(new_version)

    def served_weight_version(self, timeout: float) -> int:
        return self._version

    # ------------------------------------------------------------------ LoRA adapters (docs/lora.md)
    def lora_status(self, timeout: float) -> dict:
        """The LoRA state of beamrl's model class: {"adapter_id", "adapter_digest", "error", "targets", ...}
        (`lora_status.decode_status`)."""
        return decode_status(self._get_weights_by_name(STATUS_NAME, timeout), self.name)

    def _get_weights_by_name(self, name: str, timeout: float):
        return self._call("get_weights_by_name", {"name": name, "truncate_size": 1 << 62}, timeout)
