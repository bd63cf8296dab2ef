"""The checkpoint log's "the step waited" counts everything `save` held the step for, the wait for the previous
save's completion included (an async save every few steps can spend most of its step there)."""

from pathlib import Path

from beamrl.trainer.megatron.checkpoint.checkpointer import _describe_costs, step_waited_s


def _costs(is_async: bool, previous: float) -> dict:
    c = {"async": is_async, "previous_save_wait_s": previous, "blocking_s": 0.5, "total_s": 4.0, "state_s": 0.1,
         "stage_s": 0.3, "staged_from_device_bytes": 0, "plan_s": 0.1, "bytes": 2e9, "data_files": 4,
         "write_wall_s": 2.0, "fsync_thread_s": 0.2, "publish_s": 0.1}
    c["step_waited_s"] = step_waited_s(c)
    return c


def test_the_wait_for_the_previous_save_is_part_of_what_the_step_waited():
    assert step_waited_s(_costs(True, 0.0)) == 0.5 and step_waited_s(_costs(True, 3.0)) == 3.5
    assert step_waited_s(_costs(False, 3.0)) == 7.0
    line = _describe_costs(Path("/ck/step_10"), _costs(True, 3.0))
    assert "the step waited 3.5 s, 3.0 s of it for the previous save to complete" in line
    assert "previous save" not in _describe_costs(Path("/ck/step_10"), _costs(True, 0.0))
