import pytest

from beamrl.metrics.wandb_backend import WandbLogger


def test_offline_run_dir_without_network(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    lg = WandbLogger("beamrl-test", "unit", tmp_path / "run", mode="offline", config={"a": 1})
    lg.log(0, {"reward/mean": 0.5})
    lg.log(1, {"reward/mean": 0.75})
    run_dir = lg.run_dir
    lg.close()
    assert run_dir.parent == tmp_path / "run" / "wandb" and run_dir.name.startswith("offline-run-")
    files = list(run_dir.glob("run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0


def test_bad_mode(tmp_path):
    with pytest.raises(ValueError, match="offline"):
        WandbLogger("p", "r", tmp_path, mode="disabled")
