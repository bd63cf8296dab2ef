"""`beamrl bench sync` performs a real sync of perturbed weights into the native engine (in its own process) through
the training orchestrator, verifies it, and reports it."""

import json

import pytest
import torch

from beamrl.cli import main
from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.sync.orchestrator import WeightSync
from beamrl.sync.packing import pack_bucket

KEYS = ["engine", "transport", "dtype", "bytes", "seconds", "gbps", "verified", "check",
        "max_abs_logprob_diff_after_sync", "code_path"]
# What `beamrl train` runs too (tests/loop/test_e2e_native.py holds the training side to the same string).
TRAINING_CODE_PATH = (f"{WeightSync.__module__}.{WeightSync.__qualname__} + "
                      f"{pack_bucket.__module__}.{pack_bucket.__qualname__}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-ckpt")
    BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=3).save_pretrained(out)
    return out


def _bench(checkpoint, out, transport, dtype):
    return main(["bench", "sync", "--checkpoint", str(checkpoint), "--engine", "native", "--transport", transport,
                 "--dtype", dtype, "--json", str(out), "--bucket-mb", "0.25", "--device", "cpu", "--timeout", "120"])


def test_bench_sync_native_distributed_float32_verifies_to_1e4_and_writes_exact_json(checkpoint, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = _bench(checkpoint, out, "distributed", "float32")
    result = json.loads(out.read_text())
    assert rc == 0
    assert list(result) == KEYS
    assert result["engine"] == "native" and result["transport"] == "distributed" and result["dtype"] == "float32"
    model_bytes = sum(p.numel() * p.element_size() for p in BeamForCausalLM(preset("tiny"), torch.float32).parameters())
    assert result["bytes"] == model_bytes
    assert result["verified"] is True and result["max_abs_logprob_diff_after_sync"] <= 1e-4
    assert result["check"].startswith("probe logprobs vs the reference model <= 0.0001")
    assert result["seconds"] > 0 and result["gbps"] == pytest.approx(result["bytes"] / result["seconds"] / 1e9)
    assert result["code_path"] == TRAINING_CODE_PATH  # the training orchestrator and packing function ran
    # the perturbation was visible before the sync (otherwise the check proves nothing)
    before = float(capsys.readouterr().err.split("before sync ")[1].split(",")[0])
    assert before > 1e-2


def test_bench_sync_native_colocated_bfloat16_agrees_exactly_with_a_freshly_loaded_engine(checkpoint, tmp_path):
    out = tmp_path / "result.json"
    assert _bench(checkpoint, out, "colocated", "bfloat16") == 0
    result = json.loads(out.read_text())
    assert result["verified"] is True and result["max_abs_logprob_diff_after_sync"] == 0.0
    assert result["check"] == "bit-exact vs the engine loaded from a checkpoint"
    assert result["code_path"] == TRAINING_CODE_PATH


def test_bench_sync_refuses_a_directory_without_config(tmp_path, capsys):
    rc = main(["bench", "sync", "--checkpoint", str(tmp_path), "--engine", "native", "--transport", "colocated"])
    assert rc == 2 and "no config.json" in capsys.readouterr().out
