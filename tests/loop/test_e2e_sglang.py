"""End to end on CPU with the real SGLang 0.5.23 CPU engine and the real Megatron trainer (gloo)."""

import math

import pytest

from tests.loop.e2e_helpers import metrics, run_train

pytestmark = pytest.mark.slow

SGLANG = ["rollout.engine=sglang", "model.dtype=bfloat16"]


def _ok(p):
    assert p.returncode == 0, f"beamrl train failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"


def _assert_engine_routes_replayed(rows):
    """R3, from the trainer's replay self-check: in every step the training forward routed every (token, MoE layer)
    pair the engine routed through exactly the engine's experts (docs/metrics.md, replay/*)."""
    for r in rows:
        assert r["train/replay/routes_checked"] > 0, r  # replay was on and the engine's routes reached the trainer
        assert r["train/replay/route_mismatches"] == 0, r


def _assert_importance_metrics_in_bounds(rows, cap):
    """TIS metrics: present, finite and inside the range their definitions allow."""
    for r in rows:
        m = {k[len("train/is/"):]: v for k, v in r.items() if k.startswith("train/is/")}
        assert {"ratio_mean", "train_rollout_kl", "train_rollout_logprob_abs_diff", "truncated_fraction",
                "masked_fraction"} <= set(m), sorted(m)
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["ratio_mean"] > 0 and m["train_rollout_kl"] >= 0 and m["train_rollout_logprob_abs_diff"] >= 0
        assert 0 <= m["truncated_fraction"] <= 1 and m["masked_fraction"] == 0  # TIS truncates, never masks
        assert m["truncated_fraction"] > 0 or m["ratio_mean"] <= cap  # nothing truncated: every ratio <= cap


def test_colocated_sglang_engine(tmp_path):
    _ok(run_train(tmp_path / "run", *SGLANG, "run.num_steps=3"))
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]
    assert [r["sync/version"] for r in rows] == [1, 2, 3]
    _assert_engine_routes_replayed(rows)
    # ... so bf16 trainer and engine logprobs stay close
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 0.1


def test_disaggregated_one_step_off_tp2_distributed_sync(tmp_path):
    _ok(run_train(tmp_path / "run", *SGLANG, "run.num_steps=3", "cluster.gpus_per_node=3", "trainer.num_gpus=2",
                  "trainer.tp=2", "trainer.sp=true", "placement.mode=disaggregated", "placement.off_policy_steps=1",
                  "algorithm.importance.mode=tis", "algorithm.importance.cap=2.0", "sync.transport=distributed", timeout=1500))
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    # one step off: step k+1 is generated with version k while step k trains
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1]
    assert [r["sync/version"] for r in rows] == [1, 2, 3]
    _assert_engine_routes_replayed(rows)
    _assert_importance_metrics_in_bounds(rows, cap=2.0)
