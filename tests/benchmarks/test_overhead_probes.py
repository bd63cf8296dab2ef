"""Smoke runs of the two issue-14 probes: the reference model's forward by length (the TRL-Beam peer's uncached
generation), and the hybrid-layout probe's refusal without the captures it replays."""

import pytest

from benchmarks import hybrid_probe, reference_forward


def test_reference_forward_prints_one_row_per_length(capsys):
    assert reference_forward.main(["--batch", "4", "--lengths", "1", "3", "--repeats", "1"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"]
    assert all(float(r.split("|")[2]) > 0 for r in rows)


def test_hybrid_probe_without_captures_says_what_to_run_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        hybrid_probe.main(["--capture", str(tmp_path)])
    assert "run benchmarks/profile_step.py first" in capsys.readouterr().err
