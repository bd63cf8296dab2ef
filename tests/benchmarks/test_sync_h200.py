"""The H200 weight-sync benchmark runs end to end on CPU (`--device cpu`: tiny preset, shared memory / gloo) through
the training orchestrator, with the receiver in its own process, every byte arriving and checksums equal after
every sync.

`--mode distributed` and `--mode teardown` with these arguments are also the `sync` and `teardown` stages of the
two-GPU script's smoke run (tests/benchmarks/conftest.py: `two_gpu_smoke`): those two are checked on that run's
outputs (its command is checked to be this one), the other modes run here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.weights import expected_tensors

ROOT = Path(__file__).resolve().parents[2]


SCRIPT = str(ROOT / "benchmarks" / "sync_h200.py")
# The smoke arguments of each check (after --mode <mode>); the two-GPU smoke run uses the same ones.
MOVE_ARGS = ["--device", "cpu", "--repeats", "1", "--bucket-mb", "0.0625,2"]
TEARDOWN_ARGS = ["--device", "cpu", "--cycles", "3"]
# Modes whose run is a stage of the two-GPU smoke run: mode -> (stage, its --json file)
IN_TWO_GPU_SMOKE = {"distributed": ("sync", "sync_distributed.json"), "teardown": ("teardown", "sync_teardown.json")}


def _smoke_run(mode: str, args: list[str], tmp_path: Path, request) -> tuple[dict, str]:
    """The JSON result and the console output (stdout and stderr) of `sync_h200.py --mode <mode> <args>`: the
    two-GPU smoke run's stage where it ran this command, else a run of its own."""
    if mode in IN_TWO_GPU_SMOKE:
        stage, file = IN_TWO_GPU_SMOKE[mode]
        smoke = request.getfixturevalue("two_gpu_smoke")
        entry, log = smoke.stage(stage)
        command = entry["command"][1:]
        i = command.index("--json")
        assert command[:i] + command[i + 2:] == [SCRIPT, "--mode", mode, *args], command  # the same run
        return json.loads((smoke.out / file).read_text()), log
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, SCRIPT, "--mode", mode, *args, "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout + p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode, transport_mode", [("colocated", "staged"), ("per_rank", "per_rank"),
                                                  ("distributed", "distributed")])
def test_cpu_smoke_run_moves_every_byte(tmp_path, request, mode, transport_mode):
    result, console = _smoke_run(mode, MOVE_ARGS, tmp_path, request)
    rows = result["rows"]
    specs = expected_tensors(preset("tiny")).values()  # the tiny state dict in bf16 (router weight/bias FP32)
    total = sum(torch.Size(s.shape).numel() * (4 if s.fp32 else 2) for s in specs)
    assert [(r["mode"], r["bucket_mib"]) for r in rows] == [(mode, 0.0625), (mode, 2.0)]
    for r in rows:
        assert r["checksums_equal_every_sync"] is True and r["bytes"] == total  # every tensor, bit for bit
        assert r["transport_mode"] == transport_mode
        assert r["seconds_best"] > 0 and r["gbps_best"] == pytest.approx(r["bytes"] / r["seconds_best"] / 1e9)
        assert r["code_path"] == "beamrl.sync.orchestrator.WeightSync + beamrl.sync.packing.pack_bucket"
    assert rows[0]["buckets"] > rows[1]["buckets"] == 1  # 64 KiB buckets split the 1.4 MB; 2 MiB holds it all
    if mode == "distributed":  # issue 12: raw broadcasts of the same bytes in the same bucket sizes, same run
        for r in rows:
            assert (r["raw_broadcast_bytes"], r["raw_broadcast_broadcasts"]) == (r["bytes"], r["buckets"])
            fraction = r["gbps_best"] / r["raw_broadcast_same_bytes_gbps"]
            assert r["sync_fraction_of_raw_broadcast"] == pytest.approx(fraction)
        assert "| sync / it |" in console
    refs = {"colocated": ["d2d_copy_gbps"], "per_rank": ["d2d_copy_gbps"],
            "distributed": ["raw_broadcast_gbps", "peer_copy_gbps"]}[mode]
    assert list(result["references"]) == refs and all(result["references"][k] > 0 for k in refs)
    assert "checksums equal after 2 syncs" in console and "| sync / reference |" in console


@pytest.mark.slow
def test_cpu_smoke_teardown_cycles(tmp_path, request):
    """`--mode teardown`: open (fresh update group), sync, close, timed per cycle, checksums equal every cycle."""
    result, console = _smoke_run("teardown", TEARDOWN_ARGS, tmp_path, request)
    assert result["error"] is None and [c["cycle"] for c in result["cycles"]] == [0, 1, 2]
    assert all(c["checksums_equal"] and c["buckets"] > 1 and 0 < c["close_s"] < 20 for c in result["cycles"])
    assert result["max_close_s"] == max(c["close_s"] for c in result["cycles"])
    assert "close: max" in console
