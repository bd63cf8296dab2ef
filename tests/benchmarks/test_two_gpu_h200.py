"""Issue 12's two-GPU script: its four stages run end to end on CPU (`--smoke`: gloo, tiny model, the same code
paths), and the RL phase summary (overlap of a one-step-off run) is computed from the logged metrics."""

import json
from pathlib import Path

import pytest

from benchmarks.two_gpu_h200 import rl_phases

ROOT = Path(__file__).resolve().parents[2]


def _row(step, version, rollout, wait):
    return {"step": step, "time/rollout_s": rollout, "time/rollout_wait_s": wait, "time/logprob_s": 0.1,
            "time/train_s": 2.0, "time/sync_s": 0.5, "time/step_s": 3.0, "rollout/weight_version": version,
            "sync/gbps": 10.0}


def test_rl_phases_overlap_from_the_unoverlapped_first_rollout():
    s = rl_phases([_row(0, 0, 4.0, 4.0), _row(1, 0, 4.5, 1.0), _row(2, 1, 4.0, 5.0)])
    assert s["rollout_alone_s"] == 4.0
    assert [x.get("hidden_rollout_s") for x in s["steps"]] == [None, 3.0, 0.0]
    assert [x.get("overlap_fraction") for x in s["steps"]] == [None, 0.75, 0.0]
    assert s["mean_overlap_fraction"] == 0.375 and s["one_step_off"] is True
    assert rl_phases([_row(0, 0, 4.0, 4.0), _row(1, 1, 4.0, 4.0)])["one_step_off"] is False  # on-policy
    with pytest.raises(ValueError, match="time/rollout_wait_s"):
        rl_phases([{k: v for k, v in _row(0, 0, 1.0, 1.0).items() if k != "time/rollout_wait_s"}])


@pytest.mark.slow
def test_cpu_smoke_run_of_all_four_stages(two_gpu_smoke):
    """(The run is the session's `two_gpu_smoke` fixture, tests/benchmarks/conftest.py.)"""
    tmp_path, p = two_gpu_smoke.out, two_gpu_smoke.proc
    logs = "".join((tmp_path / f"{s}.log").read_text()[-2000:] for s in ("sync", "teardown", "rl", "trainer")
                   if (tmp_path / f"{s}.log").exists())
    assert p.returncode == 0, p.stdout[-3000:] + logs
    summary = json.loads((tmp_path / "two_gpu_h200.json").read_text())
    assert [(s["stage"], s["rc"]) for s in summary["stages"]] == [("sync", 0), ("teardown", 0), ("rl", 0),
                                                                   ("trainer", 0)]
    sync_rows = summary["sync"]["rows"]
    assert sync_rows and all(r["checksums_equal_every_sync"] and r["sync_fraction_of_raw_broadcast"] > 0
                             for r in sync_rows)
    assert summary["teardown"]["error"] is None and len(summary["teardown"]["cycles"]) == 3
    rl = next(s for s in summary["stages"] if s["stage"] == "rl")["rl"]
    assert [s["step"] for s in rl["steps"]] == [0, 1, 2, 3] and rl["one_step_off"] is True
    assert all(0 <= s["overlap_fraction"] <= 1 for s in rl["steps"][1:])
    layouts = [r["layout"] for r in summary["trainer"]["rows"]]
    assert layouts == ["tp1", "tp2_sp", "ep2", "tp2_sp_ep2"]
    ep2 = summary["trainer"]["rows"][2]
    assert ep2["max_abs_dlogprob_vs_tp1"] < 1e-6  # EP splits whole experts: the same sums as TP1 (seen: 0.0)
    assert all(r["fwd_bwd_tokens_per_s"] > 0 for r in summary["trainer"]["rows"])


def test_the_gpu_rl_stage_recipe_passes_the_dry_run(tmp_path, capsys):
    """The rl stage's two-GPU recipe (overrides of the quickstart) is valid before any device time is spent."""
    from beamrl.cli import main
    from benchmarks.two_gpu_h200 import RL_COMMON, RL_GPU

    rc = main(["train", str(ROOT / "recipes" / "quickstart.yaml"), f"run.output_dir={tmp_path / 'run'}", *RL_COMMON,
               *RL_GPU, "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "placement disaggregated, off_policy_steps=1" in out and "model preset 'small'" in out
    assert "trainer: 1 GPUs" in out and "rollout: 1 x native engine(s) of TP1 = 1 GPUs" in out
