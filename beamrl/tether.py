"""Run a command tied to the life of the process that started it: `python -I <this file> PARENT_PID -- CMD ...`.

An SGLang server is started in a session of its own (`start_new_session=True`, so that its whole process group can be
stopped), which also means nothing stops it when the actor that started it dies without its shutdown (SIGKILLed by
Ray, OOM-killed, a node agent restart): the server, and the GPU memory it holds, would outlive the run. The tether is
the session's leader and the command's parent. It

- polls the parent: once `PARENT_PID` is gone (or this process was re-parented away from it), it SIGKILLs its whole
  process group, itself included. SGLang's scheduler and detokenizer die with the server (SGLang gives them a
  parent-death signal); SIGKILL is what `SGLangServer.stop` sends the server first anyway;
- gives the command a parent-death signal (SIGKILL) of its own: if the tether itself is killed (the OOM killer,
  `SGLangServer.stop`'s last resort), the command dies with it instead of running on unwatched. The tether has one
  thread, so the signal (which fires when the forking *thread* exits) means "when the tether exits";
- on SIGTERM or SIGINT (`SGLangServer.stop`), SIGKILLs the command, reaps it and exits with 128 + the signal, also
  when the signal comes while the command is being started (the handler only takes note; the main loop acts);
- otherwise exits when the command exits, with its exit code (128 + N when a signal N ended it).

Every wait is bounded. Standard library only, so that it starts in a few tens of milliseconds and needs nothing of the
parent's environment. The *parent* is watched by polling, not by a parent-death signal: a Ray actor may start the
server from a worker thread, whose exit would fire it while the actor lives on.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

#: How often the parent is looked for: the longest a server outlives its dead parent, plus the kill.
POLL_S = 0.5
#: How long the tether waits for a SIGKILLed command to be reaped (one stuck in the kernel is left to the group stop).
REAP_S = 10.0
_PR_SET_PDEATHSIG = 1


def parent_alive(parent: int) -> bool:
    """The process that started the tether still runs and is still its parent (a dead parent's children are
    re-parented to init or a subreaper, and its pid may be reused by an unrelated process)."""
    if os.getppid() != parent:
        return False
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but another user's: not ours any more
        return False
    return True


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _die_with_the_tether(tether: int):
    """The command's pre-exec step: SIGKILL when the tether exits (kept across exec); if the tether is already gone,
    do not start at all."""
    libc = ctypes.CDLL(None, use_errno=True)

    def set_parent_death_signal() -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != tether:
            os._exit(1)

    return set_parent_death_signal


def _kill_and_reap(child: subprocess.Popen) -> None:
    try:
        child.kill()
        child.wait(REAP_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        print("usage: python -I tether.py PARENT_PID -- CMD [ARG ...]", file=sys.stderr)
        return 2
    parent, cmd = int(args[0]), args[2:]
    if not parent_alive(parent):  # the parent died before the tether started: start nothing
        return 1
    stop: list[int] = []  # the signal that asked the tether to stop; acted on by the loop, never in the handler
    child_pid: list[int] = []

    def on_stop(signum, _frame) -> None:
        stop.append(signum)
        if child_pid:
            try:
                os.kill(child_pid[0], signal.SIGKILL)  # at once; the loop reaps it
            except ProcessLookupError:  # already exited (and reaped by the loop)
                pass

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    if stop:
        return 128 + stop[0]
    # same process group and session as the tether; SIGKILLed if the tether dies (single-threaded: preexec is safe)
    child = subprocess.Popen(cmd, preexec_fn=_die_with_the_tether(os.getpid()))
    child_pid.append(child.pid)
    while True:
        if stop:
            _kill_and_reap(child)
            return 128 + stop[0]
        try:
            code = child.wait(POLL_S)
        except subprocess.TimeoutExpired:
            if not parent_alive(parent):
                leader = os.getpgid(0) == os.getpid()
                print(f"[beamrl] tether: parent process {parent} is gone; killing {cmd[0]} (pid {child.pid})"
                      + (" and its process group" if leader else ""), file=sys.stderr, flush=True)
                if leader:  # started in a session of its own (as SGLangServer does): the group is the command's
                    os.killpg(os.getpid(), signal.SIGKILL)
                _kill_and_reap(child)  # not a group leader: never signal the group of whoever ran the tether
                return 128 + signal.SIGKILL
            continue
        return 128 + stop[0] if stop else _exit_code(code)


if __name__ == "__main__":
    sys.exit(main())
