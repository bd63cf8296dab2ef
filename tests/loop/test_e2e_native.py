"""End to end on CPU with the embedded native engine and the real Megatron trainer: weight versions, learning
signal plumbing, determinism, kill + resume."""

import shutil

import pytest

from beamrl.loop.checkpoints import problems, published, step_of
from tests.loop.e2e_helpers import kill_after, metrics, run_train

pytestmark = pytest.mark.slow


def _ok(p):
    assert p.returncode == 0, f"beamrl train failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"


def test_colocated_native_versions_follow_steps(colocated_run):
    """(That two runs of one recipe reproduce each other bit for bit is asserted by the kill + resume tests here
    and in test_faults.py: their first runs are independent processes compared with `colocated_run`.)"""
    from tests.commands.test_bench import TRAINING_CODE_PATH

    # `beamrl train` syncs through the same orchestrator and packing function as `beamrl bench sync`
    # (tests/commands/test_bench.py asserts the bench's code path is this same string)
    assert f"[beamrl] weight sync: {TRAINING_CODE_PATH} (colocated: staged, " in colocated_run.stdout
    rows = metrics(colocated_run.out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["rollout/weight_version"] == r["step"]  # on-policy: step k samples version k
        assert r["sync/version"] == r["step"] + 1  # and step k publishes version k+1
        assert r["sync/verify_max_abs_logprob_diff"] <= 1e-4  # engine serves exactly the trainer's weights
        assert r["sync/buckets"] >= 1
        for key in ("reward/mean", "train/loss", "train/grad_norm", "train_rollout_logprob_abs_diff", "entropy"):
            assert key in r, key
    # R3 + fp32: the trainer's old logprobs equal the engine's rollout logprobs
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 1e-3
    # checkpoint.every_n_steps=2: step_2 and step_4, complete (the default, only the final checkpoint, is checked
    # in test_first_run.py)
    assert [step_of(p) for p in published(colocated_run.out / "checkpoints")] == [2, 4]
    assert all(problems(p) == [] for p in published(colocated_run.out / "checkpoints"))


def _deterministic(row: dict) -> dict:
    """A metrics row without its wall-clock fields: durations (`time/*`, `*_s`) and rates derived from them."""
    return {k: v for k, v in row.items()
            if not (k.startswith(("time/", "throughput/")) or k.endswith("_s") or k == "sync/gbps")}


def test_killed_run_resumes_to_the_same_metrics(colocated_run, tmp_path):
    cut, args = tmp_path / "cut", colocated_run.args
    kill_after(cut, cut / "checkpoints" / "step_2", *args)  # step_2 appears (by rename) only when complete
    assert len(metrics(cut)) >= 2
    p = run_train(cut, *args, resume=True)
    _ok(p)
    assert f"resumed from {cut / 'checkpoints' / 'step_2'}" in p.stdout
    got, want = [_deterministic(r) for r in metrics(cut)], [_deterministic(r) for r in metrics(colocated_run.out)]
    assert [g["step"] for g in got] == [0, 1, 2, 3]
    assert any(w["train/loss"] != 0 for w in want), "degenerate run: every loss is zero"
    assert len(want[0]) > 20 and all(g.keys() == w.keys() for g, w in zip(got, want))
    assert got == want  # every metric of every step, bit for bit


def test_express_calls_change_no_number(colocated_run, tmp_path):
    """The same run with every call through Ray (`placement.express_calls: false`) gives every metric of every step
    bit for bit: express calls change how the calls travel, nothing they compute (docs/express-calls.md)."""
    assert "[beamrl] actor calls: express (every actor on this node" in colocated_run.stdout
    p = run_train(tmp_path / "ray", *colocated_run.args, "placement.express_calls=false")
    _ok(p)
    assert "[beamrl] actor calls: through Ray (placement.express_calls: false)" in p.stdout
    got, want = [_deterministic(r) for r in metrics(tmp_path / "ray")], [_deterministic(r) for r in
                                                                          metrics(colocated_run.out)]
    assert [g["step"] for g in got] == [0, 1, 2, 3] and len(want[0]) > 20
    assert got == want


def test_fresh_run_refuses_to_overwrite_checkpoints(colocated_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(colocated_run.out, out)
    p = run_train(out, *colocated_run.args)
    assert p.returncode != 0 and "--resume" in (p.stderr + p.stdout)
    assert [step_of(d) for d in published(out / "checkpoints")] == [2, 4]  # nothing was deleted


def test_resume_falls_back_past_a_damaged_checkpoint(colocated_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(colocated_run.out, out)
    damaged = out / "checkpoints" / "step_4" / "trainer" / ".metadata"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    p = run_train(out, *colocated_run.args, resume=True)
    _ok(p)
    assert f"checkpoint {out / 'checkpoints' / 'step_4'} is damaged: {damaged}: SHA-256 differs" in p.stdout
    assert "falling back to the previous checkpoint" in p.stdout
    assert f"resumed from {out / 'checkpoints' / 'step_2'}" in p.stdout
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3]
    assert [step_of(d) for d in published(out / "checkpoints")] == [2, 4]
    assert problems(out / "checkpoints" / "step_4") == []  # step_4 saved anew, whole


def test_two_data_parallel_ranks_train_like_one(disaggregated_run, tmp_path):
    """EP2 over 2 ranks is data-parallel for the dense weights: each rank must train on its own half of the
    batch, so step 0's loss and gradient norm equal the single-rank run's (fp32)."""
    one_step = ("run.num_steps=1", *[a for a in disaggregated_run.args if not a.startswith(("run.num_steps=",
                                                                                            "cluster.gpus_per_node="))])
    _ok(run_train(tmp_path / "dp2", *one_step, "trainer.num_gpus=2", "trainer.ep=2", "cluster.gpus_per_node=3"))
    one, (two,) = metrics(disaggregated_run.out)[0], metrics(tmp_path / "dp2")
    assert two["reward/mean"] == one["reward/mean"]
    assert one["train/loss"] != 0
    assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-4, abs=1e-6)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-4)
