"""`beamrl bench sync` performs a real sync of perturbed weights into the native engine and reports it."""

import json

import pytest
import torch

from beamrl.cli import main
from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-ckpt")
    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=3).save_pretrained(out)
    return out


def test_bench_sync_native_distributed_writes_exact_json(checkpoint, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = main(["bench", "sync", "--checkpoint", str(checkpoint), "--engine", "native", "--transport",
               "distributed", "--json", str(out), "--bucket-mb", "0.25", "--device", "cpu", "--timeout", "120"])
    result = json.loads(out.read_text())
    assert rc == 0
    assert list(result) == ["engine", "transport", "bytes", "seconds", "gbps", "verified",
                            "max_abs_logprob_diff_after_sync"]
    assert result["engine"] == "native" and result["transport"] == "distributed"
    model_bytes = sum(p.numel() * p.element_size() for p in BeamForCausalLM(preset("tiny"), torch.float32).parameters())
    assert result["bytes"] == model_bytes
    assert result["verified"] is True and result["max_abs_logprob_diff_after_sync"] <= 1e-4
    assert result["seconds"] > 0 and result["gbps"] == pytest.approx(result["bytes"] / result["seconds"] / 1e9)
    # the perturbation was visible before the sync (otherwise the check proves nothing)
    before = float(capsys.readouterr().err.split("before sync ")[1].split(",")[0])
    assert before > 1e-2


def test_bench_sync_refuses_a_directory_without_config(tmp_path, capsys):
    rc = main(["bench", "sync", "--checkpoint", str(tmp_path), "--engine", "native", "--transport", "colocated"])
    assert rc == 2 and "no config.json" in capsys.readouterr().out
