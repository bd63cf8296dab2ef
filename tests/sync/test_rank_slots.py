"""Colocated buckets from every trainer rank, wired through the one orchestrator (`WeightSync` + `RankSlots` +
the colocated transport's per-rank mode), with 2 gloo trainer ranks and an engine of TP 2 whose rank r reads the
entry of trainer rank r (`_rank_slots_runs.py`): the real SGLang CPU engine (one start for both scenarios), and
an engine whose TP ranks are native engine receivers (whose weights the test reads directly)."""

import re

import pytest

from beamrl.trainer.megatron.launch import launch
from tests.sync import _rank_slots_runs as R

pytestmark = pytest.mark.slow


def test_every_engine_rank_reads_its_own_trainer_ranks_copy_and_a_corrupted_copy_is_refused():
    r0, r1 = launch(R.per_rank_sync, 2, ("native", -1), timeout_s=300)
    # sync 1: trainer rank 1's copy of the last bucket changed after the broadcast: engine TP rank 1 refuses it
    # (seen at the commit), the session is aborted, and both TP ranks are unchanged (TP rank 0 had loaded every
    # bucket: rolled back)
    assert r0["sync1"].startswith("refused")
    assert re.search(r"tp-rank-1: bucket \d+ failed its checksum", r0["sync1"])
    assert r1["sync1"].startswith("refused") and "at the commit" in r1["sync1"]  # the ranks agree after it
    assert r0["sync1_unchanged"] == [True, True] and r0["sync1_version"] == 0
    assert r0["sync1_held"] == []  # abort dropped every held slot
    # sync 2 (the same version again, into new slots after the release): both TP ranks hold the trainer's
    # weights bit for bit, and entry r of every bucket was trainer rank r's own slot
    assert r0["sync2"] == "ok" and r1["sync2"] == "ok"
    assert r0["sync2_bit_equal"] == [True, True] and r0["sync2_version"] == 1
    entries = r0["sync2_entries"]
    assert len(entries) >= 4  # several buckets: each of the 2 slots is packed again within the sync
    assert all([rank for rank, _ in e] == [0, 1] for e in entries)
    assert len({path for e in entries for _, path in e}) == 4  # 2 slots x 2 trainer ranks, distinct memory
    assert r0["sync2_held"] == []  # finalize found nothing outstanding
    assert r0["released2"] and r1["released2"]


def test_sglang_engine_of_tp2_takes_each_ranks_copy_and_refuses_a_corrupted_one(tmp_path):
    pytest.importorskip("sglang")  # installed in CI (the SGLang CPU engine)
    r0, r1 = launch(R.per_rank_sync, 2, ("sglang", 2, str(tmp_path)), timeout_s=540)
    # sync 1: trainer rank 1's copy of bucket 2 changed after the broadcast: SGLang's TP rank 1 would have read it
    assert r0["sync1"].startswith("refused")
    assert "bucket 2 failed its checksum" in r0["sync1"] and "engine TP rank 1, from trainer rank 1" in r0["sync1"]
    assert r0["sync1_engine_checksum"] == r0["start_checksum"] and r0["sync1_version"] == 0  # rolled back
    # sync 2: every entry r from trainer rank r; what SGLang computes with is the trainer's weights bit for bit
    # (the same checksum as SGLang's own loader reading them from disk)
    assert r0["sync2"] == "ok" and r1["sync2"] == "ok" and r0["sync2_version"] == 1
    assert all([rank for rank, _ in e] == [0, 1] for e in r0["sync2_entries"]) and len(r0["sync2_entries"]) >= 4
    assert r0["sync2_engine_checksum"] == r0["disk_checksum"] != r0["start_checksum"]
    assert r0["sync2_held"] == [] and r1["released2"]
