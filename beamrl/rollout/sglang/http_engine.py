"""`SGLangHTTPEngine`: a running SGLang 0.5.23 HTTP server behind `RolloutEngine` + `WeightReceiver`.

Every request has a timeout (`requests`); a refused connection or a `success: false` reply raises
`EngineError`/`WeightSyncError` with the server's own message. Optionally owns an `SGLangServer` (shut down
with the engine). With an `api_key` every request carries it (`Authorization: Bearer`), as SGLang's `--api-key`
requires. Of a multi-node engine only the leader (node rank 0) is an `SGLangHTTPEngine`; the other nodes are
`SGLangFollower`s (`follower.py`).
"""

from __future__ import annotations

from typing import Any

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.protocols.rollout import EngineError, GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from beamrl.rollout.sglang import payloads
from beamrl.rollout.sglang.engine import PAUSE_MODES
from beamrl.protocols.weights import UNTOUCHED, WeightReceiver, WeightSyncError
from beamrl.rollout.sglang.lora_status import STATUS_NAME, check_adapter_applied, decode_status
from beamrl.rollout.sglang.sync_guard import SGLangSyncGuard


class SGLangHTTPEngine(RolloutEngine, WeightReceiver):
    """Client of one SGLang server at `url`. `beam_config` gives the route layout (num layers, top-k, MLP types)."""

    def __init__(self, url: str, beam_config: BeamConfig, tp_size: int = 1, weight_version: int = 0,
                 memory_saver: bool = False, server=None, dtype: str = "auto", model_path: str | None = None,
                 rollback: bool = False, api_key: str | None = None, lora: LoRAConfig | None = None) -> None:
        """`dtype`: the engine's serving dtype ('auto': the checkpoint's). `rollback` (needs `model_path`, the
        checkpoint the server started from): undo a failed weight-update session from a host mirror
        (`SGLangSyncGuard`; off by default: GPU servers hold weights too large to mirror). `api_key`: the
        server's `--api-key`, sent with every request."""
        import requests

        if rollback and model_path is None:
            raise ValueError("SGLangHTTPEngine(rollback=True) needs model_path (the mirror's starting point)")
        self.url = url.rstrip("/")
        self.beam_config = beam_config
        self._tp_size = tp_size
        self._version = weight_version
        self._memory_saver = memory_saver
        self.server = server
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        self._in_session = False
        self._guard = SGLangSyncGuard(self.name, beam_config, dtype, model_path or "", rollback=rollback, lora=lora)
        self._adapters_before = 0  # LoRA: adapters the model class had applied when this adapter session began

    @classmethod
    def launch(cls, config, start_timeout: float = 600.0, log_path=None) -> "SGLangHTTPEngine":
        """Start an `SGLangServer` for `config` and return a client that owns it."""
        from beamrl.rollout.sglang.server import SGLangServer

        if config.node_rank != 0:
            raise ValueError(f"node rank {config.node_rank} of a multi-node engine serves no API: launch it as an "
                             "SGLangFollower")
        server = SGLangServer(config, log_path=log_path).start(start_timeout)
        return cls(server.url, BeamConfig.from_json_file(config.model_path), tp_size=config.engine_tp,
                   weight_version=config.weight_version, memory_saver=config.enable_memory_saver, server=server,
                   dtype=config.dtype, model_path=config.model_path, api_key=config.api_key, lora=config.lora)

    @property
    def name(self) -> str:
        return f"sglang@{self.url}"

    # ------------------------------------------------------------------ transport
    def _post(self, path: str, body: dict[str, Any] | None, timeout: float, error_cls: type[Exception] = EngineError,
              method: str = "POST") -> Any:
        import requests

        if timeout <= 0:
            raise ValueError(f"{path}: timeout must be > 0, got {timeout}")
        if self.server is not None and not self.server.is_running():
            raise error_cls(f"SGLang server {self.url} is not running (log: {self.server.log_path})")
        try:
            resp = self._session.request(method, self.url + path, json=body, timeout=timeout)
        except requests.Timeout:
            raise error_cls(f"SGLang server {self.url}{path} timed out after {timeout:g} s") from None
        except requests.RequestException as e:
            raise error_cls(f"SGLang server {self.url}{path} unreachable: {type(e).__name__}: {e}") from None
        try:
            data = resp.json()
        except ValueError:
            data = resp.text
        if resp.status_code != 200:
            msg = data.get("message", data) if isinstance(data, dict) else data
            raise error_cls(f"SGLang server {self.url}{path} answered HTTP {resp.status_code}: {msg}")
        payloads.check_success(data, f"SGLang server {self.url}{path}", error_cls)
        return data

    # ------------------------------------------------------------------ generation
    def _generate_raw(self, body: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        out = self._post("/generate", body, timeout)
        return out if isinstance(out, list) else [out]

    def generate(self, requests: list[GenerateRequest], timeout: float) -> list[GenerateResult]:
        self._guard.require_serving("generate", EngineError)
        c = self.beam_config
        outs = self._generate_raw(payloads.generate_payload(requests), timeout)
        if len(outs) != len(requests):
            raise EngineError(f"SGLang server returned {len(outs)} outputs for {len(requests)} requests")
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

    def health(self, timeout: float) -> bool:
        try:
            self._post("/health", None, timeout, method="GET")
            return True
        except EngineError:
            return False

    def abort_all(self, timeout: float) -> None:
        self._post("/abort_request", {"rid": "", "abort_all": True}, timeout)

    def pause_generation(self, mode: str, timeout: float) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; allowed: {list(PAUSE_MODES)}")
        self._post("/pause_generation", {"mode": mode}, timeout)

    def continue_generation(self, timeout: float) -> None:
        self._post("/continue_generation", {}, timeout)

    def flush_cache(self, timeout: float) -> None:
        self._post("/flush_cache", None, timeout)

    def release_memory(self, tags: list[str] | None, timeout: float) -> None:
        if not self._memory_saver:
            raise EngineError("release_memory needs a CUDA server launched with enable_memory_saver=True")
        self._post("/release_memory_occupation", {"tags": tags}, timeout)

    def resume_memory(self, tags: list[str] | None, timeout: float) -> None:
        if not self._memory_saver:
            raise EngineError("resume_memory needs a CUDA server launched with enable_memory_saver=True")
        self._post("/resume_memory_occupation", {"tags": tags}, timeout)

    @property
    def weight_version(self) -> int:
        return self._version

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        self._session.close()

    # ------------------------------------------------------------------ weight updates
    @property
    def tp_size(self) -> int:
        return self._tp_size

    @property
    def sync_failure(self) -> str | None:
        """Why the engine does not serve after a failed weight sync (None: it serves)."""
        return self._guard.failure

    def begin_weight_update(self, manifest, timeout: float) -> None:
        """Check the session's manifest (`SGLangSyncGuard`), then open the server's session."""
        self._guard.begin(manifest, self._version)
        try:
            if self._guard.adapter_session:
                self._adapters_before = self.lora_status(timeout)["applied"]
            self._post("/begin_weight_update", {"selector": "all"}, timeout, WeightSyncError)
        except BaseException:
            self._guard.aborted("the server refused begin_weight_update", restored=False)
            raise
        self._in_session = True

    def _load_flat_bucket(self, bucket, timeout: float) -> None:
        if not bucket.on_cuda:
            # SGLang's serializer shares a CPU tensor through a file descriptor that only processes of the
            # sender's multiprocessing family can fetch; the server's scheduler cannot (it dies on the payload).
            raise WeightSyncError(
                f"{self.name}: update_weights_from_tensor over HTTP needs the bucket on CUDA (CUDA-IPC handles), "
                f"got a CPU bucket; use update_weights_from_distributed or update_weights_from_disk instead")
        body = {"serialized_named_tensors": payloads.flattened_bucket_payloads(bucket, self.tp_size, as_str=True),
                "load_format": "flattened_bucket", "flush_cache": False}
        self._post("/update_weights_from_tensor", body, timeout, WeightSyncError)

    def update_weights_from_tensor(self, bucket, timeout: float) -> None:
        """Colocated path: the payload carries CUDA-IPC handles, so the bucket must be on a CUDA device."""
        self._guard.check_tensor_bucket(bucket)
        self._load_flat_bucket(bucket, timeout)
        self._guard.tensor_bucket_loaded(bucket)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout: float) -> None:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        self._post("/init_weights_update_group", body, timeout, WeightSyncError)

    def update_weights_from_distributed(self, index: int, checksum, group_name: str, timeout: float) -> None:
        layout = self._guard.distributed_bucket(index)
        body = {"names": layout.names, "dtypes": layout.dtypes, "shapes": layout.shapes, "group_name": group_name,
                "flush_cache": False, "load_format": "flattened_bucket"}
        self._post("/update_weights_from_distributed", body, timeout, WeightSyncError)
        self._guard.distributed_bucket_loaded(index)

    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None:
        self._post("/destroy_weights_update_group", {"group_name": group_name}, timeout, WeightSyncError)

    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        self._post("/update_weights_from_disk", {"model_path": str(path)}, timeout, WeightSyncError)
        self._guard.disk_loaded(str(path))

    def _end_server_session(self, timeout: float) -> None:
        try:
            self._post("/end_weight_update", {}, timeout, WeightSyncError)
        finally:
            self._in_session = False

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        """Commit (every bucket arrived intact), close the session, then set the version and flush the cache."""
        try:
            self._guard.settle(new_version)
            if self._guard.adapter_session:
                check_adapter_applied(self.lora_status(timeout), self._adapters_before, self.name)
        except WeightSyncError as exc:
            outcome = self.abort_weight_update(str(exc), timeout)
            raise WeightSyncError(f"{self.name}: session closed without serving version {new_version} "
                                  f"({outcome}): {exc}") from None
        self._end_server_session(timeout)
        self._guard.committed()
        self.update_weight_version(new_version, timeout)
        self._post("/flush_cache", None, timeout, WeightSyncError)

    def abort_weight_update(self, reason: str, timeout: float) -> str:
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
                for bucket in undo:  # the mirror lives in host memory; the server takes CUDA-IPC payloads
                    bucket.buffer = bucket.buffer.to("cuda")
                    self._load_flat_bucket(bucket, timeout)
                restored = True
            except WeightSyncError:
                restored = False
        try:
            self._end_server_session(timeout)
        except WeightSyncError:
            restored = False
        return self._guard.aborted(reason, restored)

    def lora_status(self, timeout: float) -> dict:
        """The LoRA state of beamrl's model class (`lora_status.decode_status`)."""
        out = self._post("/get_weights_by_name", {"name": STATUS_NAME, "truncate_size": 1 << 62}, timeout,
                         WeightSyncError)
        return decode_status(out, self.name)

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        if int(new_version) < 0:
            raise WeightSyncError(f"weight version must be >= 0, got {new_version}")
        self._post("/update_weight_version", {"new_version": str(int(new_version)), "abort_all_requests": False},
                   timeout, WeightSyncError)
        self._version = int(new_version)

    def served_weight_version(self, timeout: float) -> int:
        return self._version
