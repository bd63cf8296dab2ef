"""The SFT warm start's export is reused on resume only when whole: it is written under `.partial` and renamed
into place (a crash mid-export left a `sft_checkpoint` with config.json and missing shards, which the next
`--resume` reused: its engines and reference then started from it). The training itself runs in the e2e tests
(tests/loop/test_first_run.py resumes a run with SFT)."""

from types import SimpleNamespace

import pytest
import torch

from beamrl.loop.sft import sft_warm_start
from beamrl.models.beam import preset
from beamrl.models.beam.checkpoint import save_checkpoint
from beamrl.models.beam.weights import random_state_dict


def _run(tmp_path):
    return SimpleNamespace(recipe=SimpleNamespace(sft=SimpleNamespace(steps=1, batch=1, lr=1e-3)), out_dir=tmp_path)


def test_a_whole_export_is_reused(tmp_path):
    config = preset("tiny").replace(dtype="float32")
    save_checkpoint(config, random_state_dict(config, 0, torch.float32), tmp_path / "sft_checkpoint")
    assert sft_warm_start(_run(tmp_path)) == str(tmp_path / "sft_checkpoint")


def test_an_export_cut_short_is_named_not_reused(tmp_path):
    config = preset("tiny").replace(dtype="float32")
    out = tmp_path / "sft_checkpoint"
    out.mkdir()
    config.save(out)  # written first: what a crash mid-export used to leave
    with pytest.raises(RuntimeError, match="not a whole checkpoint.*delete it"):
        sft_warm_start(_run(tmp_path))


def test_sft_steps_are_cut_into_the_trainers_micro_batches():
    """`trainer.micro_batch_size` holds for the warm start too (it sent one micro-batch per DP rank, whatever the
    setting: a warm start of a large `sft.batch` took all of it in one forward)."""
    from beamrl.data.digit_tokenizer import DigitTokenizer
    from beamrl.data.sample import PromptSample
    from beamrl.loop.sft import sft_step_batches

    tok = DigitTokenizer()
    samples = [PromptSample(f"{i}+1=", tok.encode(f"{i}+1="), str(i + 1), "d") for i in range(8)]
    for micro, dp, expected in ((2, 1, 4), (64, 1, 1), (2, 2, 4), (3, 2, 2), (64, 2, 2), (1, 1, 8)):
        pbs, loss = sft_step_batches(samples, tok, dp, micro)
        assert len(pbs) == expected, (micro, dp)
        assert sum(pb.num_sequences for pb in pbs) == 8
        assert loss.total_loss_tokens == sum(pb.num_loss_tokens for pb in pbs)  # one token mean over the whole step
