"""Driver side of checkpoints: when to save, publication by rename, rotation, and the checkpoint `--resume` picks
(with fallback past damaged ones). Fast: `_FakeTrainer` writes a minimal trainer checkpoint in the real format;
the e2e tests (tests/loop/test_e2e_native.py) run the same code against the real trainer group."""

from pathlib import Path

import pytest

from beamrl import manifest
from beamrl.loop.checkpoints import RunCheckpoints, pick_resume, problems, published, save_due, step_of
from beamrl.loop.run_state import load_driver_state
from beamrl.trainer.megatron.checkpoint import FORMAT, META_FILE, CheckpointDamagedError


class _FakeTrainer:
    """`TrainerGroup`'s checkpoint calls: a trainer checkpoint of one data file; async saves complete when
    `written` is set; `damaged` directories fail to load like the real trainer's digest check."""

    def __init__(self):
        self.written, self.pending, self.damaged, self.loaded = True, None, set(), []

    def save_checkpoint(self, directory, async_save, timeout_s):
        d = Path(directory)
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x" * 1000)
        meta = {"format": FORMAT, "step": 0, "adam_step": 0, "world_size": 1, "parallel": {}, "dtype": "float32",
                "model": {}, "scheduler": {}, "files": {"__0_0.distcp": manifest.file_entry(d / "__0_0.distcp")}}
        self.pending = (d, meta)
        if not async_save:
            self.finalize_checkpoint(True, timeout_s)

    def finalize_checkpoint(self, blocking, timeout_s):
        if self.pending is None or not (self.written or blocking):
            return None
        d, meta = self.pending
        manifest.write_json_atomic(d / META_FILE, meta)
        self.pending = None
        return str(d)

    def load_checkpoint(self, directory, timeout_s):
        if Path(directory).parent in self.damaged:
            raise RuntimeError("trainer.load_checkpoint failed") from CheckpointDamagedError(f"{directory}: damaged")
        self.loaded.append(Path(directory).parent)


def _run(tmp_path, steps=(1, 2, 3), keep_last=3, async_save=False):
    logs = []
    ckpts = RunCheckpoints(tmp_path / "ckpts", keep_last, async_save, 60.0, logs.append)
    trainer = _FakeTrainer()
    for s in steps:
        ckpts.save(trainer, s, weight_version=s, data_state={"index": s})
    ckpts.wait(trainer)
    return ckpts, trainer, logs


def test_save_due_every_n_steps_and_never_periodically_with_zero():
    assert [s for s in range(1, 8) if save_due(s, 3, 7)] == [3, 6]
    assert not any(save_due(s, 0, 7) for s in range(1, 8))  # 0: only the final one (written by the driver)
    assert not save_due(6, 3, 6)  # the final step is the final checkpoint's


def test_published_checkpoints_are_complete_and_rotated(tmp_path):
    ckpts, _, logs = _run(tmp_path, steps=(1, 2, 3, 4), keep_last=2)
    assert [step_of(p) for p in published(ckpts.root)] == [3, 4]
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["step_3", "step_4"]
    assert problems(ckpts.root / "step_4") == []
    assert load_driver_state(ckpts.root / "step_4")["data"] == {"index": 4}
    assert "checkpoint step 4 published at" in logs[-1]


def test_a_rotation_that_cannot_delete_says_so_once_per_folder(tmp_path, monkeypatch):
    """A checkpoint folder rotation cannot delete (permissions, a busy network file system) is named in the log,
    in one line however many of its files resist (a sharded checkpoint has thousands)."""
    import os

    from beamrl.loop import checkpoints

    def refusing_rmtree(path, ignore_errors=False, onerror=None, onexc=None):  # rmtree's contract, 3 files refused
        for shard in range(3):
            error = PermissionError(13, "Permission denied", str(Path(path) / f"__{shard}_0.distcp"))
            if onexc is not None:
                onexc(os.unlink, error.filename, error)
            elif onerror is not None:
                onerror(os.unlink, error.filename, (PermissionError, error, None))
            elif not ignore_errors:
                raise error

    monkeypatch.setattr(checkpoints.shutil, "rmtree", refusing_rmtree)
    ckpts, _, logs = _run(tmp_path, steps=(1, 2, 3), keep_last=2)
    said = [line for line in logs if "could not delete" in line]
    assert len(said) == 1, said
    assert "step_1" in said[0] and "Permission denied" in said[0] and "2 more" in said[0]


def test_saving_a_step_again_replaces_it_without_a_word_of_failure(tmp_path):
    ckpts, trainer, logs = _run(tmp_path, steps=(1, 2))
    ckpts.save(trainer, 2, weight_version=2, data_state={"index": 22})  # a resumed run saves step 2 again
    ckpts.wait(trainer)
    assert not [line for line in logs if "could not delete" in line], logs
    assert [step_of(p) for p in published(ckpts.root)] == [1, 2]
    assert load_driver_state(ckpts.root / "step_2")["data"] == {"index": 22}


def test_an_async_save_is_published_only_when_written(tmp_path):
    logs = []
    ckpts = RunCheckpoints(tmp_path / "ckpts", 2, True, 60.0, logs.append)
    trainer = _FakeTrainer()
    trainer.written = False
    ckpts.save(trainer, 5, 5, {})
    ckpts.poll(trainer)
    assert published(ckpts.root) == [] and (ckpts.root / "step_5.incomplete").is_dir()
    trainer.written = True
    ckpts.poll(trainer)
    assert [p.name for p in ckpts.root.iterdir()] == ["step_5"]


def test_the_next_save_waits_for_the_previous_one(tmp_path):
    ckpts = RunCheckpoints(tmp_path / "ckpts", 3, True, 60.0, lambda m: None)
    trainer = _FakeTrainer()
    trainer.written = False
    ckpts.save(trainer, 1, 1, {})
    ckpts.save(trainer, 2, 2, {})  # blocks on (and publishes) step 1 first
    assert [step_of(p) for p in published(ckpts.root)] == [1]


def test_resume_picks_the_newest_and_falls_back_past_damage(tmp_path):
    ckpts, _, _ = _run(tmp_path)
    root = ckpts.root
    assert pick_resume(root, print) == root / "step_3"
    shard = root / "step_3" / "trainer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    meta = root / "step_2" / "trainer" / META_FILE
    meta.write_bytes(meta.read_bytes().replace(b'"format"', b'"fXrmat"'))  # same size: found by its digest
    logs = []
    assert pick_resume(root, logs.append) == root / "step_1"
    assert "step_3 is damaged" in logs[0] and "__0_0.distcp: 10 bytes" in logs[0] and "falling back" in logs[0]
    assert "step_2 is damaged" in logs[1] and f"trainer/{META_FILE}: SHA-256 differs" in logs[1]
    (root / "step_1" / "manifest.json").unlink()
    logs.clear()
    assert pick_resume(root, logs.append) is None
    assert "manifest.json: missing" in logs[-1]


def test_a_checkpoint_the_trainer_finds_damaged_falls_back_at_load(tmp_path):
    ckpts, trainer, logs = _run(tmp_path)
    trainer.damaged = {ckpts.root / "step_3"}
    assert ckpts.load_for_resume(trainer, ckpts.root / "step_3") == ckpts.root / "step_2"
    assert trainer.loaded == [ckpts.root / "step_2"]
    assert "step_3 is damaged" in logs[-1] and "falling back" in logs[-1]
    trainer.damaged = set(published(ckpts.root))
    with pytest.raises(FileNotFoundError, match="no undamaged checkpoint"):
        ckpts.load_for_resume(trainer, ckpts.root / "step_3")


def test_a_crash_leftover_is_replaced(tmp_path):
    root = tmp_path / "ckpts"
    (root / "step_2.incomplete" / "junk").mkdir(parents=True)
    ckpts = RunCheckpoints(root, 3, False, 60.0, lambda m: None)
    ckpts.save(_FakeTrainer(), 2, 2, {})
    assert [p.name for p in root.iterdir()] == ["step_2"] and not (root / "step_2" / "junk").exists()
