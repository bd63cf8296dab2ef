"""End to end on CPU with the embedded native engine and the real Megatron trainer: weight versions, learning
signal plumbing, determinism, kill + resume."""

import pytest

from tests.loop.e2e_helpers import kill_after, metrics, run_train

pytestmark = pytest.mark.slow


def _ok(p):
    assert p.returncode == 0, f"beamrl train failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"


def test_colocated_native_versions_follow_steps_and_runs_reproduce(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _ok(run_train(a, "run.num_steps=3"))
    rows = metrics(a)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["rollout/weight_version"] == r["step"]  # on-policy: step k samples version k
        assert r["sync/version"] == r["step"] + 1  # and step k publishes version k+1
        assert r["sync/verify_max_abs_logprob_diff"] < 1e-3  # engine serves exactly the trainer's weights
        for key in ("reward/mean", "train/loss", "train/grad_norm", "train_rollout_logprob_abs_diff", "entropy"):
            assert key in r, key
    # R3 + fp32: the trainer's old logprobs equal the engine's rollout logprobs
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 1e-3
    _ok(run_train(b, "run.num_steps=3"))
    keys = ("reward/mean", "train/loss", "train/grad_norm")
    assert [[r[k] for k in keys] for r in metrics(b)] == [[r[k] for k in keys] for r in rows]


def test_killed_run_resumes_to_the_same_metrics(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = ("run.num_steps=4", "checkpoint.every_n_steps=2")
    _ok(run_train(full, *args))
    kill_after(cut, cut / "checkpoints" / "step_2" / "driver_state.json", *args)
    assert len(metrics(cut)) >= 2
    _ok(run_train(cut, *args, resume=True))
    keys = ("reward/mean", "train/loss", "train/grad_norm", "response_length/mean")
    got = [[r["step"]] + [r[k] for k in keys] for r in metrics(cut)]
    want = [[r["step"]] + [r[k] for k in keys] for r in metrics(full)]
    assert got == pytest.approx(want, abs=1e-6)


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path):
    out = tmp_path / "run"
    _ok(run_train(out, "run.num_steps=2", "checkpoint.every_n_steps=1"))
    p = run_train(out, "run.num_steps=2", "checkpoint.every_n_steps=1")
    assert p.returncode != 0 and "--resume" in (p.stderr + p.stdout)
    assert (out / "checkpoints").exists()  # nothing was deleted
