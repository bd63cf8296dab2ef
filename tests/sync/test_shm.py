"""The weight sync's shared-memory files: names that carry their creator's process id, and the removal of the files
of processes that exited (what the trainer group does for ranks killed without their shutdown)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from beamrl.sync import shm

ROOT = Path(__file__).resolve().parents[2]


def test_names_carry_the_creating_process():
    path = shm.new_path("beamrl-rank-bucket")
    assert shm.creator_pid(Path(path).name) == os.getpid()
    assert shm.creator_pid(Path(path).name + "-3") == os.getpid()  # a staging slot's index suffix
    assert shm.creator_pid("beamrl-sync-123") is None  # not a name of new_path
    assert shm.creator_pid("sglang_loads_123.shm") is None
    with pytest.raises(ValueError, match="prefix 'Beamrl_x'"):
        shm.new_path("Beamrl_x")


def _file_made_by_a_killed_process() -> tuple[subprocess.Popen, Path]:
    """A child process makes a file with `new_path` and is SIGKILLed while it still holds it."""
    code = ("import sys, time; from beamrl.sync import shm; p = shm.new_path('beamrl-sync') + '-0'; "
            "open(p, 'wb').write(b'x'); print(p, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    path = Path(child.stdout.readline().strip())
    child.stdout.close()
    os.kill(child.pid, signal.SIGKILL)  # not reaped until the test ends: a zombie meanwhile, which has exited
    return child, path


def test_files_of_exited_processes_are_removed_and_a_live_ones_kept():
    child, left = _file_made_by_a_killed_process()
    mine = Path(shm.new_path("beamrl-sync") + "-0")
    mine.write_bytes(b"y")
    try:
        assert shm.files_of([child.pid]) == [left] and left.exists()
        removed = shm.remove_files_of_exited([child.pid, os.getpid()], wait_s=1)
        assert removed == [left.name] and not left.exists()
        assert mine.exists()  # this process is alive: its file stays, even though its pid was asked for
        assert shm.remove_files_of_exited([os.getpid()], wait_s=0.2) == [] and mine.exists()
    finally:
        child.wait(10)
        shm.remove(str(mine))
        shm.remove(str(left))


def test_nothing_to_remove_waits_for_nobody():
    t0 = time.monotonic()
    assert shm.remove_files_of_exited([1], wait_s=5) == []  # init: alive, and no file of its pid
    assert time.monotonic() - t0 < 1  # at once, not after waiting out wait_s for a process that never exits
