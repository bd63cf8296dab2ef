import json

import pytest

from beamrl.data.sources import load_rows, looks_like_path, synthetic_addition_rows


def test_local_jsonl_and_parquet(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_rows(str(jl), cache_dir=str(tmp_path / "cache"))
    assert [dict(r) for r in ds] == rows
    pq = tmp_path / "d.parquet"
    ds.to_parquet(str(pq))
    assert [dict(r) for r in load_rows(str(pq), cache_dir=str(tmp_path / "cache"))] == rows


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(str(missing))


def test_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not looks_like_path("someone/not-cached-dataset")
    with pytest.raises(FileNotFoundError, match="HF cache"):
        load_rows("someone/not-cached-dataset", cache_dir=str(tmp_path))


def test_synthetic_addition_is_seeded_and_correct():
    a = synthetic_addition_rows(50, 9, seed=3)
    assert a == synthetic_addition_rows(50, 9, seed=3) and a != synthetic_addition_rows(50, 9, seed=4)
    for r in a:
        x, y = r["prompt"][:-1].split("+")
        assert r["answer"] == str(int(x) + int(y)) and 0 <= int(x) <= 9 and r["prompt"].endswith("=")
