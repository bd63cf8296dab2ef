"""`beamrl.tether`: the command dies with the process that started it, stops on SIGTERM, and passes its exit code on.
Real processes: a parent that starts the tether (in a session of its own, as `SGLangServer` does) is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from beamrl import tether
from beamrl.processes import group_members, running

# A parent (standing in for an engine actor) that starts the tether around a long sleep, in a session of its own,
# says the pids, and waits to be killed.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    p = subprocess.Popen([sys.executable, "-I", sys.argv[1], str(os.getpid()), "--", sys.executable, "-c",
                          "import time; time.sleep(600)"], start_new_session=True)
    deadline = time.monotonic() + 60
    while len([c for c in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    child = int(open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()[0])
    print(p.pid, child, flush=True)
    time.sleep(600)
""")


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def _tethered(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-I", tether.__file__, str(os.getpid()), "--", *cmd],
                            start_new_session=True)


def _child_of(t: subprocess.Popen, timeout: float = 60) -> int:
    """The tethered command's pid, once it runs (bounded: a loaded machine starts interpreters slowly)."""
    deadline = time.monotonic() + timeout
    while True:
        kids = [p.pid for p in group_members(t.pid) if p.pid != t.pid]
        if kids:
            return kids[0]
        assert time.monotonic() < deadline and t.poll() is None, "the tethered command did not start"
        time.sleep(0.02)


SLEEPER = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]


def test_the_command_dies_with_a_parent_killed_without_its_shutdown():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, tether.__file__], stdout=subprocess.PIPE, text=True)
    try:
        leader, child = map(int, parent.stdout.readline().split())
        assert running(leader) and running(child)
        assert [p.pid for p in group_members(leader)] and child in [p.pid for p in group_members(leader)]
        parent.kill()  # as Ray kills an actor: no shutdown, no handler
        parent.wait(10)
        left = _wait_gone([leader, child], 10 * tether.POLL_S + 5)
        assert not left, f"processes {left} outlived their killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_sigterm_kills_the_command_at_once_and_the_exit_code_passes_through():
    t = _tethered(SLEEPER)  # a command that ignores SIGTERM (SGLang drains for 5 s on it)
    child = _child_of(t)
    t0 = time.monotonic()
    t.terminate()
    assert t.wait(10) == 128 + signal.SIGTERM
    assert not _wait_gone([child], 5) and time.monotonic() - t0 < 5
    assert _tethered([sys.executable, "-c", "import sys; sys.exit(3)"]).wait(30) == 3
    assert _tethered([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]).wait(30) \
        == 128 + signal.SIGKILL


def test_a_parent_already_gone_starts_nothing_and_bad_usage_says_how():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert tether.main([str(gone.pid), "--", "true"]) == 1
    assert tether.main(["not-a-pid", "--", "true"]) == 2
    assert tether.main([str(os.getpid()), "true"]) == 2


def test_a_killed_tether_takes_its_command_with_it():
    """The OOM killer or `SGLangServer.stop`'s last resort may SIGKILL the tether itself: the command must not run on
    unwatched (it gets a parent-death signal)."""
    t = _tethered(SLEEPER)
    child = _child_of(t)
    t.kill()
    t.wait(10)
    assert not _wait_gone([child], 10), "the command outlived its SIGKILLed tether"


def test_sigterm_while_the_command_starts_leaves_nothing_running():
    """SIGTERM at any moment of the tether's start-up ends it with 128 + SIGTERM and leaves no process of its group
    (before, a signal between the command's start and the handlers' set-up orphaned the command)."""
    for delay in (0.0, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3):
        t = _tethered(SLEEPER)
        time.sleep(delay)
        t.terminate()
        code = t.wait(30)
        left = [p.pid for p in group_members(t.pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"SIGTERM after {delay} s left {left} running"
        assert code in (128 + signal.SIGTERM, -signal.SIGTERM), (delay, code)  # before its handlers: the default
