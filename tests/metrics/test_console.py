import io

from beamrl.metrics.console import ConsoleLogger


def test_console_line():
    buf = io.StringIO()
    c = ConsoleLogger(num_steps=300, stream=buf)
    c.log(12, {"reward/mean": 0.5126, "response_length/mean": 811.6, "time/rollout_s": 41.23,
               "time/train_s": 30.06, "throughput/tokens_per_s": 9870.2, "other": 1.0})
    assert buf.getvalue() == "step 12/300 | reward 0.513 | len 812 | rollout 41.2s train 30.1s | 9,870 tok/s\n"
