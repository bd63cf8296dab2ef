"""Colocated buckets from every trainer rank, wired through the one orchestrator (`WeightSync` + `RankSlots` +
the colocated transport's per-rank mode), with 2 gloo trainer ranks and an engine of TP 2 whose rank r is a native
engine receiver reading the entry of trainer rank r (`_rank_slots_runs.py`)."""

import pytest

from beamrl.trainer.megatron.launch import launch
from tests.sync import _rank_slots_runs as R

pytestmark = pytest.mark.slow


def test_every_engine_rank_reads_its_own_trainer_ranks_copy_bit_exactly():
    r0, r1 = launch(R.per_rank_sync, 2, (None,), timeout_s=300)
    for k in (1, 2):
        assert r0[f"sync{k}"] == "ok" and r1[f"sync{k}"] == "ok"
        assert r0[f"sync{k}_bit_equal"] == [True, True]  # both TP ranks hold the trainer's weights bit for bit
        assert r0[f"sync{k}_version"] == [k, k]
        entries = r0[f"sync{k}_entries"]
        assert len(entries) >= 4  # several buckets: each of the 2 slots is packed again within the sync
        # entry r of every bucket is trainer rank r's own buffer (two distinct shared-memory slots per sync)
        assert all([rank for rank, _ in e] == [0, 1] for e in entries)
        assert len({path for e in entries for _, path in e}) == 4
        assert r0[f"sync{k}_held"] == []  # finalize found nothing outstanding
        assert r0[f"released{k}"] and r1[f"released{k}"]


def test_a_corrupted_copy_on_trainer_rank_1_is_refused_and_the_engine_is_unchanged():
    r0, r1 = launch(R.per_rank_sync, 2, (1,), timeout_s=300)
    assert r0["sync1"].startswith("refused") and "tp-rank-1: bucket 1 failed its checksum" in r0["sync1"]
    assert r0["sync1_unchanged"] == [True, True]  # TP rank 0 had loaded bucket 1: rolled back with the session
    assert r0["sync1_version"] == [0, 0] and r0["sync1_held"] == []  # abort dropped every held slot
    # the next sync (the same version again, into new slots after the release) goes through
    assert r0["sync2"] == "ok" and r0["sync2_bit_equal"] == [True, True] and r0["sync2_version"] == [1, 1]
    assert r1["sync2"] == "ok"
