"""`beamrl train --dry-run` through the real CLI parser."""

import pytest

from beamrl.cli import main



def test_dry_run_grpo_dapo_math_passes(capsys):
    assert main(["train", "recipes/grpo_dapo_math.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "TP8 x PP1 x DP8 (SP)" in out and "EP64 x ETP1" in out and "2 x sglang engine(s) of TP16" in out
    assert "dry-run: OK" in out


def test_dry_run_grpo_dapo_math_b200_passes(capsys):
    """The same job sized for B200: four single-node TP8 engines, the optimizer state on the GPU, within capacity."""
    assert main(["train", "recipes/grpo_dapo_math_b200.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "12 node(s) x 8 B200 = 96 GPUs" in out and "4 x sglang engine(s) of TP8 = 32 GPUs" in out
    assert "optimizer 87.6 GiB" in out and "per B200" in out and "dry-run: OK" in out
    for k, node in enumerate(range(8, 12)):  # one whole node per engine, no multi-node engine
        assert f"node {node} GPUs 0-7: engine sglang-{k} TP ranks 0-7, weight-sync ranks {1 + 8 * k}-{8 + 8 * k}" in out
    assert "node rank" not in out


def test_dry_run_quickstart_passes(capsys):
    assert main(["train", "quickstart", "--dry-run"]) == 0
    assert "capacity: not checked on cluster.device=cpu" in capsys.readouterr().out


def test_dry_run_flags_memory(capsys):
    assert main(["train", "grpo_dapo_math", "--dry-run", "trainer.optimizer_offload_fraction=0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: trainer: stage 0 needs" in out


def test_dry_run_missing_reward_module(capsys):
    assert main(["train", "quickstart", "--dry-run", "rewards.0.fn=beamrl_no_such_pkg.mod:f"]) == 1
    assert "No module named 'beamrl_no_such_pkg'" in capsys.readouterr().out


def test_bad_override_exit_code_and_message(capsys):
    assert main(["train", "quickstart", "--dry-run", "trainer.learning_rate=1"]) == 2
    err = capsys.readouterr().err
    assert "trainer.learning_rate" in err and "'lr'" in err


def test_non_dry_run_calls_the_loop_or_says_it_is_missing(monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("beamrl.loop")
    fake.run_training = lambda recipe, resume: calls.append((recipe.run.name, resume)) or "outputs/run-dir"
    monkeypatch.setitem(sys.modules, "beamrl.loop", fake)
    assert main(["train", "quickstart", "--resume"]) == 0
    assert calls == [("quickstart-addition", True)]
    monkeypatch.setitem(sys.modules, "beamrl.loop", None)  # import of beamrl.loop fails
    with pytest.raises(NotImplementedError, match="run_training"):
        main(["train", "quickstart"])


def test_dry_run_needs_a_readable_model(capsys):
    assert main(["train", "grpo_dapo_math", "--dry-run", "model.preset=null"]) == 2
    assert "model.checkpoint" in capsys.readouterr().err


def test_a_run_with_a_missing_checkpoint_names_it_and_writes_nothing(capsys, tmp_path):
    # grpo_dapo_math points at /checkpoints/beam-501b, which --dry-run may plan without but a run must load
    out = tmp_path / "run"
    assert main(["train", "grpo_dapo_math", f"run.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "model.checkpoint='/checkpoints/beam-501b'" in err and "config.json" in err
    assert not out.exists()
