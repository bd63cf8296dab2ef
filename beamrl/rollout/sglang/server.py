"""`SGLangServer`: launch `python -m sglang.launch_server ...` as a subprocess and wait until it is healthy.

The command line comes from `SGLangEngineConfig.launch_argv()`. The server's stdout/stderr go to `log_path`,
whose tail is quoted in every start-up error. On a machine without CUDA the child gets the CPU shims through
`beamrl.compat.sglang_cpu.child_env()` (never on a GPU machine: that module refuses).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from beamrl.protocols.rollout import EngineError
from beamrl.rollout.sglang.config import SGLangEngineConfig
from beamrl.rollout.sglang.engine import log_tail


class SGLangServer:
    """One SGLang HTTP server process. Use as a context manager or call `stop()`."""

    def __init__(self, config: SGLangEngineConfig, log_path: str | Path | None = None,
                 python: str = sys.executable) -> None:
        self.config = config
        self.python = python
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="beamrl-sglang-")) / "server.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", *self.config.launch_argv()]

    def _env(self) -> dict[str, str] | None:
        if self.config.device != "cpu":
            extra = self.config.launch_env()
            return {**os.environ, **extra} if extra else None
        from beamrl.compat.sglang_cpu import child_env

        import torch

        if torch.cuda.is_available():
            raise EngineError("SGLangEngineConfig.device='cpu' on a machine with CUDA: use device='cuda'")
        # The shims are installed in the child by the boot dir's sitecustomize (not in this process).
        return {**child_env(), **self.config.launch_env()}

    def start(self, timeout: float = 600.0, poll: float = 1.0) -> "SGLangServer":
        """Launch and wait for `GET /health` to answer 200, at most `timeout` s; `EngineError` with the log tail."""
        import requests

        if self.process is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                                            start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                self.process = None
                raise EngineError(f"SGLang server exited with code {code} during start-up\n--- server log tail "
                                  f"({self.log_path}) ---\n{log_tail(self.log_path)}")
            try:
                if requests.get(self.url + "/health", timeout=poll).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(poll)
        self.stop()
        raise EngineError(f"SGLang server at {self.url} was not healthy within {timeout:.0f} s\n--- server log tail "
                          f"({self.log_path}) ---\n{log_tail(self.log_path)}")

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """Terminate the server and its children (its own process group); idempotent."""
        import os
        import signal

        if self.process is None:
            return
        proc, self.process = self.process, None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(grace)

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
