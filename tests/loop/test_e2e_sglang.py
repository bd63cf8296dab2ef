"""End to end on CPU with the real SGLang 0.5.23 CPU engine and the real Megatron trainer (gloo)."""

import pytest

from tests.loop.e2e_helpers import assert_engine_routes_replayed, metrics, run_train

pytestmark = pytest.mark.slow

SGLANG = ["rollout.engine=sglang", "model.dtype=bfloat16"]


def _ok(p):
    assert p.returncode == 0, f"beamrl train failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"


def test_colocated_sglang_engine_of_tp2(tmp_path):
    """Two trainer ranks and an engine of TP 2 on the same two worker slots: each engine TP rank reads each bucket
    from the trainer rank on its slot (`colocated: per_rank`, docs/colocated.md), checked by the probe every sync."""
    p = run_train(tmp_path / "run", *SGLANG, "run.num_steps=3", "cluster.gpus_per_node=2", "trainer.num_gpus=2",
                  "rollout.engine_tp=2")
    _ok(p)
    assert "(colocated: per_rank, " in p.stdout
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]
    assert [r["sync/version"] for r in rows] == [1, 2, 3]
    assert_engine_routes_replayed(rows)
    # ... so bf16 trainer and engine logprobs stay close
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 0.1


# Disaggregated runs (TP2 trainer, one step off, distributed sync; an engine spanning nodes) are rehearsed on
# several simulated nodes in test_e2e_rehearsal.py, with the same route and importance checks.
