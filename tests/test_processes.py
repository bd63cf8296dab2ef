"""`beamrl.processes`: a process group's members are found and stopped, a leader that is already dead included; a
member that ignores SIGTERM is killed after the grace period; a process a member starts while it is being stopped is
stopped too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from beamrl.processes import group_members, running, stop_group, stop_processes

# A session leader that starts two children (one ignores SIGTERM), prints their pids and sleeps.
LEADER = r"""
import json, subprocess, sys
child = "import time; print('up', flush=True); time.sleep(600)"
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
kids = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for code in (child, stubborn)]
for k in kids:
    k.stdout.readline()  # its handlers are installed
print(json.dumps([k.pid for k in kids]), flush=True)
import time; time.sleep(600)
"""


def _start_group():
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    return leader, json.loads(leader.stdout.readline())


def test_the_members_of_a_group_whose_leader_died_are_found_and_stopped():
    leader, kids = _start_group()
    try:
        leader.kill()
        leader.wait(10)
        members = group_members(leader.pid)
        assert sorted(p.pid for p in members) == sorted(kids)  # re-parented, still in the group; the leader is not
        t0 = time.monotonic()
        assert stop_processes(members, grace=0.5) == []
        assert time.monotonic() - t0 < 5
        assert not any(running(pid) for pid in kids)
        assert group_members(leader.pid) == []
    finally:
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_member_that_ignores_sigterm_is_killed_after_the_grace():
    leader, (plain, stubborn) = _start_group()
    try:
        members = [p for p in group_members(leader.pid) if p.pid in (plain, stubborn)]
        t0 = time.monotonic()
        assert stop_processes(members, grace=1.0) == []
        took = time.monotonic() - t0
        assert 1.0 <= took < 5  # SIGTERM ended one; the other needed the SIGKILL after the grace
        assert not running(plain) and not running(stubborn)
    finally:
        leader.kill()
        leader.wait(10)


# A member whose SIGTERM handler starts another process of the group (and prints its pid) before it exits.
SPAWNER = r"""
import signal, subprocess, sys, time
def on_term(*_):
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(late.pid, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
time.sleep(600)
"""


def test_a_process_started_while_the_group_is_stopped_is_stopped_too():
    spawner = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    late = None
    try:
        assert spawner.stdout.readline().strip() == "up"
        assert stop_group(spawner.pid, grace=2.0) == []
        late = int(spawner.stdout.readline())  # started by the SIGTERM handler, after the first listing
        assert not running(late)
        assert group_members(spawner.pid) == []
    finally:
        spawner.kill()
        spawner.wait(10)
        if late is not None and running(late):
            os.kill(late, signal.SIGKILL)
