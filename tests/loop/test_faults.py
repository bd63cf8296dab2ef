"""Faults in a real run on CPU (the Megatron trainer and the embedded native engine as Ray actors): an engine
process killed mid-rollout is restarted, resynced and its requests re-issued; a killed trainer rank ends the run
with one line naming it and the checkpoint, and `--resume` continues from there."""

import os
import re
import signal
import subprocess
import time

import pytest

from beamrl.loop.checkpoints import published, step_of
from beamrl.sync import shm
from tests.loop.e2e_helpers import QUICKSTART, ROOT, SMALL, env, metrics, run_train, train_cmd, trainer_pids

pytestmark = pytest.mark.slow


def _run_in_process(out_dir, *overrides):
    from beamrl.loop import run_training
    from beamrl.recipe import load_recipe

    return run_training(load_recipe(QUICKSTART, [f"run.output_dir={out_dir}", *SMALL, *overrides]))


# Colocated (the colocated transport) and disaggregated (an update group, rebuilt without the dead engine's actor):
# the uninterrupted run of each (tests/loop/conftest.py) is what the faulty one must reproduce.
LAYOUTS = {"colocated": "colocated_run", "disaggregated": "disaggregated_run"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_engine_killed_mid_rollout_is_restarted_resynced_and_the_batch_is_whole(tmp_path, monkeypatch, request,
                                                                               layout):
    from beamrl.loop.collect import RolloutCollector

    clean = request.getfixturevalue(LAYOUTS[layout])
    killed: list[int] = []
    start, finish = RolloutCollector.start, RolloutCollector.finish

    def kill_engine(engines) -> None:
        pid = engines.pids(0)[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    def start_then_kill(self, step, version):
        if step != 1:
            return start(self, step, version)
        pid = self.engines.pids(0)[0]  # asked before any request is in flight
        pending = start(self, step, version)  # step 1's requests are in flight on the engine ...
        os.kill(pid, signal.SIGKILL)  # ... when its process dies
        killed.append(pid)
        return pending

    def finish_then_kill(self, pending):
        batch = finish(self, pending)
        if pending.step == 2:  # step 2: the engine dies after its rollout, before the weight sync
            kill_engine(self.engines)
        return batch

    monkeypatch.setattr(RolloutCollector, "start", start_then_kill)
    monkeypatch.setattr(RolloutCollector, "finish", finish_then_kill)
    out = _run_in_process(tmp_path / "faulty", *clean.args)
    monkeypatch.undo()
    rows, want = metrics(out), metrics(clean.out)
    assert len(killed) == 2
    assert [r["step"] for r in rows] == [r["step"] for r in want]  # the run finished
    assert [r["engine/restarts"] for r in rows] == [0, 1, 1] + [0] * (len(rows) - 3)
    for r in rows:
        assert r["rollout/num_samples"] == 16 and r["rollout/aborted_groups"] == 0  # every step: the full batch
        assert r["rollout/weight_version"] == r["step"]  # the restarted engine served step 1 at version 1
        assert r["sync/version"] == r["step"] + 1
        assert r["sync/verify_max_abs_logprob_diff"] <= 1e-4
    # The lost requests were re-issued unchanged (their seeds): the same samples, so the same run as without the kill
    keys = ("reward/mean", "response_length/mean", "train/loss", "train/grad_norm")
    assert any(r["train/loss"] != 0 for r in want), "degenerate run: every loss is zero"
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in want]


def _wait_for(path, proc, timeout=600):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"run exited (rc={proc.returncode}) before {path} appeared"
        assert time.time() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.01)  # steps take well under a second: a coarse poll could miss the window


def test_a_killed_trainer_rank_is_one_line_naming_it_and_the_checkpoint_then_resume_continues(tmp_path):
    out = tmp_path / "run"
    args = ("run.num_steps=4", "checkpoint.every_n_steps=1", "trainer.num_gpus=2", "trainer.ep=2",
            "cluster.gpus_per_node=2", "rollout.num_engines=2")
    log_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(log_path, "w") as so, open(err_path, "w") as se:
        p = subprocess.Popen(train_cmd(out, *args), env=env(), cwd=ROOT, stdout=so, stderr=se,
                             start_new_session=True)
        try:
            _wait_for(out / "checkpoints" / "step_1", p)
            pids = trainer_pids(log_path.read_text())
            assert len(pids) == 2, log_path.read_text()[-3000:]
            t0 = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            rc = p.wait(timeout=600)
            elapsed = time.monotonic() - t0
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(60)
    stderr = err_path.read_text()
    assert rc == 1, stderr[-3000:]
    assert elapsed < 300  # timeouts.train_step_s of the run (SMALL): a dead rank is noticed, not waited out
    lines = [ln for ln in stderr.splitlines() if ln.startswith("beamrl train:")]
    assert len(lines) == 1 and stderr.rstrip().splitlines()[-1] == lines[0], stderr[-3000:]
    last = published(out / "checkpoints")[-1]
    assert re.fullmatch(rf"beamrl train: trainer rank 1 \(node 0, slot 1\) died during trainer\.\S+: .*; resume from "
                        rf"checkpoint {re.escape(str(last))} with `beamrl train <recipe> --resume`", lines[0]), lines[0]
    assert "Traceback" not in stderr
    # the ranks were killed without their shutdown: the run removed their weight sync's shared-memory files
    assert shm.files_of(pids) == []
    resumed = run_train(out, *args, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {last}" in resumed.stdout
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3]
    assert step_of(published(out / "checkpoints")[-1]) == 4


def test_one_step_off_engine_restarted_while_the_overlapped_rollout_is_collected_says_what_it_sampled(
        tmp_path, monkeypatch, capsys):
    """One step off, the rollout of step 1 runs while step 0 trains. Its engine dies then: when the collection after
    the train step restarts it, the trainer holds only version 1's weights, which the engine gets under version 0.
    The run goes on, and the console and `rollout/resynced_ahead` say that the re-run requests sampled the newer
    policy (before, nothing did)."""
    from beamrl.loop.collect import RolloutCollector

    killed: list[int] = []
    start = RolloutCollector.start

    def start_then_kill(self, step, version):
        if step != 1:
            return start(self, step, version)
        pid = self.engines.pids(0)[0]
        pending = start(self, step, version)  # submitted before step 0 trains
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        return pending

    monkeypatch.setattr(RolloutCollector, "start", start_then_kill)
    out = _run_in_process(tmp_path / "run", "run.num_steps=3", "placement.mode=disaggregated",
                          "sync.transport=distributed", "cluster.gpus_per_node=2", "placement.off_policy_steps=1",
                          "algorithm.importance={mode: tis, cap: 2.0}")
    monkeypatch.undo()
    rows = metrics(out)
    assert len(killed) == 1 and [r["step"] for r in rows] == [0, 1, 2]
    # on step 1's row: the rollout that the restarted engine finished, with its restart
    assert [r["rollout/resynced_ahead"] for r in rows] == [0.0, 1.0, 0.0]
    assert [r["engine/restarts"] for r in rows] == [0.0, 1.0, 0.0]
    assert all(r["rollout/num_samples"] == 16 for r in rows)  # the batch is whole
    said = [ln for ln in capsys.readouterr().out.splitlines() if "restarted while the one-step-off rollout" in ln]
    assert len(said) == 1 and "after the trainer's step to version 1: it got those weights under version 0" in said[0]
