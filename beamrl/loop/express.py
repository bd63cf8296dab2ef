"""Express calls: the per-step calls between a run's processes on one node over a Unix socket, not a Ray actor call.

Ray places, starts, health-checks, restarts and stops the actors, and carries every call between nodes. A Ray actor
call costs about 0.85 ms back to back and 2.4 ms when the caller had been waiting (on the 2-core CI-class VM,
`benchmarks/ray_latency.py`), against 0.03 and 0.70 ms for the same method called over a socket (an express call);
a step of the RL loop makes five or six such calls one after another (the rollout, the train step, and the weight
sync's pause, bucket, commit and version check). So an actor opens an `ExpressServer` once (`open_express`), and a
caller on the same node sends those calls through an `ExpressClient` instead. They run the actor's own methods, one
at a time with its Ray calls (the actor's `serial` lock), so the two ways into an actor behave alike.

What a caller sees matches `ray.get`'s cases: the result; `ExpressTaskError` with the method's own exception as its
`cause` (Ray: `RayTaskError`); `ExpressPeerLost` when the actor's process is gone (Ray: `RayActorError`); and a
deadline the caller chooses (`ExpressCall.result(timeout)`; Ray: `GetTimeoutError`). A reply that comes after its
caller gave up is read and dropped, so a late answer never lands on a later call.

The socket is in Linux's abstract namespace (no file to leave behind) and guarded by a random key (HMAC challenge,
`multiprocessing.connection`); the key travels in the Ray call that asks for the address. Payloads are pickled, as
Ray pickles its arguments, between processes of the same run only.
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge, wait
from typing import Any


class ExpressPeerLost(RuntimeError):
    """The actor's end of an express channel closed: its process died (or it shut down)."""


class ExpressTaskError(RuntimeError):
    """The called method raised; `cause` is its exception (unpicklable ones come as a `RuntimeError` saying what
    they were)."""

    def __init__(self, method: str, cause: BaseException):
        super().__init__(f"{method}: {type(cause).__name__}: {cause}")
        self.cause = cause


#: How long a caller waits for a new channel's key handshake, and for a send or a started reply to move on (the
#: other side reads and writes at once unless its process is frozen).
CONNECT_TIMEOUT_S = 60.0
#: The longest a waiter holds a client's read lock at a time (other waiters on the client read in between).
_READ_SLICE_S = 0.05


class ExpressTimeout(TimeoutError):
    """No reply within the caller's deadline."""


@dataclass(frozen=True)
class ExpressAddress:
    """Where an actor's express server listens: its node (Ray's node id: callers elsewhere use Ray), the abstract
    socket name and the key."""

    node_id: str
    socket: str
    authkey: bytes


def serial(method):
    """Run an actor method under the actor's `_serial` lock (a `threading.RLock`), as its express calls do: one call
    at a time, whichever way it came."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._serial:
            return method(self, *args, **kwargs)

    return run


def _pickled_error(method: str, exc: BaseException) -> bytes:
    try:
        return pickle.dumps(exc, protocol=5)
    except Exception:  # noqa: BLE001 - an exception that does not pickle is described instead
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc} (raised by {method}; it could not be "
                                         f"pickled)"), protocol=5)


def _hang_up(conn: Connection) -> None:
    """Close a connection so that both its peer and a thread of ours blocked reading it see its end now (`close`
    alone leaves a blocked read, and so the peer, waiting)."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    except OSError:
        pass
    try:  # (the server's close and a serving thread may both hang up on one connection)
        conn.close()
    except OSError:
        pass


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device, if this process uses CUDA (never initialises it)."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


class ExpressServer:
    """Serves `methods` of `target` on an abstract Unix socket: one thread accepts; per connected caller one thread
    reads its calls as they come and another runs them in order, each under `lock` (the actor's `serial` lock)."""

    def __init__(self, target: Any, methods: Iterable[str], lock: threading.RLock, name: str, node_id: str):
        self.target, self.methods, self.lock, self.name = target, frozenset(methods), lock, name
        self.authkey = secrets.token_bytes(32)
        name_ = f"\0beamrl-express-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = Listener(name_, family="AF_UNIX")  # the key is checked per connection (`_serve`)
        self.address = ExpressAddress(node_id, name_, self.authkey)
        self._closed = False
        self._conns: list[Connection] = []
        self._device = _current_cuda_device()
        threading.Thread(target=self._accept, name=f"beamrl-express-{name}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:  # closed
                return
            if self._closed:
                conn.close()
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"beamrl-express-{self.name}-call",
                             daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:  # the key challenge, here rather than in `accept`: a caller that stalls holds up only its own thread
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except Exception:  # noqa: BLE001 - a caller without the key (or gone): refused
            _hang_up(conn)
            return
        calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, args=(conn, calls), name=f"beamrl-express-{self.name}-run",
                         daemon=True).start()
        # This thread only reads, at once: a caller's send never waits for the calls queued before it to run (a
        # pipelined bucket would otherwise block its sender, with no deadline, behind a wedged call).
        try:
            while True:
                calls.put(pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a message that is not a call: the channel closes, the caller learns now
            _hang_up(conn)
        calls.put(None)

    def _run(self, conn: Connection, calls: queue.SimpleQueue) -> None:
        """Run one caller's calls in order and answer each. If this thread ends for any reason, the connection
        closes, so a caller waiting on it hears at once (not at its deadline)."""
        try:
            if self._device is not None:  # the CUDA device is per thread: the one the actor's own calls run on
                import torch

                torch.cuda.set_device(self._device)
            while (call := calls.get()) is not None:
                seq, method, blob = call  # (seq, method, the pickled (args, kwargs)): the arguments unpickle below,
                del call  # so a call whose arguments do not is answered with the error
                try:
                    if method not in self.methods:
                        raise AttributeError(f"{self.name} has no express method {method!r} (it serves "
                                             f"{sorted(self.methods)})")
                    args, kwargs = pickle.loads(blob)
                    del blob
                    with self.lock:
                        result = getattr(self.target, method)(*args, **kwargs)
                    del args, kwargs
                    reply = pickle.dumps((seq, True, pickle.dumps(result, protocol=5)), protocol=5)
                    del result
                except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
                    reply = pickle.dumps((seq, False, _pickled_error(method, exc)), protocol=5)
                conn.send_bytes(reply)
        except Exception:  # noqa: BLE001 - e.g. a message that is not (seq, method, args) or a closed socket
            pass
        finally:
            _hang_up(conn)

    def close(self) -> None:
        """Stop accepting and hang up on every caller (their waits end with `ExpressPeerLost`)."""
        self._closed = True
        try:  # wake the accept thread (closing the listener does not), which then sees `_closed`
            Client(self.address.socket, family="AF_UNIX").close()
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        for c in self._conns:
            _hang_up(c)


class ExpressCall:
    """A call in flight; `result(timeout)` waits for its reply."""

    def __init__(self, client: "ExpressClient", seq: int, method: str):
        self.client, self.seq, self.method = client, seq, method

    def done(self) -> bool:
        """Whether its reply (or the channel's end) has arrived; reads what is waiting without blocking."""
        return self.client._poll(self.seq, 0.0)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for its reply (or the channel's end); whether it came."""
        return self.client._poll(self.seq, timeout)

    def result(self, timeout: float) -> Any:
        """The method's return value; `ExpressTaskError`, `ExpressPeerLost` or `ExpressTimeout` otherwise."""
        return self.client._result(self, timeout)

    def abandon(self) -> None:
        """The caller gives up on it: its reply is dropped whenever it comes."""
        self.client._abandon(self.seq)


def _connect(address: ExpressAddress, name: str, timeout: float) -> Connection:
    """The socket to `address`, through both key challenges, within `timeout` s. The handshake's reads have no
    deadline of their own, so it runs on a helper thread that the caller stops waiting for (a handshake that ends
    after that closes its socket)."""
    out: dict = {}
    gave_up = threading.Event()

    def handshake() -> None:
        try:
            conn = Client(address.socket, family="AF_UNIX")
            answer_challenge(conn, address.authkey)
            deliver_challenge(conn, address.authkey)
            out["conn"] = conn
            if gave_up.is_set():
                conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            out["error"] = exc

    t = threading.Thread(target=handshake, name=f"beamrl-express-connect-{name}", daemon=True)
    t.start()
    t.join(timeout)
    gave_up.set()
    if not t.is_alive() and "conn" in out:
        return out["conn"]
    if isinstance(out.get("error"), AuthenticationError):
        raise out["error"]
    why = (f"{type(out['error']).__name__}: {out['error']}" if "error" in out else
           f"no handshake within {timeout:g} s")
    raise ExpressPeerLost(f"{name}: cannot open its express channel ({why}): its actor is gone or wedged")


def _io_deadline(conn: Connection, seconds: float) -> None:
    """Bound every send and every read of a started message on `conn` (SO_SNDTIMEO, SO_RCVTIMEO): a peer that is
    frozen, not dead, must not hold a caller forever in a write to a full socket or in the middle of a reply."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the options belong to the socket, shared with `conn`
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    finally:
        sock.close()


class ExpressClient:
    """A caller's channel to one actor's `ExpressServer` (thread-safe; calls are answered in order).

    Waiting: whoever waits reads the replies for everyone, holding the read lock only for `_READ_SLICE_S` at a time,
    so every waiter keeps its own deadline. A send or a started reply that stalls for `io_timeout` s (the actor's
    process frozen) loses the channel: the calls on it fail as if the actor had died."""

    def __init__(self, address: ExpressAddress, name: str, timeout: float = CONNECT_TIMEOUT_S,
                 io_timeout: float = CONNECT_TIMEOUT_S):
        """Connect and pass the key challenge within `timeout` s, else `ExpressPeerLost`."""
        self.address, self.name = address, name
        self._conn = _connect(address, name, timeout)
        _io_deadline(self._conn, io_timeout)
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._seq = 0
        self._replies: dict[int, tuple[bool, Any]] = {}
        self._abandoned: set[int] = set()
        self._lost: str | None = None

    def call_async(self, method: str, *args, **kwargs) -> ExpressCall:
        """Send `method(*args, **kwargs)`; returns at once. As a Ray call to a dead actor does, a call on a lost
        channel is issued all the same and fails when waited for (`ExpressPeerLost`), where callers handle deaths."""
        blob = pickle.dumps((args, kwargs), protocol=5)
        with self._send_lock:
            seq, self._seq = self._seq, self._seq + 1
            if self._lost is None:
                try:
                    self._conn.send_bytes(pickle.dumps((seq, method, blob), protocol=5))
                except OSError as exc:  # a closed peer, or a frozen one that stopped reading (`io_timeout`)
                    self._lose(f"the actor's end of the express channel is gone ({type(exc).__name__}: {exc})")
        return ExpressCall(self, seq, method)

    def call(self, method: str, *args, timeout: float, **kwargs) -> Any:
        """`call_async(...).result(timeout)`; a call that times out is abandoned."""
        pending = self.call_async(method, *args, **kwargs)
        try:
            return pending.result(timeout)
        except ExpressTimeout:
            pending.abandon()
            raise

    @property
    def connection(self) -> Connection:
        """For `multiprocessing.connection.wait` over several clients."""
        return self._conn

    def _lose(self, why: str) -> None:
        if self._lost is None:
            self._lost = why

    def _read_one(self) -> None:
        """Read one waiting reply into `_replies` (the caller holds `_read_lock` and saw the connection ready)."""
        try:
            blob = self._conn.recv_bytes()
        except (EOFError, OSError) as exc:
            self._lose("the actor's end of the express channel closed: its process is gone" if
                       isinstance(exc, EOFError) else f"reading a reply failed ({type(exc).__name__}: {exc})")
            return
        seq, ok, value = pickle.loads(blob)  # (seq, ok, the pickled result or exception)
        try:
            value = pickle.loads(value)
        except Exception as exc:  # noqa: BLE001 - e.g. a class this process cannot import
            ok, value = False, RuntimeError(f"its {'result' if ok else 'exception'} cannot be unpickled here: "
                                            f"{type(exc).__name__}: {exc}")
        if seq in self._abandoned:
            self._abandoned.discard(seq)
            return
        self._replies[seq] = (ok, value)

    def _poll(self, seq: int, timeout: float) -> bool:
        """Whether call `seq` is answered (or the channel lost), reading replies for up to `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            with self._read_lock:
                if seq in self._replies or self._lost is not None:
                    return True
                left = deadline - time.monotonic()
                try:  # (a deadline already passed still reads what is waiting)
                    ready = self._conn.poll(min(max(left, 0.0), _READ_SLICE_S))
                except (EOFError, OSError):
                    ready = True  # the read reports the loss
                if ready:
                    self._read_one()
                elif left <= 0:
                    return False

    def _result(self, call: ExpressCall, timeout: float) -> Any:
        if not self._poll(call.seq, timeout):
            raise ExpressTimeout(f"{self.name}.{call.method}: no answer within {timeout:.0f} s")
        with self._read_lock:
            reply = self._replies.pop(call.seq, None)
        if reply is None:
            raise ExpressPeerLost(f"{self.name}.{call.method}: {self._lost}")
        ok, value = reply
        if not ok:
            raise ExpressTaskError(f"{self.name}.{call.method}", value)
        return value

    def _abandon(self, seq: int) -> None:
        with self._read_lock:
            if self._replies.pop(seq, None) is None:
                self._abandoned.add(seq)

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


def wait_any(calls: list[ExpressCall], timeout: float) -> list[ExpressCall]:
    """The calls of `calls` that are answered (or whose channel is lost), waiting up to `timeout` s for at least
    one (`ray.wait` with num_returns=1 for express calls)."""
    deadline = time.monotonic() + timeout
    while True:
        done = [c for c in calls if c.done()]
        left = deadline - time.monotonic()
        if done or left <= 0:
            return done
        wait(list({id(c.client): c.client.connection for c in calls}.values()), timeout=left)
