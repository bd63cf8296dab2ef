"""File manifests: sizes and SHA-256 recorded, damaged files named."""

import pytest

from beamrl import manifest


def _files(tmp_path):
    (tmp_path / "small.json").write_text('{"a": 1}')
    (tmp_path / "big.bin").write_bytes(bytes(range(256)) * ((manifest.SMALL_FILE_BYTES >> 8) + 1))
    return {n: manifest.file_entry(tmp_path / n) for n in ("small.json", "big.bin")}


def test_intact_files_pass(tmp_path):
    files = _files(tmp_path)
    assert manifest.check(tmp_path, files, full=True) == []


def test_missing_truncated_and_corrupted_files_are_named(tmp_path):
    files = _files(tmp_path)
    big = tmp_path / "big.bin"
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 1
    big.write_bytes(bytes(data))  # same size: only a full check sees it
    assert manifest.check(tmp_path, files, full=False) == []
    assert manifest.check(tmp_path, files, full=True) == [f"{big}: SHA-256 differs from the manifest (corrupted)"]
    (tmp_path / "small.json").write_text('{"a": 2}')  # small files are always checksummed
    assert "small.json: SHA-256 differs" in manifest.check(tmp_path, files, full=False)[0]
    big.write_bytes(bytes(data[:10]))
    assert "big.bin: 10 bytes, the manifest records" in manifest.check(tmp_path, files, full=False)[0]
    big.unlink()
    assert manifest.check(tmp_path, files, full=False)[0] == f"{big}: missing"


def test_json_is_written_atomically_and_read_with_clear_errors(tmp_path):
    path = tmp_path / "m.json"
    manifest.write_json_atomic(path, {"x": [1, 2]})
    assert manifest.read_json(path, "test") == {"x": [1, 2]}
    assert not (tmp_path / "m.json.tmp").exists()
    path.write_text("{trunc")
    with pytest.raises(ValueError, match=r"m\.json: unreadable test"):
        manifest.read_json(path, "test")
    with pytest.raises(ValueError, match=r"nope\.json: missing \(test\)"):
        manifest.read_json(tmp_path / "nope.json", "test")
