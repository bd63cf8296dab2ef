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
from beamrl.protocols.rollout import EngineError
from beamrl.protocols.weights import WeightSyncError
from beamrl.rollout.sglang import payloads
from beamrl.rollout.sglang.client import SGLangClient
from beamrl.rollout.sglang.engine import PAUSE_MODES
from beamrl.rollout.sglang.sync_guard import SGLangSyncGuard


class SGLangHTTPEngine(SGLangClient):
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
        self._guard = SGLangSyncGuard(self.name, beam_config, dtype, model_path or "", rollback=rollback, lora=lora)
        self._adapters_before = 0

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

    def _call(self, endpoint: str, fields: dict[str, Any] | None, timeout: float,
              error_cls: type[Exception] = WeightSyncError) -> Any:
        return self._post("/" + endpoint, fields, timeout, error_cls)

    # ------------------------------------------------------------------ generation
    def _generate_raw(self, body: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        out = self._post("/generate", body, timeout)
        return out if isinstance(out, list) else [out]

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

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        self._session.close()

    # ------------------------------------------------------------------ weight updates
    @property
    def tp_size(self) -> int:
        return self._tp_size

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

    def _undo_bucket(self, bucket):
        bucket.buffer = bucket.buffer.to("cuda")  # the mirror lives in host memory; the server takes CUDA-IPC handles
        return bucket
