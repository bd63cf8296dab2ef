"""`SGLangServer.stop()` ends the whole server (every process of its group has exited when it returns) without taking
SGLang's crash path: before, the group's SIGTERM reached the schedulers first, and the server logged a crashed child
and spent 5 s on crash diagnostics at every stop."""

from __future__ import annotations

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.net import reserve_port
from beamrl.processes import group_members, running
from beamrl.rollout.sglang.config import SGLangEngineConfig
from beamrl.rollout.sglang.server import SGLangServer

pytestmark = pytest.mark.slow  # one CPU server start: ~20 s on an idle 2-core machine
CRASH_PATH = ("SIGQUIT received", "crashed with exit code")  # SGLang's lines when it takes a stop for a crash


def test_stop_ends_every_process_of_the_server_without_the_crash_path(tmp_path):
    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).save_pretrained(tmp_path / "ckpt")
    with reserve_port() as reserved:
        server = SGLangServer(SGLangEngineConfig.on_cpu(tmp_path / "ckpt", dtype="float32", port=reserved.port),
                              log_path=tmp_path / "server.log")
        server.start(timeout=600)
    try:
        members = [p.pid for p in group_members(server.pid)]
        assert server.pid in members and len(members) >= 3  # the server, its scheduler and detokenizer at least
        logged = len(server.log_path.read_text().splitlines())
    finally:
        server.stop()
    assert not [pid for pid in members if running(pid)]
    after = "\n".join(server.log_path.read_text().splitlines()[logged:])
    assert not any(line in after for line in CRASH_PATH), after
    server.stop()  # idempotent


# A process standing in for the engine actor: it starts the real server, says the server's group, and waits.
_ACTOR = """
import sys, torch
from beamrl.rollout.sglang.config import SGLangEngineConfig
from beamrl.rollout.sglang.server import SGLangServer
server = SGLangServer(SGLangEngineConfig.on_cpu(sys.argv[1], dtype="float32", port=int(sys.argv[2])),
                      log_path=sys.argv[3]).start(timeout=600)
print(server.pid, flush=True)
import time; time.sleep(900)
"""


def test_the_server_dies_with_an_actor_killed_without_its_shutdown(tmp_path):
    """Ray kills a wedged or lost actor by SIGKILL: nothing of the server it started may outlive it (before the
    tether, the server's own session kept it, and its GPU memory, alive)."""
    import subprocess
    import sys
    import time

    from beamrl import tether

    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=0).save_pretrained(tmp_path / "ckpt")
    with reserve_port() as reserved:
        port = reserved.port
    from beamrl.processes import stop_group

    actor = subprocess.Popen([sys.executable, "-c", _ACTOR, str(tmp_path / "ckpt"), str(port),
                              str(tmp_path / "server.log")], stdout=subprocess.PIPE, text=True)
    group = None
    try:
        group = int(actor.stdout.readline())
        members = [p.pid for p in group_members(group)]
        assert len(members) >= 4, members  # the tether, the server, its scheduler and detokenizer at least
        actor.kill()
        actor.wait(30)
        deadline = time.monotonic() + 10 * tether.POLL_S + 20
        while [p for p in members if running(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in members if running(p)], "the server's processes outlived the killed actor"
    finally:
        if actor.poll() is None:
            actor.kill()
        if group is not None:
            stop_group(group, 1.0)  # a failed test leaves nothing running
