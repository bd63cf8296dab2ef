"""Run one rank's checkpoint write (`storage.write_files`) in a forked child, so training continues meanwhile.

Why a fork: the child gets a copy-on-write snapshot of the parent's memory at the fork, so host tensors are
written as they were at `save_checkpoint` even while the next steps change them (device tensors were already
copied to host memory by `storage.plan`). The child writes files and JSON only (no collectives, no device calls,
no Python finalizers) and leaves with `os._exit`. `os.fork` (not `multiprocessing`) also works inside daemonic
processes (the CPU test launcher's ranks) and Ray actors. A thread would share the GIL with the training loop
for the whole serialisation (`torch.save` holds it).
"""

from __future__ import annotations

import os
import sys
import time
import traceback


#: How long a killed background writer gets to exit before the rank goes on without reaping it.
REAP_S = 10.0


class BackgroundWrite:
    """`fn()` running in a forked child; poll with `done()`, collect with `wait()`."""

    def __init__(self, fn, what: str):
        self.what = what
        sys.stdout.flush()
        sys.stderr.flush()  # buffered output would otherwise be written twice
        self.pid = os.fork()
        if self.pid == 0:  # child
            code = 1
            try:
                fn()
                code = 0
            except BaseException:  # noqa: BLE001 - the parent learns of it through the exit code
                traceback.print_exc()
                sys.stderr.write(f"[beamrl] background write of {what} failed\n")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self._exit: int | None = None
        self.started = time.monotonic()

    def done(self) -> bool:
        """True once the child has exited (does not block)."""
        if self._exit is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._exit = os.waitstatus_to_exitcode(status)
        return self._exit is not None

    def _reap(self, within_s: float) -> bool:
        """Reap the killed child within `within_s`; False if it has not exited by then (never blocks longer)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                return True
            time.sleep(0.05)
        return False

    def wait(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait for the child; True if it wrote everything. A child still running after `timeout_s` is killed
        (False): the checkpoint is then never published."""
        deadline = time.monotonic() + timeout_s
        while not self.done():
            if time.monotonic() > deadline:
                os.kill(self.pid, 9)
                reaped = self._reap(REAP_S)  # a writer stuck in uninterruptible I/O (a hung NFS) dies only later
                self._exit = -9
                sys.stderr.write(f"[beamrl] background write of {self.what} exceeded {timeout_s:.0f} s; killed"
                                 + ("" if reaped else f" (pid {self.pid} not gone after {REAP_S:.0f} s: stuck in "
                                                      "I/O; it stays a zombie until this rank exits)") + "\n")
                break
            time.sleep(poll_s)
        return self._exit == 0
