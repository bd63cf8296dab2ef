"""Host a weight receiver in a child process and drive it from the trainer with timeouts.

The child builds its receiver with `factory(*args)` (module-level, picklable) and serves method calls over a
`torch.multiprocessing` pipe: CPU tensors cross through shared memory and CUDA tensors as CUDA-IPC handles
(torch's pickler reductions), which is exactly the colocated path (the sender keeps the buffer alive because
every call is synchronous). Used by the GPU benchmark and by tests; engines with their own process
(SGLang, the native engine) implement `WeightReceiver` themselves.

A call that does not answer within its timeout, or a child that dies, raises `WeightSyncError` naming the
receiver; after a timeout the pipe is out of step, so the proxy refuses further calls (restart it).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from beamrl.sync.forwarding_receiver import ForwardingReceiver
from beamrl.protocols.weights import WeightSyncError

_POLL_S = 0.05


def _serve(conn, factory: Callable[..., Any], args: tuple) -> None:
    try:
        target = factory(*args)
    except BaseException:
        conn.send(("error", f"receiver factory failed:\n{traceback.format_exc()}"))
        return
    conn.send(("ok", getattr(target, "tp_size", 1)))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # parent went away
            return
        if msg is None:
            conn.send(("ok", None))
            return
        method, a, kw = msg
        try:
            attr = getattr(target, method)
            result = attr(*a, **kw) if callable(attr) else attr  # properties (weight_version) too
            del msg, a, kw  # drop the bucket (a CUDA-IPC mapping on GPU) before replying
            conn.send(("ok", result))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ProcessReceiver(ForwardingReceiver):
    """`WeightReceiver` proxy for a receiver living in a spawned child process."""

    def __init__(self, factory: Callable[..., Any], args: tuple = (), name: str = "process-receiver",
                 start_timeout: float = 120.0) -> None:
        self._name = name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, factory, args), name=f"beamrl-{name}", daemon=True)
        self.process.start()
        child.close()
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._tp = int(self._wait("start", start_timeout))

    @property
    def name(self) -> str:
        return self._name

    @property
    def tp_size(self) -> int:
        return self._tp

    def _wait(self, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ready = self._conn.poll(_POLL_S)
            except (EOFError, OSError):
                ready = False
            if ready:
                try:
                    status, value = self._conn.recv()
                except (EOFError, OSError):
                    status, value = "dead", None
                if status == "ok":
                    return value
                if status == "error":
                    raise WeightSyncError(f"{self._name}: {what}: {value}")
            if not self.process.is_alive():
                self._broken = f"process exited with code {self.process.exitcode}"
                raise WeightSyncError(f"{self._name}: {what}: receiver process is dead "
                                      f"(exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                self._broken = f"{what} timed out"
                raise WeightSyncError(f"{self._name}: no reply to {what} within {timeout:g} s (wedged?)")

    def call(self, method: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
        """Call `method` on the hosted object; its exceptions come back as `WeightSyncError` with its message."""
        with self._lock:
            if self._broken:
                raise WeightSyncError(f"{self._name}: unusable after an earlier failure ({self._broken}); restart it")
            try:
                self._conn.send((method, args, kwargs))
            except (BrokenPipeError, OSError) as exc:
                self._broken = f"pipe closed ({exc})"
                raise WeightSyncError(f"{self._name}: {method}: receiver process is gone ({exc})") from exc
            return self._wait(method, timeout)

    def _forward(self, method: str, timeout: float, *args: Any) -> Any:
        return self.call(method, *args, timeout, timeout=timeout)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def kill(self) -> None:
        """Kill the child at once (tests of dead engines; cleanup after a wedge)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the child to exit; kill it if it does not within `timeout`."""
        if self.process.is_alive() and not self._broken:
            try:
                self._conn.send(None)
                self._wait("shutdown", timeout)
            except (WeightSyncError, OSError):
                pass
        self.process.join(timeout)
        self.kill()
        self._conn.close()


class HostedEngine(ProcessReceiver):
    """A `ProcessReceiver` whose child hosts a whole engine (e.g. `NativeEngine(config)`), also forwarding the
    `RolloutEngine` calls a sync uses: `score` (verification), `abort_all` (pause) and `weight_version`."""

    def score(self, sequences: list[list[int]], timeout: float) -> list[list[float]]:
        return self.call("score", sequences, timeout, timeout=timeout)

    def abort_all(self, timeout: float) -> None:
        self.call("abort_all", timeout, timeout=timeout)

    @property
    def weight_version(self) -> int:
        return int(self.call("weight_version", timeout=60))
