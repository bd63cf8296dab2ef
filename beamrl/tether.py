"""Run a command tied to the life of the process that started it: `python -I <this file> PARENT_PID -- CMD ...`.

An SGLang server is started in a session of its own (`start_new_session=True`, so that its whole process group can be
stopped), which also means nothing stops it when the actor that started it dies without its shutdown (SIGKILLed by
Ray, OOM-killed, a node agent restart): the server, and the GPU memory it holds, would outlive the run. The tether is
the session's leader and the command's parent. It

- polls the parent: once `PARENT_PID` is gone (or this process was re-parented away from it), it SIGKILLs its whole
  process group, itself included. SGLang's scheduler and detokenizer die with the server (SGLang gives them a
  parent-death signal); SIGKILL is what `SGLangServer.stop` sends the server first anyway;
- on SIGTERM or SIGINT (`SGLangServer.stop`), SIGKILLs the command, reaps it and exits;
- otherwise exits when the command exits, with its exit code (128 + N when a signal N ended it).

Standard library only, so that it starts in a few tens of milliseconds and needs nothing of the parent's environment.
A parent-death signal (`prctl(PR_SET_PDEATHSIG)`) is not used: it fires when the *thread* that forked exits, and a
Ray actor may start the server from a worker thread of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

#: How often the parent is looked for: the longest a server outlives its dead parent, plus the kill.
POLL_S = 0.5


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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        print("usage: python -I tether.py PARENT_PID -- CMD [ARG ...]", file=sys.stderr)
        return 2
    parent, cmd = int(args[0]), args[2:]
    if not parent_alive(parent):  # the parent died before the tether started: start nothing
        return 1
    child = subprocess.Popen(cmd)  # same process group and session as the tether

    def stop(signum, _frame) -> None:
        child.kill()
        child.wait()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            code = child.wait(POLL_S)
        except subprocess.TimeoutExpired:
            if not parent_alive(parent):
                leader = os.getpgid(0) == os.getpid()
                print(f"[beamrl] tether: parent process {parent} is gone; killing {cmd[0]} (pid {child.pid})"
                      + (" and its process group" if leader else ""), file=sys.stderr, flush=True)
                if leader:  # started in a session of its own (as SGLangServer does): the group is the command's
                    os.killpg(os.getpid(), signal.SIGKILL)
                child.kill()  # not a group leader: never signal the group of whoever ran the tether
                child.wait()
                return 128 + signal.SIGKILL
            continue
        return _exit_code(code)


if __name__ == "__main__":
    sys.exit(main())
