"""`beamrl train --dry-run` through the real CLI parser: layouts, and the start-up checks a real run makes first
(tokenizer, data source, rewards, checkpoint tensors), each failure one line naming the field, exit 2."""

import json

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


def test_dry_run_misspelt_reward_module_is_one_line_naming_the_field(capsys):
    assert main(["train", "quickstart", "--dry-run", "rewards.0.fn=beamrl_no_such_pkg.mod:f"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("beamrl train: rewards[0].fn='beamrl_no_such_pkg.mod:f'") and "\n" not in err
    assert "No module named 'beamrl_no_such_pkg'" in err


def test_dry_run_names_max_concurrency_of_a_sync_reward_function(capsys):
    """A sync function runs one call per worker: max_concurrency would be ignored (it was, silently)."""
    assert main(["train", "quickstart", "--dry-run", "rewards.0.max_concurrency=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("beamrl train: rewards[0].max_concurrency=8") and "num_workers" in err


def test_bad_override_exit_code_and_message(capsys):
    assert main(["train", "quickstart", "--dry-run", "trainer.learning_rate=1"]) == 2
    err = capsys.readouterr().err
    assert "trainer.learning_rate" in err and "'lr'" in err


def test_non_dry_run_calls_the_loop_or_says_it_is_missing(monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("beamrl.loop")
    fake.run_training = lambda recipe, **flags: calls.append((recipe.run.name, flags)) or "outputs/run-dir"
    fake.TrainerRankLost = type("TrainerRankLost", (RuntimeError,), {})
    monkeypatch.setitem(sys.modules, "beamrl.loop", fake)
    assert main(["train", "quickstart", "--resume"]) == 0
    assert main(["train", "quickstart", "--overwrite", "--verbose"]) == 0
    assert calls == [("quickstart-addition", dict(resume=True, overwrite=False, verbose=False)),
                     ("quickstart-addition", dict(resume=False, overwrite=True, verbose=True))]
    with pytest.raises(SystemExit):  # continue the run, or delete it: not both
        main(["train", "quickstart", "--resume", "--overwrite"])
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


# ------------------------------------------------------------------- real data: tokenizers, checked by --dry-run
DAPO_ROWS = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
              "ability": "MATH", "reward_model": {"ground_truth": str(a + b), "style": "rule"}} for a, b in
             ((2, 3), (4, 4), (1, 7))]


@pytest.fixture(scope="module")
def real_data(tmp_path_factory):
    """A DAPO-schema file, a tiny checkpoint from init-checkpoint without a tokenizer and one with the byte
    tokenizer beside it, and an HF tokenizer directory without a chat template."""
    from beamrl.data.byte_tokenizer import byte_tokenizer

    root = tmp_path_factory.mktemp("real-data")
    (root / "dapo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DAPO_ROWS))
    assert main(["init-checkpoint", "--preset", "tiny", "--out", str(root / "bare"), "--dtype", "float32"]) == 0
    assert main(["init-checkpoint", "--preset", "tiny", "--out", str(root / "with-tok"), "--dtype", "float32",
                 "--tokenizer", "byte"]) == 0
    byte_tokenizer(chat_template=False).save_pretrained(root / "no-template")
    return root


def _dapo(root, *overrides):
    """The quickstart turned into a DAPO-schema run on `root`'s data (overrides choose model and tokenizer)."""
    return ["train", "quickstart", "--dry-run", "data.format=dapo", f"data.source={root / 'dapo.jsonl'}",
            "data.synthetic=null", "data.max_prompt_len=64", "model.config_overrides={}", *overrides]


def _from_checkpoint(path):
    return ["model.preset=null", "model.seed=null", f"model.checkpoint={path}"]


PRESET = ["model.preset=tiny", "model.seed=0"]


@pytest.mark.parametrize("overrides, field, says", [
    # a DAPO recipe without data.tokenizer on a random-init model: nothing to take a tokenizer from
    (lambda d: [*PRESET, "data.tokenizer=null"], "data.tokenizer=None", "'byte'"),
    # init-checkpoint's checkpoint carries no tokenizer: named as such, not a sentencepiece traceback
    (lambda d: [*_from_checkpoint(d / "bare"), "data.tokenizer=null"], "data.tokenizer=None",
     "init-checkpoint --tokenizer"),
    # a tokenizer larger than the model's vocabulary, with the override that fixes it
    (lambda d: [*PRESET, "data.tokenizer=byte", "model.config_overrides.vocab_size=200"], "data.tokenizer='byte'",
     "model.config_overrides.vocab_size: 259"),
    # chat_template: true with a tokenizer that has none
    (lambda d: [*PRESET, f"data.tokenizer={d / 'no-template'}", "data.chat_template=true"],
     "data.chat_template=True", "has no chat template"),
    # an eos id that differs from the model's
    (lambda d: [*PRESET, "data.tokenizer=byte", "model.config_overrides.eos_token_id=5"], "data.tokenizer='byte'",
     "eos id 0 differs from the model's eos_token_id 5"),
], ids=["no-tokenizer-random-init", "checkpoint-without-tokenizer", "vocab-too-small", "no-chat-template",
        "eos-differs"])
def test_dry_run_catches_each_tokenizer_problem_by_field(real_data, capsys, overrides, field, says):
    assert main(_dapo(real_data, *overrides(real_data))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"beamrl train: {field}") and says in err, err
    assert "\n" not in err and "sentencepiece" not in err.lower()


def test_dry_run_names_a_split_that_a_local_source_would_ignore(real_data, capsys):
    """Local files load as one split: data.split: test on them trained on whatever the files held."""
    assert main(_dapo(real_data, *PRESET, "data.tokenizer=byte", "data.split=test")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("beamrl train: data.split='test'") and "one split" in err, err


def test_dry_run_accepts_real_data_with_a_tokenizer_beside_the_checkpoint(real_data, capsys):
    assert main(_dapo(real_data, *_from_checkpoint(real_data / "with-tok"), "data.tokenizer=null",
                      "data.chat_template=true")) == 0
    out = capsys.readouterr().out
    assert "model.checkpoint: 686,952 parameters, every tensor's name, shape and dtype OK" in out
    assert f"data.tokenizer: '{real_data / 'with-tok'}': 259 tokens (model vocab_size 512), eos 0, chat template" \
        in out and "dry-run: OK" in out


def test_dry_run_names_a_missing_data_file_and_a_missing_checkpoint_tensor(real_data, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(_dapo(real_data, *PRESET, "data.tokenizer=byte", f"data.source={missing}")) == 2
    assert capsys.readouterr().err.strip() == (f"beamrl train: data.source='{missing}': no such file or directory: "
                                               f"{missing}")
    from safetensors.torch import load_file, save_file
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(real_data / "with-tok", broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.gate.weight"]
    save_file(tensors, broken / "model.safetensors")
    assert main(_dapo(real_data, *_from_checkpoint(broken), "data.tokenizer=null")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"beamrl train: model.checkpoint='{broken}': tensor 'model.layers.1.mlp.gate.weight' "
                          "missing") and "\n" not in err
