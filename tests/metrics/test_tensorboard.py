from beamrl.metrics.tensorboard import TensorBoardLogger


def test_values_read_back_exactly(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = [0.1, 1 / 3, 2.5e-7, 12345.678]
    lg = TensorBoardLogger(tmp_path / "tb")
    for step, v in enumerate(values):
        lg.log(step, {"reward/mean": v, "loss": -v})
    lg.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    import numpy as np

    got = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    assert got == [(s, float(np.float32(v))) for s, v in enumerate(values)]  # TB stores float32
    assert [e.value for e in acc.Scalars("loss")] == [float(np.float32(-v)) for v in values]


def test_a_resumed_run_hides_what_the_earlier_attempt_logged_from_its_first_step_on(tmp_path):
    """A run that crashed after step 4 and resumes from its step-2 checkpoint logs steps 2.. again: TensorBoard must
    show those values once, not the crashed attempt's as well (metrics.jsonl is cut back to the checkpoint)."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardLogger(tmp_path / "tb")
    for step in range(5):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    time.sleep(1.1)  # event files are named by the second they were opened in
    resumed = TensorBoardLogger(tmp_path / "tb")
    for step in (2, 3):
        resumed.log(step, {"reward/mean": 10.0 + step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
