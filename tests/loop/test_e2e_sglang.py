"""End to end on CPU with the real SGLang 0.5.23 CPU engine and the real Megatron trainer (gloo)."""

import pytest

from tests.loop.e2e_helpers import metrics, run_train

pytestmark = pytest.mark.slow

SGLANG = ["rollout.engine=sglang", "model.dtype=bfloat16"]


def _ok(p):
    assert p.returncode == 0, f"beamrl train failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"


def test_colocated_sglang_engine(tmp_path):
    _ok(run_train(tmp_path / "run", *SGLANG, "run.num_steps=3"))
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]
    assert [r["sync/version"] for r in rows] == [1, 2, 3]
    # R3: the engine's routes are replayed, so bf16 trainer and engine logprobs stay close
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
    assert all("train/is/mean_ratio" in r or any(k.startswith("train/is/") for k in r) for r in rows)
