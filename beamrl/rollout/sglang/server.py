"""`SGLangServer`: launch `python -m sglang.launch_server ...` as a subprocess and wait until it is healthy.

The command line comes from `SGLangEngineConfig.launch_argv()`. The server's stdout/stderr go to `log_path`,
whose tail is quoted in every start-up error. On a machine without CUDA the child gets the CPU shims through
`beamrl.compat.sglang_cpu.child_env()` (never on a GPU machine: that module refuses), and with several TP ranks
the CPU engine's own TP settings (`tp_env`). On a GPU, `visible_gpus` becomes the child's CUDA_VISIBLE_DEVICES.
The API key goes into a file only this user can read, passed as `--config`, so it never shows on a command line.

A multi-node engine is one server per node (`nnodes`, `node_rank`): only node rank 0 serves the API; the others
run their TP ranks' schedulers and answer `/health` only, which `start()` waits for on every node.
"""

from __future__ import annotations

import json
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

    @property
    def secrets_path(self) -> Path:
        """The `--config` file holding the API key (mode 0600), next to the log."""
        return self.log_path.parent / "server-secrets.yaml"

    def command(self) -> list[str]:
        """The server's command line, behind `beamrl.tether`: the server dies with the process that started it (an
        actor killed without its shutdown must not leave a server holding its GPUs)."""
        from beamrl import tether

        extra = ["--config", str(self.secrets_path)] if self.config.api_key else []
        # -I: the tether needs only the standard library, and must not run the CPU shims' sitecustomize that the
        # server's environment puts on PYTHONPATH (the server still gets that environment).
        return [sys.executable, "-I", tether.__file__, str(os.getpid()), "--",
                self.python, "-m", "sglang.launch_server", *self.config.launch_argv(), *extra]

    def _env(self) -> dict[str, str] | None:
        c = self.config
        if c.device != "cpu":
            extra = dict(c.launch_env())
            if c.visible_gpus is not None:
                extra["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in c.visible_gpus)
            return {**os.environ, **extra} if extra else None
        from beamrl.compat.sglang_cpu import child_env, tp_env

        import torch

        if torch.cuda.is_available():
            raise EngineError("SGLangEngineConfig.device='cpu' on a machine with CUDA: use device='cuda'")
        # The shims are installed in the child by the boot dir's sitecustomize (not in this process).
        env = child_env()
        if c.engine_tp > 1:
            env.update(tp_env(c.base_gpu_id + c.tp_per_node))
        env.update(c.launch_env())
        return env

    def _write_secrets(self) -> None:
        if not self.config.api_key:
            return
        fd = os.open(self.secrets_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"api-key: {json.dumps(self.config.api_key)}\n")  # a JSON string is a valid YAML scalar

    def start(self, timeout: float = 600.0, poll: float = 1.0) -> "SGLangServer":
        """Launch and wait for `GET /health` to answer 200, at most `timeout` s; `EngineError` with the log tail."""
        import requests

        if self.process is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._write_secrets()
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
        """The server's process group (its leader is the tether, the server's parent)."""
        return None if self.process is None else self.process.pid

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def health(self, timeout: float) -> bool:
        """The process is alive and `GET /health` answers 200 within `timeout` s."""
        import requests

        if not self.is_running():
            return False
        try:
            return requests.get(self.url + "/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def stop(self, grace: float = 5.0) -> None:
        """Stop the server and every process of its group; idempotent, and never raises (it runs on teardown and
        error paths). Returns once all of them have exited; a process still there after SIGKILL and `grace` s is
        named on stderr.

        The server process goes first, by SIGKILL (the tether, the group's leader, sends it on SIGTERM and exits;
        if the tether does not within `grace` s, it is SIGKILLed itself, and the server dies with it: at worst a stop
        takes 3 x `grace`). SGLang's server takes SIGTERM as "drain, then exit", which it
        notices within 5 s, and its children dying before it as a crash, which costs 5 s of diagnostics; either way
        a stop took 5-6 s. It holds nothing a later run needs, and SGLang's own `Engine.shutdown` ends its scheduler
        processes by SIGKILL too. Its scheduler and detokenizer die with it (SGLang gives them a parent-death
        signal); whatever else of the group is left (helpers such as multiprocessing's resource tracker) then gets
        SIGTERM, and SIGKILL after `grace` s."""
        import sys

        from beamrl.processes import stop_group

        self.secrets_path.unlink(missing_ok=True)
        if self.process is None:
            return
        proc, self.process = self.process, None
        if proc.poll() is None:
            proc.terminate()  # the tether: SIGKILL to the server, then it exits
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    pass  # stuck in the kernel: its group is still stopped, and it is named below if it stays
        left = stop_group(proc.pid, grace)
        if left:
            print(f"[beamrl] SGLang server {self.url}: processes {left} of its group survived SIGKILL",
                  file=sys.stderr, flush=True)

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
