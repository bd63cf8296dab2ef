"""`RLDriver` starts the engines while the trainer starts (both are mostly process start-up and imports), except on
colocated GPUs, and whatever started is released whichever start fails. The starts themselves are stand-ins here
(the real ones run in every end-to-end test); what is checked is the driver's overlap and ownership."""

import threading
import time
from types import SimpleNamespace

import pytest

from beamrl.loop import driver as D
from beamrl.loop.setup import Resources, engines_start_with_trainer
from beamrl.recipe.load import load_recipe
from tests.loop.e2e_helpers import QUICKSTART


class _Group:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def shutdown(self):
        self.log.append(f"{self.name} released")


def _driver(monkeypatch, trainer_fails=False, engines_fail=False, overrides=()):
    log, started = [], {}
    both_running = threading.Barrier(2, timeout=5)

    def start_trainer(run, policy, reference=False):
        started["trainer"] = threading.current_thread().name
        both_running.wait()  # returns only once the engines' start runs too (else: BrokenBarrierError)
        if trainer_fails:
            raise RuntimeError("trainer start failed")
        return _Group("trainer", log)

    def start_engines(run, policy):
        started["engines"] = threading.current_thread().name
        both_running.wait()
        time.sleep(0.05)  # still starting when the trainer is ready
        if engines_fail:
            raise RuntimeError("engine start failed")
        return _Group("engines", log)

    monkeypatch.setattr(D, "start_trainer", start_trainer)
    monkeypatch.setattr(D, "start_engines", start_engines)
    d = D.RLDriver(load_recipe(QUICKSTART, list(overrides)))
    d.ctx = SimpleNamespace(cpu=True, out_dir=None)
    d.resources = Resources()
    return d, log, started


def test_the_engines_start_while_the_trainer_starts_and_both_are_owned(monkeypatch):
    d, log, started = _driver(monkeypatch)
    d._start_trainer_and_engines("policy")
    d.resources.add("loggers", lambda: log.append("loggers released"))  # acquired later: released first
    assert started["trainer"] != started["engines"]  # two threads, both inside their start at once (the barrier)
    assert (d.trainer.name, d.engines.name) == ("trainer", "engines")
    d.close()
    assert log == ["loggers released", "engines released", "trainer released"]  # engines before the trainer


@pytest.mark.parametrize("trainer_fails, engines_fail", [(True, False), (False, True), (True, True)])
def test_a_failed_start_releases_what_did_start_and_names_the_first_failure(monkeypatch, capsys, trainer_fails,
                                                                             engines_fail):
    d, log, _ = _driver(monkeypatch, trainer_fails, engines_fail)
    with pytest.raises(RuntimeError, match="trainer start failed" if trainer_fails else "engine start failed"):
        d._start_trainer_and_engines("policy")
    # when both fail, the trainer's error is raised and the engines' is not lost
    assert ("the engines failed to start too: RuntimeError: engine start failed" in capsys.readouterr().out) == (
        trainer_fails and engines_fail)
    d.close()
    assert sorted(log) == sorted([f"{n} released" for n, failed in (("trainer", trainer_fails),
                                                                    ("engines", engines_fail)) if not failed])


def test_only_engines_that_share_gpus_with_the_trainer_wait_for_it():
    r = load_recipe(QUICKSTART, [])
    assert engines_start_with_trainer(r)  # CPU
    gpu = ["cluster.device=cuda"]
    assert not engines_start_with_trainer(load_recipe(QUICKSTART, gpu + ["placement.mode=colocated"]))
    assert engines_start_with_trainer(load_recipe(QUICKSTART, gpu + ["placement.mode=disaggregated",
                                                                     "sync.transport=distributed", "cluster.gpus_per_node=2"]))
