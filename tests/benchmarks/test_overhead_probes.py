"""Smoke runs of the issue-14 probes: the reference model's forward by length (the TRL-Beam peer's uncached
generation), `generate`'s time on captured requests, and the refusals without the captures they replay."""

import dataclasses
import pickle

import pytest

from benchmarks import adam_fused_ab, alternating_loop, generate_time, hybrid_probe, reference_forward


def test_reference_forward_prints_one_row_per_length(capsys):
    assert reference_forward.main(["--batch", "4", "--lengths", "1", "3", "--repeats", "1"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"]
    assert all(float(r.split("|")[2]) > 0 for r in rows)


def test_hybrid_probe_without_captures_says_what_to_run_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        hybrid_probe.main(["--capture", str(tmp_path)])
    assert "run benchmarks/profile_step.py first" in capsys.readouterr().err


def test_generate_time_runs_the_captured_requests_and_prints_their_digest(tmp_path, capsys):
    import torch

    from beamrl.models.beam import BeamForCausalLM, preset
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.protocols.rollout import GenerateRequest, SamplingParams

    cfg = dataclasses.replace(preset("tiny"), dtype="float32")
    save_checkpoint(cfg, BeamForCausalLM(cfg, dtype=torch.float32, seed=3).state_dict(),
                    tmp_path / "run" / "sft_checkpoint")
    groups = [[GenerateRequest(prompt_ids=p, return_routed_experts=True,
                               sampling=SamplingParams(max_new_tokens=3, seed=10 * g + i)) for i in range(4)]
              for g, p in enumerate(([5, 9, 33], [7, 1]))]
    (tmp_path / "capture").mkdir()
    (tmp_path / "capture" / "generate_requests.pkl").write_bytes(pickle.dumps(groups))
    args = ["--capture", str(tmp_path), "--repeats", "1", "--rounds", "2"]
    assert generate_time.main(args) == 0
    first = capsys.readouterr().out
    assert "8 requests, 2 distinct prompts" in first
    assert generate_time.main(args) == 0  # same weights and seeds: the same outputs
    digest = [ln for ln in first.splitlines() if ln.startswith("outputs:")]
    assert len(digest) == 1 and digest[0] in capsys.readouterr().out


def test_generate_time_without_captures_says_what_to_run_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        generate_time.main(["--capture", str(tmp_path)])
    assert "run benchmarks/profile_step.py first" in capsys.readouterr().err


def test_alternating_loop_without_captures_says_what_to_run_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        alternating_loop.main(["--capture", str(tmp_path)])
    assert "run benchmarks/profile_step.py first" in capsys.readouterr().err


def test_adam_fused_ab_without_captures_says_what_to_run_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        adam_fused_ab.main(["--capture", str(tmp_path)])
    assert "run benchmarks/profile_step.py first" in capsys.readouterr().err
