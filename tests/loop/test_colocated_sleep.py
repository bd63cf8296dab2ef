"""The colocated GPU run (benchmarks/colocated_h200.yaml, benchmarks/colocated_h200.sh) as a CPU smoke run: the same
recipe at the tiny preset in float32 on cluster.device=cpu, trainer sleep/wake on, 2 steps through `beamrl train`,
then the benchmark's report script on its metrics.

The trainer sleeps before every rollout and wakes before training: the old logprobs it computes after waking must
equal the engine's rollout logprobs (R3 + float32), and the engine must serve exactly the trainer's synced weights
(the probe check), so a wake that restored anything wrongly fails here."""

import json
import subprocess
import sys

import pytest

from tests.loop.e2e_helpers import ROOT, env, metrics

pytestmark = pytest.mark.slow

RECIPE = ROOT / "benchmarks" / "colocated_h200.yaml"
CPU = ["cluster.device=cpu", "model.preset=tiny", "model.dtype=float32", "run.num_steps=2",
       "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16",
       "trainer.micro_batch_size=8", "timeouts.generate_s=300", "timeouts.train_step_s=300", "timeouts.sync_s=120"]


def test_cpu_smoke_of_the_colocated_gpu_run(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "beamrl.cli", "train", str(RECIPE), f"run.output_dir={out}", *CPU],
                       env=env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"beamrl train failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["time/trainer_sleep_s"] >= 0 and r["time/trainer_wake_s"] >= 0
        assert r["memory/trainer_offloaded_gib"] > 0  # the storages really moved (CPU: to host copies)
        assert r["sync/verify_max_abs_logprob_diff"] <= 1e-4  # the woken trainer's weights are what the engine got
        assert r["rollout/weight_version"] == r["step"] and r["sync/version"] == r["step"] + 1
    # the trainer's logprobs after waking equal the engine's (R3, float32): params restored exactly
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 1e-3
    report = tmp_path / "report.json"
    smi = tmp_path / "nvidia_smi.csv"  # the GPU script's sampler format: time, pid, MiB, process title
    smi.write_text("1.0,7,512,ray::TrainerActor.sleep\n2.0,7,40960,ray::TrainerActor.train_step\n2.0,8,9216,"
                   "ray::EngineActor.call\n")
    q = subprocess.run([sys.executable, "benchmarks/colocated_report.py", str(out), "--json", str(report),
                        "--smi", str(smi)], env=env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr
    data = json.loads(report.read_text())
    assert [s["step"] for s in data["steps"]] == [0, 1]
    assert data["summary"]["trainer_offloaded_gib"] == max(r["memory/trainer_offloaded_gib"] for r in rows[1:])
    assert "| step |" in q.stdout and "trainer memory while asleep" in q.stdout
    assert data["nvidia_smi"]["trainer"] == {"min_gib": 0.5, "max_gib": 40.0, "samples": 2}
    assert data["nvidia_smi"]["engine"]["max_gib"] == 9.0
