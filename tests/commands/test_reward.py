import json
import subprocess
import sys
from pathlib import Path

import pytest

from beamrl.cli import main

DAPO_ROWS = [  # DAPO-Math-17k layout plus a completion
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "1/2 as a decimal?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "0.5", "style": "rule-lang"},
        "extra_info": {"index": "a"},
        "completion": "So the answer is \\boxed{\\frac12}.",
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"ground_truth": "4"},
        "completion": "Answer: 5",
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "3+3?"}],
        "reward_model": {"ground_truth": "6"},
        "completion": "Answer: 6",
    },
]


def write_jsonl(path, rows, extra_lines=()):
    path.write_text("\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n")
    return path


def test_reward_test_on_dapo_rows(tmp_path, capsys):
    data = write_jsonl(tmp_path / "dapo.jsonl", DAPO_ROWS)
    rc = main(["reward", "test", "dapo_math", "--data", str(data), "--kwarg", "incorrect_score=-1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[2] for row in lines[:3]] == ["1.0000", "-1.0000", "1.0000"]
    assert "rows 3, scored 3" in out and "errors 0, timeouts 0, crashes 0, skipped 0; mean score 0.3333" in out


def test_reward_test_counts_failures_and_continues(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_cli_plugin.py").write_text(
        "def picky(completion, metadata):\n"
        "    if completion == 'boom':\n"
        "        raise RuntimeError('no boom please')\n"
        "    return float(metadata['bonus'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned workers inherit sys.path
    rows = [{"completion": "fine", "bonus": 2}, {"completion": "boom", "bonus": 1}, {"completion": "ok", "bonus": 3}]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    rc = main(["reward", "test", "my_cli_plugin:picky", "--data", str(data), "--limit", "3"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "errors 1" in captured.out and "mean score 2.5000" in captured.out
    assert "no boom please" in captured.out and "RuntimeError" in captured.err


def test_reward_test_breaker_skips_the_rest_after_consecutive_timeouts(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_stuck_plugin.py").write_text("import time\n\ndef stuck(completion):\n    time.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_jsonl(tmp_path / "rows.jsonl", [{"completion": str(i)} for i in range(6)])
    rc = main(["reward", "test", "my_stuck_plugin:stuck", "--data", str(data), "--timeout", "1", "--workers", "2",
               "--breaker-after", "2"])
    captured = capsys.readouterr()
    assert rc == 1
    # both workers time out together, the breaker trips, the other 4 rows are skipped (not 4 more seconds)
    assert "errors 0, timeouts 2, crashes 0, skipped 4" in captured.out
    assert "circuit breaker tripped after 2" in captured.err and "did not return within 1 s" in captured.err


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda d: ["exact_match", "--data", str(d / "missing.jsonl")], "does not exist"),
        (lambda d: ["exact_match", "--data", str(d / "bad.jsonl")], "bad.jsonl line 3: invalid JSON"),
        (
            lambda d: ["exact_match", "--data", str(d / "nogt.jsonl")],
            "line 1: the reward function needs field 'ground_truth'",
        ),
        (
            lambda d: ["exact_match", "--data", str(d / "ok.jsonl"), "--field-map", "answer=x"],
            "unknown field(s) ['answer']",
        ),
        (
            lambda d: ["exact_match", "--data", str(d / "ok.jsonl"), "--field-map", "completion"],
            "must look like NAME=VALUE",
        ),
        (lambda d: ["no_such_mod_q:fn", "--data", str(d / "ok.jsonl")], "cannot import module 'no_such_mod_q'"),
        (lambda d: ["exact_match", "--data", str(d / "ok.jsonl"), "--limit", "0"], "--limit 0 must be >= 1"),
        (lambda d: ["exact_match", "--data", str(d / "ok.jsonl"), "--timeout", "0"], "--timeout: Input should be"),
        (lambda d: ["exact_match", "--data", str(d / "ok.jsonl"), "--breaker-after", "-1"], "--breaker-after: Input"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, make_args, message):
    write_jsonl(tmp_path / "ok.jsonl", [{"completion": "1", "ground_truth": "1"}])
    write_jsonl(tmp_path / "bad.jsonl", [{"completion": "1", "ground_truth": "1"}] * 2, ["{not json"])
    write_jsonl(tmp_path / "nogt.jsonl", [{"completion": "1"}])
    rc = main(["reward", "test", *make_args(tmp_path)])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_console_script_with_field_map_and_a_plugin_in_the_cwd(tmp_path):
    (tmp_path / "cwd_plugin.py").write_text(
        "def same(completion, ground_truth):\n    return float(completion.strip() == ground_truth)\n"
    )
    rows = [{"response": " 7 ", "answer": {"value": "7"}}, {"response": "8", "answer": {"value": "9"}}]
    data = write_jsonl(tmp_path / "add.jsonl", rows)
    beamrl = Path(sys.executable).parent / "beamrl"  # the installed console script
    proc = subprocess.run(
        [
            str(beamrl),
            "reward",
            "test",
            "cwd_plugin:same",
            "--data",
            str(data),
            "--field-map",
            "ground_truth=answer.value",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "rows 2, scored 2" in proc.stdout and "mean score 0.5000" in proc.stdout
