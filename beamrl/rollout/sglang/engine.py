"""`SGLangEngine`: SGLang 0.5.23's in-process `sglang.Engine` behind beamrl's `RolloutEngine` + `WeightReceiver`.

For single-node use and tests (the CPU engine in CI). The RL loop runs the HTTP server (`server.py`, one per node
of an engine) inside a Ray actor (`beamrl.loop.actors.EngineActor`), which also survives an engine crash without
taking the caller down.

Every call runs the tokenizer manager's coroutine on `engine.loop` under `asyncio.wait_for`, so it has a
timeout and never hangs; calls are serialized by a lock (one event loop), and a call's timeout bounds it whole, its
wait for the call in progress included; `health` does not wait (while a call runs, the engine is healthy if its
processes run).
Child-process liveness is checked before each call, so a dead engine fails at once with the dead process named.

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
import sys
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
from beamrl.protocols.rollout import EngineError
from beamrl.protocols.weights import WeightSyncError
from beamrl.rollout.sglang import payloads
from beamrl.rollout.sglang.client import SGLangClient
from beamrl.rollout.sglang.config import SGLangEngineConfig
from beamrl.rollout.sglang.sync_guard import SGLangSyncGuard

_LIVE_ENGINES: "weakref.WeakSet[SGLangEngine]" = weakref.WeakSet()
PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's API in process: the tokenizer manager's method of each endpoint beamrl calls, and its request class in
# `sglang.srt.managers.io_struct`. The methods take (request, None), as SGLang's HTTP handlers call them, except
# those in `_REQUEST_ONLY`; `flush_cache` takes no request.
_REQUESTS = {
    "begin_weight_update": "BeginWeightUpdateReqInput",
    "end_weight_update": "EndWeightUpdateReqInput",
    "update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "update_weight_version": "UpdateWeightVersionReqInput",
    "get_weights_by_name": "GetWeightsByNameReqInput",
    "release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}
_REQUEST_ONLY = {"update_weight_version"}


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



def _close_sockets(*owners: Any) -> None:
    """Close the ZMQ sockets `owners` hold at once, dropping unsent messages (linger 0), and end their contexts.
    Left open, a context that the garbage collector finalizes later waits forever to deliver messages to the
    scheduler this engine killed: a process that collects it (pytest's last `gc.collect()`) never exits."""
    import zmq

    contexts = {}
    for owner in owners:
        for value in list(vars(owner).values()):
            if isinstance(value, zmq.Socket) and not value.closed:
                contexts[id(value.context)] = value.context
                value.close(linger=0)
    for context in contexts.values():
        context.destroy(linger=0)

class SGLangEngine(SGLangClient):
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
        self._guard = SGLangSyncGuard(self.name, self.beam_config, config.dtype, config.model_path,
                                      rollback=config.device == "cpu" if rollback is None else rollback,
                                      lora=config.lora)
        self._adapters_before = 0
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
                from sglang.srt.environ import redirect_third_party_caches

                # what importing sglang does; said again here: a recipe check that imported sglang earlier in this
                # process put the environment back (cli_args)
                redirect_third_party_caches()
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
        _close_sockets(self._engine, self._engine.tokenizer_manager)
        self._stop.set()
        self._engine = None
        self._dead_reason = "SGLang engine was shut down"
        _LIVE_ENGINES.discard(self)
        atexit.unregister(self.shutdown)

    # ------------------------------------------------------------------ the one way to call the engine
    def _run(self, make_coro: Callable[[], Any], timeout: float, what: str,
             error_cls: type[Exception] = EngineError, on_timeout: Callable[[], None] | None = None) -> Any:
        """Run the coroutine `make_coro()` on the engine's loop: one call at a time (one event loop). `timeout`
        bounds the whole call, the wait for a call in progress included."""
        if timeout <= 0:
            raise ValueError(f"{what}: timeout must be > 0, got {timeout}")
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            raise error_cls(f"SGLang engine: {what} waited {timeout:g} s for another call to finish")
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise error_cls(f"SGLang engine: {what} waited its {timeout:g} s for another call to finish")
            return self._run_locked(make_coro, left, what, error_cls, on_timeout, budget=timeout)
        finally:
            self._lock.release()

    def _run_locked(self, make_coro: Callable[[], Any], timeout: float, what: str,
                    error_cls: type[Exception], on_timeout: Callable[[], None] | None = None,
                    budget: float | None = None) -> Any:
        """`_run` with the lock held: at most `timeout` s (what is left of the call's `budget`, said on timeout)."""
        self._check_alive(error_cls)
        loop = self._engine.loop
        try:
            return loop.run_until_complete(asyncio.wait_for(make_coro(), timeout))
        except (asyncio.TimeoutError, TimeoutError):
            if on_timeout is not None:
                on_timeout()
            self._note_children()
            extra = f" ({self._dead_reason})" if self._dead_reason else ""
            raise error_cls(f"SGLang engine: {what} timed out after {budget or timeout:g} s{extra}") from None
        except error_cls:
            raise
        except Exception as e:  # SGLang raises ValueError/AssertionError/... with its own message
            raise error_cls(f"SGLang engine: {what} failed: {type(e).__name__}: {e}") from e

    def _call(self, endpoint: str, fields: dict[str, Any] | None, timeout: float,
              error_cls: type[Exception] = WeightSyncError) -> Any:
        """The tokenizer manager's method `endpoint` with the request `_REQUESTS[endpoint](**fields)` (`fields`
        None: the method takes no request); `error_cls` with SGLang's message when it refuses."""
        from sglang.srt.managers import io_struct

        tm = self._engine.tokenizer_manager if self._engine is not None else None
        if fields is None:
            args: tuple = ()
        else:
            request = getattr(io_struct, _REQUESTS[endpoint])(**fields)
            args = (request,) if endpoint in _REQUEST_ONLY else (request, None)
        result = self._run(lambda: getattr(tm, endpoint)(*args), timeout, endpoint, error_cls)
        payloads.check_success(result, f"SGLang engine: {endpoint}", error_cls)
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

    def health(self, timeout: float) -> bool:
        """Idle, the scheduler must answer within `timeout`. While another call runs (`EngineActor` asks from its
        control thread during long rollouts), the engine is healthy while all its processes run: a health check
        must not queue behind a `generate` and take a busy engine for a dead one."""
        if self._engine is None or timeout <= 0:
            return False
        if not self._lock.acquire(timeout=min(timeout, 1.0)):
            self._note_children()
            return self._dead_reason is None
        try:
            tm = self._engine.tokenizer_manager
            self._run_locked(lambda: tm.get_internal_state(), timeout, "health", EngineError)
            return True
        except (EngineError, ValueError):
            return False
        finally:
            self._lock.release()

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
        """Drop the prefix cache (SGLang refuses while requests run)."""
        self._call("flush_cache", None, timeout, EngineError)

    def _memory_call(self, method: str, tags: list[str] | None, timeout: float) -> None:
        if self.config.device != "cuda" or not self.config.enable_memory_saver:
            raise EngineError(f"{method} needs a CUDA engine launched with enable_memory_saver=True "
                              f"(device={self.config.device!r}, enable_memory_saver={self.config.enable_memory_saver})")
        self._call(method, {"tags": tags}, timeout, EngineError)

    def release_memory(self, tags: list[str] | None, timeout: float) -> None:
        self._memory_call("release_memory_occupation", tags, timeout)

    def resume_memory(self, tags: list[str] | None, timeout: float) -> None:
        self._memory_call("resume_memory_occupation", tags, timeout)

    # ------------------------------------------------------------------ weight updates
    @property
    def tp_size(self) -> int:
        return self.config.engine_tp

    def _load_flat_bucket(self, bucket, timeout: float) -> None:
        self._call("update_weights_from_tensor",
                   {"serialized_named_tensors": payloads.flattened_bucket_payloads(bucket, self.tp_size, as_str=False),
                    "load_format": "flattened_bucket", "flush_cache": False}, timeout)

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

    def lora_effective_weight(self, name: str, timeout: float):
        """The HF weight `name` as the engine now computes with it (rank 0's TP shard), as an FP32 tensor."""
        import torch

        out = self._get_weights_by_name(name, timeout)
        if out is None:
            raise WeightSyncError(f"SGLang engine: no weight {name!r}")
        return torch.tensor(out, dtype=torch.float64).float()

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
    left = stop_processes(procs, grace)
    if left:
        print(f"[beamrl] SGLang engine: processes {left} survived SIGKILL", file=sys.stderr, flush=True)
