import json
import struct
import time
from pathlib import Path

import pytest

from beamrl.metrics.wandb_backend import WandbLogger


def read_wandb_records(path: Path) -> list:
    """The records of a `.wandb` transaction log, read without wandb's writer: a 7-byte file header, then
    32 KiB blocks of chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last), each record a
    `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def _offline_wandb(monkeypatch, tmp_path) -> None:
    """wandb's directories under `tmp_path`, no API key, no output: nothing reaches the network or the home dir."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_offline_run_dir_without_network(tmp_path, monkeypatch):
    _offline_wandb(monkeypatch, tmp_path)
    lg = WandbLogger("beamrl-test", "unit", tmp_path / "run", mode="offline", config={"a": 1})
    lg.log(0, {"reward/mean": 0.5})
    lg.log(3, {"reward/mean": 0.75, "train/kl": 0.125})
    run_dir = lg.run_dir
    lg.close()
    assert run_dir.parent == tmp_path / "run" / "wandb" and run_dir.name.startswith("offline-run-")
    (log_file,) = run_dir.glob("run-*.wandb")
    # wandb's service process writes the log: wait (bounded) for its final record, then read back what was logged
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in read_wandb_records(log_file)):
        assert time.monotonic() < deadline, f"{log_file} has no exit record 60 s after close()"
        time.sleep(0.1)
    rows = [{k: v for k, v in row.items() if not k.startswith("_") or k == "_step"}
            for row in history(read_wandb_records(log_file))]
    assert rows == [{"_step": 0, "reward/mean": 0.5}, {"_step": 3, "reward/mean": 0.75, "train/kl": 0.125}]


def test_bad_mode(tmp_path):
    with pytest.raises(ValueError, match="offline"):
        WandbLogger("p", "r", tmp_path, mode="disabled")


def test_a_finish_that_hangs_is_bounded_and_names_the_sync_command(tmp_path, monkeypatch, capsys):
    _offline_wandb(monkeypatch, tmp_path)
    monkeypatch.setattr("beamrl.metrics.wandb_backend._FINISH_MARGIN_S", 0.0)
    lg = WandbLogger("beamrl-test", "unit", tmp_path / "run", mode="offline", finish_timeout_s=0.5)
    assert lg._run.settings.finish_timeout == 0.5  # wandb's own bound: also its teardown at interpreter exit
    lg.log(0, {"reward/mean": 0.5})
    real_finish, release = lg._run.finish, __import__("threading").Event()

    def stuck_upload():  # an online upload that never gets through
        release.wait(60)
        real_finish()

    lg._run.finish = stuck_upload
    t0 = time.monotonic()
    lg.close()
    elapsed = time.monotonic() - t0
    release.set()  # let wandb finish for real, so nothing is left running
    assert elapsed < 10, f"close() waited {elapsed:.1f} s for a finish bounded at 0.5 s"
    err = capsys.readouterr().err
    assert "finish_timeout_s=0.5" in err and f"wandb sync {lg.run_dir}" in err


def test_a_finish_that_fails_is_raised(tmp_path, monkeypatch):
    _offline_wandb(monkeypatch, tmp_path)
    lg = WandbLogger("beamrl-test", "unit", tmp_path / "run", mode="offline")
    real_finish = lg._run.finish

    def broken():
        real_finish()
        raise OSError("disk full")

    lg._run.finish = broken
    with pytest.raises(OSError, match="disk full"):
        lg.close()
