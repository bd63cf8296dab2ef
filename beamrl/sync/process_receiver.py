"""Host a weight receiver (or a whole engine) in a child process and drive it from the trainer with timeouts.

The child builds its object with `factory(*args)` (module-level, picklable) and serves method calls over a
`torch.multiprocessing` pipe, in order. Calls can be pipelined (`call_async`): the request is written at once and
its reply read when it is waited for (replies arrive in request order). Staged buckets cross as their small
`(slot, index)` messages; a `FlatBucket` crosses as a shared-memory (CPU) or CUDA-IPC (GPU) tensor (torch's
pickler reductions). `HostedEngine` is the native engine hosted this way, which is how `beamrl bench sync` and
`benchmarks/sync_h200.py` run it: in its own process, as in training.

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

from beamrl.protocols.weights import PendingCall, WeightSyncError
from beamrl.sync.forwarding_receiver import ForwardingReceiver

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


class _PipeCall(PendingCall):
    def __init__(self, proxy: "ProcessReceiver", seq: int, what: str) -> None:
        super().__init__()
        self._proxy, self._seq, self._what = proxy, seq, what

    def wait(self, timeout: float) -> Any:
        return self._proxy._reply(self._seq, self._what, timeout)


class ProcessReceiver(ForwardingReceiver):
    """`WeightReceiver` proxy for a receiver living in a spawned child process."""

    # A call's pipe write blocks while the child does not read (a stuck child, a message over the pipe's buffer):
    # only its reply wait has a deadline, so a single call still runs on a thread with the caller's deadline.
    bounded_calls = False

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
        self._sent = self._read = 0
        self._replies: dict[int, tuple[str, Any]] = {}
        self._tp = int(self._read_one("start", time.monotonic() + start_timeout, start_timeout)[1])

    @property
    def name(self) -> str:
        return self._name

    @property
    def tp_size(self) -> int:
        return self._tp

    def _read_one(self, what: str, deadline: float, timeout: float) -> tuple[str, Any]:
        """Read the next reply from the pipe (any call's), watching the child's liveness."""
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
                if status in ("ok", "error"):
                    if status == "error" and what == "start":
                        raise WeightSyncError(f"{self._name}: start: {value}")
                    return status, value
            if not self.process.is_alive():
                self._broken = f"process exited with code {self.process.exitcode}"
                raise WeightSyncError(f"{self._name}: {what}: receiver process is dead "
                                      f"(exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                self._broken = f"{what} timed out"
                raise WeightSyncError(f"{self._name}: no reply to {what} within {round(timeout, 1):g} s (wedged?)")

    def _reply(self, seq: int, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self._lock:
            while seq not in self._replies:
                if self._broken:
                    raise WeightSyncError(f"{self._name}: unusable after an earlier failure ({self._broken}); "
                                          f"restart it")
                self._replies[self._read] = self._read_one(what, deadline, timeout)
                self._read += 1
            status, value = self._replies.pop(seq)
        if status == "error":
            raise WeightSyncError(f"{self._name}: {what}: {value}")
        return value

    def _send(self, method: str, args: tuple, kwargs: dict) -> int:
        with self._lock:
            if self._broken:
                raise WeightSyncError(f"{self._name}: unusable after an earlier failure ({self._broken}); restart it")
            try:
                self._conn.send((method, args, kwargs))
            except (BrokenPipeError, OSError) as exc:
                self._broken = f"pipe closed ({exc})"
                raise WeightSyncError(f"{self._name}: {method}: receiver process is gone ({exc})") from exc
            seq, self._sent = self._sent, self._sent + 1
            return seq

    def call(self, method: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
        """Call `method` on the hosted object and wait; its exceptions come back as `WeightSyncError` with its
        message."""
        return _PipeCall(self, self._send(method, args, kwargs), method).wait(timeout)

    def _submit(self, method: str, timeout: float, *args: Any) -> PendingCall:
        try:
            return _PipeCall(self, self._send(method, (*args, timeout), {}), method)
        except WeightSyncError as exc:
            return PendingCall(error=exc)

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
                with self._lock:
                    self._conn.send(None)
                    deadline = time.monotonic() + timeout
                    while self._read <= self._sent:  # drain replies of calls nobody waited for, then the goodbye
                        self._read_one("shutdown", deadline, timeout)
                        self._read += 1
            except (WeightSyncError, OSError):
                pass
        self.process.join(timeout)
        self.kill()
        self._conn.close()


class HostedEngine(ProcessReceiver):
    """A `ProcessReceiver` whose child hosts a whole engine (e.g. `NativeEngine(config)`): the `RolloutEngine`
    calls a sync makes are forwarded too (`ForwardingReceiver`), and `weight_version` reads the served version."""

    @property
    def weight_version(self) -> int:
        return self.served_weight_version(60)
