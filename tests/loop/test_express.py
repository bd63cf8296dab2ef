"""Express calls (`beamrl.loop.express`) between real processes: results, the method's own errors, a dead peer, a
deadline and the late reply it leaves, the key, the order of pipelined calls, and one call at a time with the actor's
other calls (its `serial` lock)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import AuthenticationError

import pytest

from beamrl.loop.actor_calls import call_result, wait_all
from beamrl.loop.express import (ExpressAddress, ExpressClient, ExpressPeerLost, ExpressServer, ExpressTaskError,
                                 ExpressTimeout, serial, wait_any)
from beamrl.loop.ray_utils import ActorCallError


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no pickling")


class Target:
    """What an actor serves: plain methods, one that fails, one that sleeps."""

    def __init__(self):
        self._serial = threading.RLock()
        self.inside = 0
        self.overlaps = 0

    def add(self, a, b=0, *, c=0):
        return {"sum": a + b + c, "pid": os.getpid()}

    def fail(self, message):
        raise ValueError(message)

    def fail_unpicklable(self):
        raise Unpicklable("x")

    def sleep(self, seconds, tag):
        time.sleep(seconds)
        return tag

    def hidden(self):
        return "not served"

    def occupy(self, seconds):
        """Counts how often another call ran inside it (it should never). Not `serial` itself: the server's lock
        is what keeps express calls apart from the actor's own."""
        self.inside += 1
        if self.inside > 1:
            self.overlaps += 1
        time.sleep(seconds)
        self.inside -= 1
        return True

    @serial
    def occupy_as_ray_would(self, seconds):
        return self.occupy(seconds)


SERVED = ("add", "fail", "fail_unpicklable", "sleep", "occupy")


def _serve(queue) -> None:
    target = Target()
    server = ExpressServer(target, SERVED, target._serial, "child", node_id="node")
    queue.put(server.address)
    time.sleep(120)  # the test kills or abandons it


@pytest.fixture
def child():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(queue,), daemon=True)
    proc.start()
    address = queue.get(timeout=60)
    yield proc, address
    proc.kill()
    proc.join(10)


def test_results_args_and_kwargs_cross(child):
    proc, address = child
    client = ExpressClient(address, "child")
    assert client.call("add", 1, 2, c=3, timeout=10) == {"sum": 6, "pid": proc.pid}


def test_the_methods_error_comes_back_with_its_cause(child):
    client = ExpressClient(child[1], "child")
    with pytest.raises(ExpressTaskError) as info:
        client.call("fail", "bad input", timeout=10)
    assert isinstance(info.value.cause, ValueError) and str(info.value.cause) == "bad input"
    with pytest.raises(ExpressTaskError) as info:  # an exception that cannot be pickled is described
        client.call("fail_unpicklable", timeout=10)
    assert "Unpicklable" in str(info.value.cause)
    assert client.call("add", 1, timeout=10)["sum"] == 1  # the channel is still usable


def test_only_the_served_methods_run(child):
    client = ExpressClient(child[1], "child")
    with pytest.raises(ExpressTaskError, match="no express method 'hidden'"):
        client.call("hidden", timeout=10)


def test_a_late_reply_never_lands_on_a_later_call(child):
    client = ExpressClient(child[1], "child")
    slow = client.call_async("sleep", 0.5, "late")
    with pytest.raises(ExpressTimeout):
        slow.result(0.05)
    slow.abandon()
    assert client.call("sleep", 0.0, "mine", timeout=10) == "mine"
    assert client._replies == {} and client._abandoned == set()


def test_pipelined_calls_are_answered_in_order(child):
    client = ExpressClient(child[1], "child")
    calls = [client.call_async("sleep", 0.02, k) for k in range(4)]
    assert [c.result(10) for c in reversed(calls)] == [3, 2, 1, 0]


def test_a_dead_actor_ends_the_call_at_once(child):
    proc, address = child
    client = ExpressClient(address, "child")
    call = client.call_async("sleep", 60, "never")
    time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ExpressPeerLost, match="process is gone"):
        call.result(30)
    assert time.monotonic() - t0 < 5
    later = client.call_async("add", 1)  # issued all the same, as a Ray call to a dead actor; fails when waited for
    with pytest.raises(ExpressPeerLost):
        later.result(30)


def test_a_caller_without_the_key_is_refused(child):
    proc, address = child
    wrong = ExpressAddress(address.node_id, address.socket, b"x" * 32)
    with pytest.raises(AuthenticationError):
        ExpressClient(wrong, "intruder")
    assert ExpressClient(address, "child").call("add", 2, timeout=10)["sum"] == 2  # still serving


def test_wait_any_returns_the_answered_call_first(child):
    target = Target()  # a second actor, in this process
    server = ExpressServer(target, SERVED, target._serial, "local", node_id="node")
    try:
        client, other = ExpressClient(child[1], "child"), ExpressClient(server.address, "local")
        slow, fast = client.call_async("sleep", 2.0, "slow"), other.call_async("sleep", 0.0, "fast")
        assert wait_any([slow, fast], 10) == [fast]
        assert wait_any([slow], 0.01) == []
        assert wait_all([slow, fast], 10) == [slow, fast]
    finally:
        server.close()


def test_call_result_says_what_ray_get_says(child):
    client = ExpressClient(child[1], "child")
    with pytest.raises(ActorCallError, match=r"^engine-0\.generate: ValueError: boom$") as info:
        call_result(client.call_async("fail", "boom"), 10, "engine-0.generate")
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ActorCallError, match=r"^engine-0\.generate: no answer within 0 s$"):
        call_result(client.call_async("sleep", 0.5, "late"), 0.05, "engine-0.generate")
    assert client.call("add", 5, timeout=10)["sum"] == 5  # the timed-out call's reply was dropped
    assert client._replies == {} and client._abandoned == set()
    os.kill(child[0].pid, signal.SIGKILL)
    with pytest.raises(ActorCallError, match=r"^engine-0\.generate: the actor died"):
        call_result(client.call_async("sleep", 60, "x"), 30, "engine-0.generate")


def test_express_calls_and_the_actors_own_calls_run_one_at_a_time():
    """In one process: two express callers run `occupy` while other threads run the actor's `serial` method, as Ray's
    thread would."""
    target = Target()
    server = ExpressServer(target, SERVED, target._serial, "local", node_id="node")
    try:
        one, two = ExpressClient(server.address, "local"), ExpressClient(server.address, "local")
        calls = [c.call_async("occupy", 0.05) for _ in range(3) for c in (one, two)]
        direct = [threading.Thread(target=target.occupy_as_ray_would, args=(0.05,)) for _ in range(3)]
        for t in direct:
            t.start()
        assert all(c.result(10) for c in calls)
        for t in direct:
            t.join(10)
        assert target.overlaps == 0
    finally:
        server.close()


def test_a_big_call_queued_behind_a_long_one_is_sent_at_once(child):
    """The server reads every call as it comes: a pipelined call larger than the socket's buffer does not block its
    sender (with no deadline) until the call before it ends."""
    client = ExpressClient(child[1], "child")
    slow = client.call_async("sleep", 3.0, "slow")
    t0 = time.monotonic()
    big = client.call_async("add", "x" * (8 << 20), "y", c="")
    assert time.monotonic() - t0 < 1.5
    assert slow.result(30) == "slow" and big.result(30)["sum"] == "x" * (8 << 20) + "y"


def test_a_server_that_never_answers_the_handshake_is_given_up_on():
    from multiprocessing.connection import Listener

    mute = Listener("\0beamrl-express-test-mute", family="AF_UNIX")  # accepts in the kernel, never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(ExpressPeerLost, match="no handshake within 0.3 s"):
            ExpressClient(ExpressAddress("node", "\0beamrl-express-test-mute", b"k" * 32), "mute", timeout=0.3)
        assert time.monotonic() - t0 < 5
    finally:
        mute.close()


def test_a_message_that_is_not_a_call_closes_the_channel_at_once(child):
    """A call the server cannot read (another beamrl version, say) ends the channel: its caller hears now, not at its
    deadline."""
    import pickle

    client = ExpressClient(child[1], "child")
    before = client.call_async("sleep", 0.2, "queued")
    client._conn.send_bytes(pickle.dumps(("a", "message", "of", "four")))
    t0 = time.monotonic()
    assert before.result(30) == "queued"  # the call before it is answered
    with pytest.raises(ExpressPeerLost):
        client.call_async("add", 1).result(30)
    assert time.monotonic() - t0 < 5


def test_closing_the_server_hangs_up_on_its_callers_and_stops_listening():
    """An actor's shutdown closes its server: a caller waiting on a call still running hears at once (not when the
    call ends), and the address takes no one any more (its accept thread woken and ended)."""
    target = Target()
    server = ExpressServer(target, SERVED, target._serial, "closing", node_id="node")
    client = ExpressClient(server.address, "closing")
    call = client.call_async("sleep", 10.0, "too late")
    time.sleep(0.2)  # the call is running
    t0 = time.monotonic()
    server.close()
    with pytest.raises(ExpressPeerLost):
        call.result(30)
    assert time.monotonic() - t0 < 5
    while any(t.name == "beamrl-express-closing" for t in threading.enumerate()):
        assert time.monotonic() - t0 < 5, "the accept thread still runs"
        time.sleep(0.01)
    with pytest.raises(ExpressPeerLost, match="ConnectionRefusedError"):
        ExpressClient(server.address, "closing", timeout=5)


def test_a_frozen_actor_loses_the_channel_at_the_io_deadline(child):
    """An actor alive but not reading (stopped) fills the socket: a send gives up after `io_timeout` and the call
    fails as a death, instead of blocking its caller forever."""
    proc, address = child
    client = ExpressClient(address, "child", io_timeout=0.5)
    os.kill(proc.pid, signal.SIGSTOP)
    sent = []
    sender = threading.Thread(target=lambda: sent.append(client.call_async("add", "x" * (8 << 20), "y")),
                              daemon=True)
    sender.start()
    sender.join(10)
    assert sent, "the send to a frozen actor did not end at its io_timeout"
    with pytest.raises(ExpressPeerLost, match="is gone"):
        sent[0].result(1)


def test_each_waiter_on_a_client_keeps_its_own_deadline(child):
    """Waiters on one client read for each other in slices: one waiting long for a slow call does not hold another
    past its own deadline."""
    client = ExpressClient(child[1], "child")
    slow = client.call_async("sleep", 3.0, "slow")
    behind = client.call_async("add", 1)
    waiter = threading.Thread(target=slow.result, args=(30,), daemon=True)
    waiter.start()
    time.sleep(0.2)  # the waiter is reading
    t0 = time.monotonic()
    with pytest.raises(ExpressTimeout):
        behind.result(0.2)
    assert time.monotonic() - t0 < 1.5
    waiter.join(30)
    assert behind.result(10)["sum"] == 1
