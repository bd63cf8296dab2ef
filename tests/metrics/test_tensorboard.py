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
