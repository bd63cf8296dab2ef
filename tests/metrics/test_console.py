import io

from beamrl.metrics.console import ConsoleLogger, format_duration


def test_console_line():
    buf = io.StringIO()
    c = ConsoleLogger(num_steps=300, stream=buf)
    c.log(12, {"reward/mean": 0.5126, "response_length/mean": 811.6, "time/rollout_s": 41.23,
               "time/train_s": 30.06, "throughput/tokens_per_s": 9870.2, "other": 1.0})
    # metrics.jsonl's step 12 is the 13th step: the console counts from 1
    assert buf.getvalue() == "step 13/300 | reward 0.513 | len 812 | rollout 41.2s train 30.1s | 9,870 tok/s\n"


def test_the_console_counts_steps_from_one_to_num_steps():
    buf = io.StringIO()
    c = ConsoleLogger(num_steps=2, stream=buf)
    c.log(0, {"time/step_s": 1.0})
    c.log(1, {"time/step_s": 1.0})
    assert [ln.split(" | ")[0] for ln in buf.getvalue().splitlines()] == ["step 1/2", "step 2/2"]


def test_eta_is_the_steps_left_times_the_mean_step_time():
    buf = io.StringIO()
    c = ConsoleLogger(num_steps=10, stream=buf)
    c.log(4, {"time/step_s": 10.0})  # a resumed run: steps 0-3 were done before
    c.log(5, {"time/step_s": 20.0})
    c.log(9, {"time/step_s": 30.0})
    assert [ln.split(" | ")[-1] for ln in buf.getvalue().splitlines()] == ["ETA 50s", "ETA 1m00s", "ETA 0s"]


def test_format_duration():
    assert [format_duration(s) for s in (12.4, 245, 3725)] == ["12s", "4m05s", "1h02m"]
