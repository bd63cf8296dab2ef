"""`SGLangEngine._run`: the caller's timeout bounds the whole call, its wait for a call in progress included (it
could take twice as long). The engine object here has only what `_run` reads (an event loop, the lock, no child
processes); the real engine's calls run in tests/rollout/test_engine_contract.py."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from beamrl.protocols.rollout import EngineError
from beamrl.rollout.sglang.engine import SGLangEngine


@pytest.fixture
def engine():
    e = SGLangEngine.__new__(SGLangEngine)
    loop = asyncio.new_event_loop()
    e._engine, e._lock, e._dead_reason, e._child_pids = SimpleNamespace(loop=loop), threading.Lock(), None, []
    yield e
    loop.close()


def _hold_lock(engine, seconds):
    engine._lock.acquire()
    threading.Timer(seconds, engine._lock.release).start()


def test_the_wait_for_a_call_in_progress_counts_against_the_timeout(engine):
    _hold_lock(engine, 0.4)  # another call in progress for 0.4 s
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="generate timed out after 1 s"):
        engine._run(lambda: asyncio.sleep(0.8), 1.0, "generate")  # 0.4 + 0.8 > 1
    assert time.monotonic() - t0 < 2.0  # (the old code returned, after 1.2 s: the match above is the check)


def test_a_call_that_fits_its_timeout_after_the_wait_returns(engine):
    _hold_lock(engine, 0.2)

    async def answer():
        await asyncio.sleep(0.1)
        return 7

    assert engine._run(answer, 1.0, "generate") == 7
