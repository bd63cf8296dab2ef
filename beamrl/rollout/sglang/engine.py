"""`SGLangEngine`: SGLang 0.5.23's in-process `sglang.Engine` behind beamrl's `RolloutEngine` + `WeightReceiver`.

For single-node use and tests (the CPU engine in CI). The RL loop runs the HTTP server (`server.py`, one per node
of an engine) inside a Ray actor (`beamrl.loop.actors.EngineActor`), which also survives an engine crash without
taking the caller down.

Every call runs the tokenizer manager's coroutine on `engine.loop` under `asyncio.wait_for`, so it has a
timeout and never hangs; calls are serialized by a lock (one event loop). Child-process liveness is checked
before each call, so a dead engine fails at once with the dead process named.

Process-level effects, on purpose (SGLang assumes it owns the process):
- the engine is started in a worker thread so that start-up has a timeout; its log (and the scheduler's,
  which inherits the file descriptor) goes to `log_path`, whose tail is quoted when start-up fails;
- SGLang answers a child crash with SIGQUIT -> kill the whole process tree. `SGLangEngine` installs a SIGQUIT
  handler that marks the engine dead instead, so a crashed engine raises `EngineError` and the caller lives;
- shutdown kills only this engine's child processes (SGLang's own shutdown kills every child of the process).
Use at most one in-process engine per process (SGLang's globals are per process).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Callable, Iterator

from beamrl.environ import scoped_environ
from beamrl.models.beam.config import BeamConfig
from beamrl.processes import running, stop_processes
from beamrl.protocols.rollout import EngineError, GenerateRequest, GenerateResult, RolloutEngine
from beamrl.rollout.sglang import payloads
from beamrl.rollout.sglang.config import SGLangEngineConfig
from beamrl.protocols.weights import UNTOUCHED, WeightReceiver, WeightSyncError
from beamrl.rollout.sglang.sync_guard import SGLangSyncGuard
from beamrl.rollout.sglang.lora_status import STATUS_NAME, check_adapter_applied, decode_status

_LIVE_ENGINES: "weakref.WeakSet[SGLangEngine]" = weakref.WeakSet()
PAUSE_MODES = ("abort", "retract", "in_place")


def _on_sigquit(signum, frame) -> None:
    """SGLang's children (and its watchdog) send SIGQUIT when a child dies; mark engines dead, keep the process."""
    for engine in list(_LIVE_ENGINES):
        engine._note_children()


def log_tail(path: str | Path | None, lines: int = 40) -> str:
    """The last `lines` lines of a log file ('' when there is none)."""
    if path is None or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


class SGLangEngine(RolloutEngine, WeightReceiver):
    """In-process SGLang engine. `start()` launches it (also done by the constructor unless `start=False`)."""

    def __init__(self, config: SGLangEngineConfig, start_timeout: float = 600.0, log_path: str | Path | None = None,
                 start: bool = True, rollback: bool | None = None) -> None:
        """`rollback`: undo a failed weight-update session from a host mirror of the weights (None: on CPU only;
        `SGLangSyncGuard`)."""
        self.config = config
        self.beam_config = BeamConfig.from_json_file(config.model_path)
        self.start_timeout = start_timeout
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="beamrl-sglang-")) / "engine.log"
        self._engine: Any = None
        self._child_pids: list[int] = []
        self._dead_reason: str | None = None
        self._lock = threading.Lock()
        self._version = config.weight_version
        self._in_session = False
        self._guard = SGLangSyncGuard(self.name, self.beam_config, config.dtype, config.model_path,
                                      rollback=config.device == "cpu" if rollback is None else rollback,
                                      lora=config.lora)
        self._adapters_before = 0  # LoRA: adapters the model class had applied when this adapter session began
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Launch the engine (blocking, at most `start_timeout` s); raise `EngineError` with the log tail."""
        if self._engine is not None:
            return
        if self.config.nnodes > 1:
            raise EngineError("the in-process SGLang engine runs on one node; a multi-node engine is one server per "
                              "node (SGLangHTTPEngine + SGLangFollower)")
        if self.config.device == "cpu":
            from beamrl.compat.sglang_cpu import activate

            activate()
        import psutil

        # multiprocessing's resource tracker belongs to this process (one per process, started on first use, e.g. by
        # SGLang's spawn below). Started now, it is not taken for one of the engine's children: it ignores SIGTERM,
        # so a shutdown would wait out its grace for it and then SIGKILL a helper this process still uses.
        resource_tracker.ensure_running()
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        box: dict[str, Any] = {}
        started = threading.Event()
        self._stop = threading.Event()

        def launch() -> None:
            try:
                import sglang

                box["engine"] = sglang.Engine(**self.config.engine_kwargs())
            except BaseException as e:  # noqa: BLE001 - reported to the caller below
                box["error"] = e
                started.set()
                return
            started.set()
            # SGLang's children die with the *thread* that spawned them (PR_SET_PDEATHSIG): keep it alive.
            self._stop.wait()

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with _stderr_to(self.log_path), _spawn_env(self.config), scoped_environ(self.config.launch_env()):
            thread = threading.Thread(target=launch, name="sglang-engine-owner", daemon=True)
            thread.start()
            started.wait(self.start_timeout)
        if "engine" not in box:
            new = {p.pid for p in psutil.Process().children(recursive=True)} - before
            _kill_pids(sorted(new))
            why = (f"did not start within {self.start_timeout:.0f} s" if "error" not in box
                   else f"failed to start: {type(box['error']).__name__}: {box['error']}")
            self._stop.set()
            raise EngineError(f"SGLang engine ({self.config.model_path}) {why}\n--- engine log tail "
                              f"({self.log_path}) ---\n{log_tail(self.log_path)}")
        self._engine = box["engine"]
        self._child_pids = list(self._engine.get_all_child_pids())
        for pid in psutil.Process().children(recursive=True):  # the detokenizer is not in all_child_pids
            if pid.pid not in before and pid.pid not in self._child_pids:
                self._child_pids.append(pid.pid)
        # Watch only processes still alive after start-up (SGLang also lists short-lived helpers).
        self._child_pids = [pid for pid in self._child_pids if running(pid)]
        # Run the tokenizer manager's loop set-up now (it would otherwise install SGLang's
        # kill-the-process-tree SIGQUIT handler on the first request), then put ours in its place.
        tm = self._engine.tokenizer_manager

        async def setup() -> None:
            tm.auto_create_handle_loop()

        self._engine.loop.run_until_complete(setup())
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGQUIT, signal.SIGTERM):
                self._engine.loop.remove_signal_handler(sig)
            signal.signal(signal.SIGQUIT, _on_sigquit)
        atexit.unregister(self._engine.shutdown)
        atexit.register(self.shutdown)
        _LIVE_ENGINES.add(self)
        self.startup_seconds = time.monotonic() - t0
        if self.config.lora is not None:
            self._check_lora_class()

    @property
    def name(self) -> str:
        return f"sglang-inproc[{self.config.model_path}]"

    @property
    def child_pids(self) -> list[int]:
        """PIDs of this engine's scheduler/detokenizer processes."""
        return list(self._child_pids)

    def _note_children(self) -> None:
        for pid in self._child_pids:
            if not running(pid):
                self._dead_reason = f"SGLang engine process {pid} has exited (log: {self.log_path})"
                return

    def _check_alive(self, error_cls: type[Exception]) -> None:
        if self._engine is None:
            raise error_cls("SGLang engine is not running (never started or already shut down)")
        if self._dead_reason is None:
            self._note_children()
        if self._dead_reason is not None:
            raise error_cls(self._dead_reason)

    def shutdown(self) -> None:
        if self._engine is None:
            return
        watchdog = getattr(self._engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        _kill_pids(self._child_pids)
        self._stop.set()
        self._engine = None
        self._dead_reason = "SGLang engine was shut down"
        _LIVE_ENGINES.discard(self)
        atexit.unregister(self.shutdown)

    # ------------------------------------------------------------------ the one way to call the engine
    def _run(self, make_coro: Callable[[], Any], timeout: float, what: str,
             error_cls: type[Exception] = EngineError, on_timeout: Callable[[], None] | None = None) -> Any:
        if timeout <= 0:
            raise ValueError(f"{what}: timeout must be > 0, got {timeout}")
        with self._lock:
            self._check_alive(error_cls)
            loop = self._engine.loop
            try:
                return loop.run_until_complete(asyncio.wait_for(make_coro(), timeout))
            except (asyncio.TimeoutError, TimeoutError):
                if on_timeout is not None:
                    on_timeout()
                self._note_children()
                extra = f" ({self._dead_reason})" if self._dead_reason else ""
                raise error_cls(f"SGLang engine: {what} timed out after {timeout:g} s{extra}") from None
            except error_cls:
                raise
            except Exception as e:  # SGLang raises ValueError/AssertionError/... with its own message
                raise error_cls(f"SGLang engine: {what} failed: {type(e).__name__}: {e}") from e

    def _rpc(self, method: str, obj: Any, timeout: float, error_cls: type[Exception] = WeightSyncError) -> Any:
        tm = self._engine.tokenizer_manager if self._engine is not None else None
        result = self._run(lambda: getattr(tm, method)(obj, None), timeout, method, error_cls)
        payloads.check_success(result, f"SGLang engine: {method}", error_cls)
        return result

    # ------------------------------------------------------------------ generation
    def _generate_raw(self, body: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        tm = self._engine.tokenizer_manager if self._engine is not None else None

        async def go():
            return await tm.generate_request(GenerateReqInput(**body), None).__anext__()

        out = self._run(go, timeout, "generate", EngineError,
                        on_timeout=lambda: tm.abort_request(abort_all=True))
        return out if isinstance(out, list) else [out]

    def generate(self, requests: list[GenerateRequest], timeout: float) -> list[GenerateResult]:
        self._guard.require_serving("generate", EngineError)
        c = self.beam_config
        outs = self._generate_raw(payloads.generate_payload(requests), timeout)
        if len(outs) != len(requests):
            raise EngineError(f"SGLang engine returned {len(outs)} outputs for {len(requests)} requests")
        return [payloads.parse_generate_output(o, r, c.num_hidden_layers, c.num_experts_per_tok, c.mlp_layer_types)
                for o, r in zip(outs, requests)]

    def score(self, sequences: list[list[int]], timeout: float) -> list[list[float]]:
        from beamrl.protocols.rollout import SamplingParams

        self._guard.require_serving("score", EngineError)
        reqs = [GenerateRequest(prompt_ids=list(s), sampling=SamplingParams(max_new_tokens=1, temperature=1.0))
                for s in sequences]
        for i, s in enumerate(sequences):
            if len(s) < 2:
                raise ValueError(f"score: sequence {i} has {len(s)} tokens; at least 2 are needed")
        outs = self._generate_raw(payloads.generate_payload(reqs, logprob_start_len=0), timeout)
        return [payloads.parse_prompt_logprobs(o, len(s)) for o, s in zip(outs, sequences)]

    def generate_with_prompt_logprobs(self, requests: list[GenerateRequest], timeout: float
                                      ) -> list[tuple[GenerateResult, list[float]]]:
        """Generate and also return each prompt's logprobs (parity tools)."""
        c = self.beam_config
        outs = self._generate_raw(payloads.generate_payload(requests, logprob_start_len=0), timeout)
        return [(payloads.parse_generate_output(o, r, c.num_hidden_layers, c.num_experts_per_tok, c.mlp_layer_types),
                 payloads.parse_prompt_logprobs(o, len(r.prompt_ids))) for o, r in zip(outs, requests)]

    def health(self, timeout: float) -> bool:
        tm = self._engine.tokenizer_manager if self._engine is not None else None
        try:
            self._run(lambda: tm.get_internal_state(), timeout, "health")
            return True
        except (EngineError, ValueError):
            return False

    def abort_all(self, timeout: float) -> None:
        tm = self._engine.tokenizer_manager if self._engine is not None else None

        async def go() -> None:
            tm.abort_request(abort_all=True)

        self._run(go, timeout, "abort_all")

    def pause_generation(self, mode: str, timeout: float) -> None:
        """Pause the scheduler: 'abort' (return all requests), 'retract' or 'in_place' (sglang-integration §4.6).
        Use 'abort' or 'in_place' with R3: 'retract' re-prefills and overwrites the recorded routes."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; allowed: {list(PAUSE_MODES)}")
        tm = self._engine.tokenizer_manager if self._engine is not None else None
        self._run(lambda: tm.pause_generation(PauseGenerationReqInput(mode=mode)), timeout, "pause_generation")

    def continue_generation(self, timeout: float) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        tm = self._engine.tokenizer_manager if self._engine is not None else None
        self._run(lambda: tm.continue_generation(ContinueGenerationReqInput()), timeout, "continue_generation")

    def flush_cache(self, timeout: float) -> None:
        tm = self._engine.tokenizer_manager if self._engine is not None else None
        out = self._run(lambda: tm.flush_cache(), timeout, "flush_cache")
        payloads.check_success(out, "SGLang engine: flush_cache (refused while requests run)", EngineError)

    def _memory_call(self, method: str, tags: list[str] | None, timeout: float) -> None:
        from sglang.srt.managers import io_struct

        if self.config.device != "cuda" or not self.config.enable_memory_saver:
            raise EngineError(f"{method} needs a CUDA engine launched with enable_memory_saver=True "
                              f"(device={self.config.device!r}, enable_memory_saver={self.config.enable_memory_saver})")
        cls = (io_struct.ReleaseMemoryOccupationReqInput if method.startswith("release")
               else io_struct.ResumeMemoryOccupationReqInput)
        self._rpc(method, cls(tags=tags), timeout, EngineError)

    def release_memory(self, tags: list[str] | None, timeout: float) -> None:
        self._memory_call("release_memory_occupation", tags, timeout)

    def resume_memory(self, tags: list[str] | None, timeout: float) -> None:
        self._memory_call("resume_memory_occupation", tags, timeout)

    @property
    def weight_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ weight updates
    @property
    def tp_size(self) -> int:
        return self.config.engine_tp

    @property
    def sync_failure(self) -> str | None:
        """Why the engine does not serve after a failed weight sync (None: it serves)."""
        return self._guard.failure

    def begin_weight_update(self, manifest, timeout: float) -> None:
        """Check the session's manifest (`SGLangSyncGuard`), then open SGLang's session."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        self._guard.begin(manifest, self._version)
        try:
            if self._guard.adapter_session:
                self._adapters_before = self.lora_status(timeout)["applied"]
            self._rpc("begin_weight_update", BeginWeightUpdateReqInput(selector="all"), timeout)
        except BaseException:
            self._guard.aborted("SGLang refused begin_weight_update", restored=False)
            raise
        self._in_session = True

    def _load_flat_bucket(self, bucket, timeout: float) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads.flattened_bucket_payloads(bucket, self.tp_size, as_str=False),
            load_format="flattened_bucket", flush_cache=False)
        self._rpc("update_weights_from_tensor", obj, timeout)

    def update_weights_from_tensor(self, bucket, timeout: float) -> None:
        self._guard.check_tensor_bucket(bucket)  # index, layout, checksum: before SGLang sees the bytes
        self._load_flat_bucket(bucket, timeout)
        self._guard.tensor_bucket_loaded(bucket)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout: float) -> None:
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        obj = InitWeightsUpdateGroupReqInput(master_address=master_address, master_port=master_port,
                                             rank_offset=rank_offset, world_size=world_size,
                                             group_name=group_name, backend=backend)
        self._rpc("init_weights_update_group", obj, timeout)

    def update_weights_from_distributed(self, index: int, checksum, group_name: str, timeout: float) -> None:
        """SGLang receives the broadcast itself, laid out as the manifest announced bucket `index`."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        layout = self._guard.distributed_bucket(index)
        obj = UpdateWeightsFromDistributedReqInput(names=layout.names, dtypes=layout.dtypes, shapes=layout.shapes,
                                                   group_name=group_name, flush_cache=False,
                                                   load_format="flattened_bucket")
        self._rpc("update_weights_from_distributed", obj, timeout)
        self._guard.distributed_bucket_loaded(index)

    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None:
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput

        self._rpc("destroy_weights_update_group", DestroyWeightsUpdateGroupReqInput(group_name=group_name), timeout)

    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        self._rpc("update_weights_from_disk", UpdateWeightFromDiskReqInput(model_path=str(path)), timeout)
        self._guard.disk_loaded(str(path))

    def _end_sglang_session(self, timeout: float) -> None:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        try:
            self._rpc("end_weight_update", EndWeightUpdateReqInput(), timeout)
        finally:
            self._in_session = False

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        """Commit: every announced bucket arrived intact; then close SGLang's session, set the version and flush
        the prefix cache (routes/KV of old weights). A failed commit is aborted (rolled back or unhealthy)."""
        try:
            self._guard.settle(new_version)
            if self._guard.adapter_session:
                self._check_adapter_merged(timeout)
        except WeightSyncError as exc:
            outcome = self.abort_weight_update(str(exc), timeout)
            raise WeightSyncError(f"{self.name}: session closed without serving version {new_version} "
                                  f"({outcome}): {exc}") from None
        self._end_sglang_session(timeout)
        self._guard.committed()
        self.update_weight_version(new_version, timeout)
        self.flush_cache(timeout)

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
                    self._load_flat_bucket(bucket, timeout)
                restored = True
            except WeightSyncError:
                restored = False
        try:
            self._end_sglang_session(timeout)
        except WeightSyncError:
            restored = False
        return self._guard.aborted(reason, restored)

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        if int(new_version) < 0:
            raise WeightSyncError(f"weight version must be >= 0, got {new_version}")
        tm = self._engine.tokenizer_manager if self._engine is not None else None
        obj = UpdateWeightVersionReqInput(new_version=str(int(new_version)), abort_all_requests=False)
        self._run(lambda: tm.update_weight_version(obj), timeout, "update_weight_version", WeightSyncError)
        self._version = int(new_version)

    def served_weight_version(self, timeout: float) -> int:
        return self._version

    def weights_checksum(self, timeout: float) -> str:
        """SGLang's own checksum of every parameter the engine computes with (`check_weights`, action
        'checksum'): equal before and after a refused or rolled-back sync, different after a real one."""
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        tm = self._engine.tokenizer_manager if self._engine is not None else None
        out = self._run(lambda: tm.check_weights(CheckWeightsReqInput(action="checksum")), timeout, "check_weights",
                        WeightSyncError)
        ok, message, _ranks, digest = out
        if not ok or digest is None:
            raise WeightSyncError(f"SGLang engine: check_weights(checksum) failed: {message}")
        return digest


    # ------------------------------------------------------------------ LoRA adapters (docs/lora.md)
    def _check_lora_class(self) -> None:
        """SGLang skips an out-of-tree model module that fails to import (a warning in its log) and serves its
        own class: refuse to run a LoRA engine that way."""
        try:
            self.lora_status(60.0)
        except WeightSyncError as e:
            self.shutdown()
            raise EngineError(f"SGLang engine started without beamrl's LoRA model class ({e}); see the engine log "
                              f"{self.log_path}\n{log_tail(self.log_path)}") from None

    def lora_status(self, timeout: float) -> dict:
        """The LoRA state of beamrl's model class: {"adapter_id", "adapter_digest", "error", "targets", ...}."""
        return decode_status(self._get_weights_by_name(STATUS_NAME, timeout), self.name)

    def lora_effective_weight(self, name: str, timeout: float):
        """The HF weight `name` as the engine now computes with it (rank 0's TP shard), as an FP32 tensor."""
        import torch

        out = self._get_weights_by_name(name, timeout)
        if out is None:
            raise WeightSyncError(f"SGLang engine: no weight {name!r}")
        return torch.tensor(out, dtype=torch.float64).float()

    def _get_weights_by_name(self, name: str, timeout: float):
        from sglang.srt.managers.io_struct import GetWeightsByNameReqInput

        tm = self._engine.tokenizer_manager if self._engine is not None else None
        return self._run(lambda: tm.get_weights_by_name(GetWeightsByNameReqInput(name=name, truncate_size=1 << 62),
                                                        None), timeout, "get_weights_by_name", WeightSyncError)

    def _check_adapter_merged(self, timeout: float) -> None:
        """After an adapter session's last bucket: beamrl's model class must have merged exactly one more adapter
        and recorded no refusal (it cannot raise out of SGLang's loader)."""
        check_adapter_applied(self.lora_status(timeout), self._adapters_before, self.name)


@contextmanager
def _spawn_env(config: SGLangEngineConfig) -> Iterator[None]:
    """On CPU, SGLang's spawned processes need the compat shims (beamrl.compat.sglang_cpu.spawn_env) and, with
    several TP ranks, the CPU engine's TP settings (`tp_env`), set only while the engine starts."""
    if config.device != "cpu":
        yield
        return
    from beamrl.compat.sglang_cpu import spawn_env, tp_env

    extra = tp_env(config.base_gpu_id + config.engine_tp) if config.engine_tp > 1 else {}
    with scoped_environ(extra), spawn_env():
        yield


@contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Point fd 2 at `path` while SGLang starts: its spawned processes inherit it and keep logging there."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def _kill_pids(pids: list[int], grace: float = 5.0) -> None:
    """Stop the engine's processes `pids` and everything they started (`beamrl.processes.stop_processes`)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [*p.children(recursive=True), p]
        except psutil.NoSuchProcess:
            continue
    stop_processes(procs, grace)
