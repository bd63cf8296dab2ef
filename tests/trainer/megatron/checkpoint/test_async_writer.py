"""The background writer writes the state as of the fork while the parent changes it, reports failures and
is killed at its timeout."""

import os
import time

import torch

from beamrl.trainer.megatron.checkpoint.async_writer import BackgroundWrite


def test_the_child_writes_the_state_as_of_the_fork(tmp_path):
    live = torch.zeros(1 << 16)
    out = tmp_path / "t.pt"

    def write():
        time.sleep(0.5)  # the parent has changed `live` by now
        torch.save(live, out)

    w = BackgroundWrite(write, "test")
    live.fill_(1.0)  # training goes on
    assert w.wait(timeout_s=30)
    assert torch.count_nonzero(torch.load(out, weights_only=True)) == 0


def test_a_failing_write_is_reported(tmp_path):
    def fail():
        raise OSError("disk full")

    assert not BackgroundWrite(fail, "test").wait(timeout_s=30)


def test_a_write_past_its_timeout_is_killed():
    w = BackgroundWrite(lambda: time.sleep(60), "test")
    t0 = time.monotonic()
    assert not w.wait(timeout_s=0.3)
    assert time.monotonic() - t0 < 10 and w.done()


def test_a_killed_writer_that_does_not_exit_does_not_hold_the_rank(monkeypatch, capsys):
    """A writer stuck in uninterruptible I/O (a hung network file system) outlives SIGKILL for a while: the rank
    goes on after `REAP_S`, saying so (it waited in `waitpid` without a bound)."""
    from beamrl.trainer.megatron.checkpoint import async_writer

    w = BackgroundWrite(lambda: time.sleep(60), "test")
    real_kill, pid = os.kill, w.pid
    monkeypatch.setattr(async_writer, "REAP_S", 0.5)
    monkeypatch.setattr(async_writer.os, "kill", lambda p, sig: None)  # the "stuck" child ignores the kill
    try:
        t0 = time.monotonic()
        assert not w.wait(timeout_s=0.2)
        assert time.monotonic() - t0 < 5
        assert "not gone after" in capsys.readouterr().err
    finally:
        real_kill(pid, 9)
        os.waitpid(pid, 0)
