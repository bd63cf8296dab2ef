"""`beamrl init-checkpoint` end to end through the CLI dispatcher."""

import json
import subprocess
import sys

import torch

from beamrl.cli import main
from beamrl.models.beam import BeamForCausalLM, preset
from beamrl.models.beam.checkpoint import load_checkpoint
from beamrl.models.beam.weights import random_state_dict


def test_init_checkpoint_writes_a_loadable_sglang_checkpoint(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["init-checkpoint", "--preset", "tiny", "--seed", "5", "--out", str(out),
                 "--expert-layout", "packed"]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors" in printed and "preset=tiny" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "beam" and config["architectures"] == ["BeamForCausalLM"]
    cfg, sd = load_checkpoint(out)
    ref = random_state_dict(preset("tiny"), seed=5, dtype=torch.bfloat16)
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    model = BeamForCausalLM.from_pretrained(out)
    assert torch.isfinite(model(torch.arange(6).unsqueeze(0)).logits).all()


def test_init_checkpoint_float32_and_refusals(tmp_path, capsys):
    out = tmp_path / "f32"
    assert main(["init-checkpoint", "--preset", "tiny", "--out", str(out), "--dtype", "float32"]) == 0
    cfg, sd = load_checkpoint(out)
    assert cfg.dtype == "float32" and sd["lm_head.weight"].dtype == torch.float32
    assert main(["init-checkpoint", "--preset", "tiny", "--out", str(out)]) == 2  # not empty
    assert "not empty" in capsys.readouterr().out
    assert main(["init-checkpoint", "--preset", "beam-501b", "--out", str(tmp_path / "big")]) == 2
    assert "--allow-large" in capsys.readouterr().out
    assert not (tmp_path / "big").exists()


def test_console_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "beamrl.cli", "init-checkpoint", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--expert-layout" in r.stdout


def test_init_checkpoint_writes_a_tokenizer_that_fits_the_model(tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "with-tok"
    assert main(["init-checkpoint", "--preset", "tiny", "--out", str(out), "--tokenizer", "byte"]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(out)  # offline, from the checkpoint directory alone
    config = json.loads((out / "config.json").read_text())
    assert len(tok) <= config["vocab_size"] and tok.eos_token_id == config["eos_token_id"]
    assert tok.decode(tok("3+5=8")["input_ids"]) == "3+5=8" and tok.chat_template
    load_checkpoint(out)  # the tokenizer files do not disturb the weights


def test_init_checkpoint_refuses_a_tokenizer_that_does_not_fit(tmp_path, capsys):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(600)}  # more tokens than tiny's vocab_size of 512
    big = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w1")),
                                  eos_token="w0")
    big.save_pretrained(tmp_path / "big-tok")
    out = tmp_path / "ckpt"
    assert main(["init-checkpoint", "--preset", "tiny", "--out", str(out), "--tokenizer",
                 str(tmp_path / "big-tok")]) == 2
    assert "600 tokens but preset vocab_size is 512" in capsys.readouterr().out
    assert not out.exists()
    assert main(["init-checkpoint", "--preset", "tiny", "--out", str(out), "--tokenizer",
                 str(tmp_path / "nowhere")]) == 2
    assert "not 'byte' and not a directory" in capsys.readouterr().out
