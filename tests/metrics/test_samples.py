"""Sampled completions (`logging.samples`): when they are shown, what the console shows, and samples.jsonl."""

import io
import json

from beamrl.metrics.samples import CONSOLE_CHARS, CompletionSample, SampleLog, format_samples, samples_due


def _sample(step, completion="8", reward=1.0, finish="stop"):
    return CompletionSample(step=step, prompt="3+5=", completion=completion, ground_truth="8", reward=reward,
                            advantage=0.5, response_len=2, finish_reason=finish)


def test_samples_are_due_at_the_first_step_every_n_steps_and_the_last():
    assert [s for s in range(25) if samples_due(s, 10, 25)] == [0, 9, 19, 24]
    assert [s for s in range(3) if samples_due(s, 10, 3)] == [0, 2]
    assert not any(samples_due(s, 0, 25) for s in range(25))


def test_console_lines_show_reward_prompt_completion_and_answer():
    long = "x" * 500 + "\n"
    lines = format_samples([_sample(9), _sample(9, completion=long, reward=0.0, finish="length")], num_steps=100)
    assert lines[0].startswith("samples of step 10/100")
    assert lines[1] == '    1.000 | "3+5=" -> "8" | "8"'
    assert lines[2].startswith('    0.000 | "3+5=" -> "xxx') and lines[2].endswith("[cut at max_new_tokens]")
    assert len(lines[2]) < 2 * CONSOLE_CHARS  # a long completion is cut on the console


def test_sample_log_appends_every_sample_whole_to_samples_jsonl(tmp_path):
    out = io.StringIO()
    log = SampleLog(tmp_path, console=True, num_steps=2, stream=out)
    log.log([_sample(0), _sample(0, completion="a\nb" * 200)])
    log.close()
    log = SampleLog(tmp_path, console=False)  # a resumed run appends
    log.log([_sample(1)])
    log.close()
    rows = [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 1]
    assert rows[1]["completion"] == "a\nb" * 200 and rows[0]["reward"] == 1.0 and rows[0]["advantage"] == 0.5
    assert out.getvalue().count("\n") == 3  # header + 2 samples; the second log was not on the console
