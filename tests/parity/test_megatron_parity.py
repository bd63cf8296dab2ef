"""`beamrl parity --trainer megatron`: a real 2-process Megatron run scores the prompts like the reference model."""

import json

import pytest

from beamrl.cli import main


def test_engine_none_needs_a_trainer(tmp_path, capsys):
    from beamrl.parity.checkpoints import write_variant

    ckpt = write_variant("tiny", tmp_path / "ckpt")
    assert main(["parity", "--checkpoint", str(ckpt), "--engine", "none"]) == 2
    assert "--engine none needs --trainer megatron" in capsys.readouterr().err


def test_a_layout_the_model_cannot_take_exits_2_before_spawning(tmp_path, capsys):
    from beamrl.parity.checkpoints import write_variant

    ckpt = write_variant("tiny", tmp_path / "ckpt")
    assert main(["parity", "--checkpoint", str(ckpt), "--trainer", "megatron", "--engine", "none", "--tp", "2"]) == 2
    assert "sp=False: a MoE model with tp > 1 requires sp: true" in capsys.readouterr().err


@pytest.mark.slow
def test_megatron_ep2_matches_reference_in_float32(tmp_path):
    from beamrl.parity.checkpoints import write_variant

    ckpt = write_variant("tiny", tmp_path / "ckpt")
    out = tmp_path / "parity.json"
    rc = main(["parity", "--checkpoint", str(ckpt), "--trainer", "megatron", "--engine", "none", "--ep", "2",
               "--dtype", "float32", "--num-sequences", "3", "--seq-len", "24", "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["comparisons"]
    assert row["a"] == "megatron" and row["b"] == "reference" and row["dtype"] == "float32"
    assert row["tokens"] == 3 * 23
    assert row["mean_abs_logprob_diff"] < 1e-5 and row["max_abs_logprob_diff"] < 1e-4
    assert row["routing_agreement"] == 1.0
