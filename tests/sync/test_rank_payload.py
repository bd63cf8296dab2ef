"""Colocated buckets from every trainer rank (`beamrl.sync.rank_payload`): one payload entry per engine TP rank from
the trainer rank on its device, each kept alive until the engine copied it; the ranked bucket that carries the
entries; and SGLang's flattened-bucket payload with one buffer per TP rank. Wired into a sync with several trainer
ranks: tests/sync/test_rank_slots.py."""

import os

import pytest
import torch

from beamrl.protocols.flat_bucket import layout
from beamrl.sync.rank_payload import (Colocation, KeepAlive, PayloadError, RankedFlatBucket, SharedBuffer,
                                      payload_entries)


def test_colocation_maps_engine_ranks_to_the_trainer_rank_on_their_device():
    c = Colocation.from_devices(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], ["cuda:2", "cuda:3"])
    assert c.trainer_rank_of == (2, 3) and c.tp_size == 2
    with pytest.raises(PayloadError, match="engine TP rank 1 runs on 'cuda:5'"):
        Colocation.from_devices(["cuda:0", "cuda:1"], ["cuda:0", "cuda:5"])


def test_payload_has_one_entry_per_engine_rank_from_its_trainer_rank():
    handles = [SharedBuffer(rank=r, index=4, nbytes=8) for r in range(4)]
    entries = payload_entries(handles, Colocation((2, 3)), 4)
    assert [e.rank for e in entries] == [2, 3]
    with pytest.raises(PayloadError, match="trainer rank 3 .* shared no buffer"):
        payload_entries(handles[:3] + [None], Colocation((2, 3)), 4)
    with pytest.raises(PayloadError, match="would get bucket 5 of trainer rank 2"):
        payload_entries([SharedBuffer(rank=r, index=5, nbytes=8) for r in range(4)], Colocation((2, 3)), 4)


def test_keep_alive_rules():
    keep = KeepAlive(max_outstanding=2)
    keep.hold(0, torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(PayloadError, match="already held"):
        keep.hold(0, torch.zeros(4, dtype=torch.uint8))
    keep.hold(1, torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(PayloadError, match=r"bucket 2: 2 bucket\(s\) \[0, 1\] not yet copied"):
        keep.hold(2, torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(PayloadError, match=r"commit with bucket\(s\) \[0, 1\]"):
        keep.check_finished()
    keep.release(0)
    with pytest.raises(PayloadError, match="release of bucket 0, which is not held"):
        keep.release(0)
    keep.hold(2, torch.zeros(4, dtype=torch.uint8))
    assert keep.outstanding() == [1, 2]
    keep.release_all()
    keep.check_finished()


def test_a_cpu_buffer_must_be_shareable_and_is_gone_once_released():
    with pytest.raises(PayloadError, match="SharedBuffer.allocate"):
        SharedBuffer.of(torch.zeros(8, dtype=torch.uint8), 0, 0)
    buf = SharedBuffer.allocate(8, "cpu")
    buf.copy_(torch.arange(8, dtype=torch.uint8))
    handle = SharedBuffer.of(buf, 0, 3)
    assert torch.equal(handle.open(), torch.arange(8, dtype=torch.uint8))
    del buf
    with pytest.raises(PayloadError, match="bucket 3 of trainer rank 0 is gone"):
        handle.open()


def test_released_rank_slots_remove_their_files_while_their_tensors_live():
    """`RankSlots.release` removes each CPU slot's /dev/shm file at once, even while something still holds the
    buffer (a process killed after its shutdown never collects it, and the file would outlive the run)."""
    from beamrl.sync.rank_slots import RankSlots

    slots = RankSlots(rank=0, device="cpu", num_slots=2)
    slots.ensure(64)
    held = [s.buffer for s in slots.slots]
    paths = [s.handle.path for s in slots.slots]
    assert all(os.path.exists(p) for p in paths)
    slots.release()
    assert not any(os.path.exists(p) for p in paths)
    for b in held:  # the memory itself stays valid for whoever still maps it
        b.fill_(7)
        assert int(b.sum()) == 7 * 64


def test_sglang_payload_carries_each_tp_rank_its_own_buffer():
    pytest.importorskip("sglang")  # installed in CI (the SGLang CPU engine)
    from sglang.srt.utils.common import MultiprocessingSerializer

    from beamrl.protocols.flat_bucket import FlatBucket, layout
    from beamrl.rollout.sglang.payloads import flattened_bucket_payloads

    metas = layout(["a", "b"], ["float32", "float32"], [(2,), (4,)])
    per_rank = [torch.full((24,), r, dtype=torch.uint8) for r in range(2)]
    bucket = FlatBucket(per_rank[0], metas, index=0)
    payloads = flattened_bucket_payloads(bucket, 2, as_str=False, buffers=per_rank)
    got = [MultiprocessingSerializer.deserialize(p) for p in payloads]
    assert [int(g["flattened_tensor"][0]) for g in got] == [0, 1]  # entry r is TP rank r's buffer
    assert [m.name for m in got[1]["metadata"]] == ["a", "b"]
    with pytest.raises(ValueError, match="2 per-rank buffers for an engine of TP 3"):
        flattened_bucket_payloads(bucket, 3, as_str=False, buffers=per_rank)
    ranked, _bufs = _ranked([7, 9])  # a RankedFlatBucket: entry r of the payload is its TP rank r's entry
    got = [MultiprocessingSerializer.deserialize(p) for p in flattened_bucket_payloads(ranked, 2, as_str=False)]
    assert [int(g["flattened_tensor"][0]) for g in got] == [7, 9]


def _ranked(values):
    metas = layout(["a", "b"], ["float32", "float32"], [(2,), (4,)])
    bufs = [SharedBuffer.allocate(24, "cpu") for _ in values]
    for b, v in zip(bufs, values):
        b.fill_(v)
    entries = [SharedBuffer.of(b, rank=r, index=0).for_bucket(0, 24) for r, b in enumerate(bufs)]
    return RankedFlatBucket(entries, metas, 0, (1, 2)), bufs


def test_a_ranked_bucket_travels_as_handles_and_opens_each_ranks_own_buffer():
    import pickle

    bucket, bufs = _ranked([3, 5])
    again = pickle.loads(pickle.dumps(bucket))  # a Ray call or a pipe carries the handles, not the bytes
    assert [int(b[0]) for b in again.rank_buffers()] == [3, 5] and int(again.buffer[0]) == 3
    assert again.nbytes == 24 and [n for n, _ in again.unflatten()] == ["a", "b"]
    with pytest.raises(PayloadError, match="entry 0 is bucket 0 with 24 bytes, the layout needs bucket 1"):
        RankedFlatBucket(bucket.entries, bucket.metas, 1, (1, 2))
    with pytest.raises(PayloadError, match="bucket 0 has 32 bytes; trainer rank 0's buffer holds 24"):
        SharedBuffer.of(bufs[0], 0, 0).for_bucket(0, 32)


def test_a_cuda_entry_pickles_as_torchs_rebuild_with_the_device_named_by_uuid():
    """SGLang's unpickler maps a device UUID at torch's `storage_device` argument to its own device index; the
    position is checked against torch's signature, so a torch change shows here and not on a GPU."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from beamrl.sync.rank_payload import _CudaTensorByUUID

    assert list(inspect.signature(rebuild_cuda_tensor).parameters)[_CudaTensorByUUID._DEVICE_ARG] == "storage_device"
    args = tuple(range(15))
    handle = SharedBuffer(rank=1, index=0, nbytes=8, cuda_ipc=(rebuild_cuda_tensor, args), device_uuid="GPU-abc")
    fn, got = _CudaTensorByUUID(handle).__reduce__()
    assert fn is rebuild_cuda_tensor and got[6] == "GPU-abc" and got[:6] + got[7:] == args[:6] + args[7:]
