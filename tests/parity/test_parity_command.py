"""`beamrl parity` end to end with the real SGLang CPU engine (float32) and its user errors."""

import json

import pytest
import torch

from beamrl.cli import main


def test_missing_checkpoint_exits_2(tmp_path, capsys):
    assert main(["parity", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_malformed_checkpoint_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert main(["parity", "--checkpoint", str(tmp_path)]) == 2
    assert "malformed checkpoint" in capsys.readouterr().err


def test_checkpoint_without_weights_exits_2(tmp_path, capsys):
    from beamrl.models.beam import preset

    preset("tiny").save(tmp_path)
    assert main(["parity", "--checkpoint", str(tmp_path)]) == 2
    assert "malformed checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_float32_parity_on_tiny_checkpoint(tmp_path, capsys):
    from beamrl.parity.checkpoints import write_variant

    ckpt = write_variant("tiny", tmp_path / "ckpt", torch.bfloat16)
    out = tmp_path / "parity.json"
    rc = main(["parity", "--checkpoint", str(ckpt), "--dtype", "float32", "--json", str(out),
               "--num-sequences", "4", "--seq-len", "32", "--seed", "3"])
    assert rc == 0
    (row,) = json.loads(out.read_text())["comparisons"]
    assert row["a"] == "reference" and row["b"] == "sglang" and row["dtype"] == "float32"
    assert row["tokens"] == 4 * 31
    assert row["max_abs_logprob_diff"] <= 1e-4
    assert row["routing_agreement"] >= 0.995
    assert "reference" in capsys.readouterr().out
