"""`pack_bucket` with the bucket's checksum and `unpack_bucket` (the receiver's copy out with its checksum): the fused
kernel (on Triton's interpreter here, the real kernel on CUDA) gives the bytes and the checksum of the separate copy
and checksum passes, layouts it cannot take fall back to them, and a staged colocated sync into an in-process
receiver that defers its checks (the GPU default) runs through both fused sides: the weights arrive bit for bit, a
flipped bit is caught at commit and rolled back."""

import threading

import pytest
import torch

from beamrl.models.beam import preset
from beamrl.models.beam.model import BeamForCausalLM
from beamrl.protocols.checksum import bucket_checksum, padded_rows
from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.export import StateDictSource, specs_of
from beamrl.sync.local_receiver import LocalWeightReceiver
from beamrl.sync.orchestrator import SyncTimeouts, WeightSync
from beamrl.sync.packing import BucketChecksum, bucket_views, pack_bucket, unpack_bucket
from beamrl.sync.plan import plan_buckets
from beamrl.sync.transports import TRANSPORTS

from .faults import FlippedBit

TIMEOUTS = SyncTimeouts(connect=60, call=30, bucket=60, verify=60)


@pytest.fixture
def fused_calls(triton_interpreter, monkeypatch):
    """The fused kernel's launches (gather flag of each), on the interpreter. One at a time: the interpreter patches
    `triton.language` while a kernel runs, so two threads' kernels (the sender packing the next bucket while the
    receiver copies out the last) must not overlap (on a GPU they are plain launches)."""
    from beamrl.kernels import bucket_copy

    calls = []
    real = bucket_copy.copy_with_checksum
    lock = threading.Lock()

    def spy(rows, plan, out, gather, p, period):
        with lock:
            calls.append(gather)
            return real(rows, plan, out, gather, p, period)

    monkeypatch.setattr(bucket_copy, "copy_with_checksum", spy)
    return calls


def _named(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.randn(s, generator=g).to(dt)) for i, (s, dt) in enumerate(shapes)]


@pytest.mark.parametrize("shapes, fused", [
    ([((40, 33), torch.float32), ((1200,), torch.bfloat16), ((8, 8), torch.bfloat16)], True),
    ([((40, 33), torch.float32), ((3,), torch.bfloat16), ((8, 8), torch.bfloat16)], False),  # 6 bytes: not words
], ids=["fused", "fallback"])
def test_pack_and_unpack_with_checksums_equal_the_separate_passes(fused_calls, shapes, fused):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    named = [(n, t.to(dev)) for n, t in _named(0, shapes)]
    plan = plan_buckets([specs_of(named)], 1 << 20)
    (k, tensors), = plan.assemble([named])
    layout = plan.buckets[k]
    slot = torch.full((padded_rows(layout.nbytes) + 4096,), 0xEE, dtype=torch.uint8, device=dev)
    checksum = BucketChecksum(slot, torch.zeros(2, dtype=torch.int64, device=dev))
    pack_bucket(slot[:layout.nbytes], layout, tensors, checksum=checksum)
    rows = slot[:padded_rows(layout.nbytes)]
    want = torch.zeros_like(slot)
    pack_bucket(want[:layout.nbytes], layout, tensors)  # the plain copies
    assert torch.equal(slot[:layout.nbytes], want[:layout.nbytes])
    assert checksum.bucket == k and torch.equal(checksum.out, bucket_checksum(rows))

    dst = [torch.zeros_like(t) for t in tensors]
    out = torch.zeros(2, dtype=torch.int64, device=dev)
    unpack_bucket(rows, layout, dst, bucket_views(slot, layout), out)
    assert all(torch.equal(d.view(torch.uint8), t.view(torch.uint8)) for d, t in zip(dst, tensors))
    assert torch.equal(out, checksum.out)
    assert fused_calls == ([True, False] if fused else [])


def test_the_checksum_rows_must_start_at_the_packing_buffer():
    named = _named(1, [((16,), torch.float32)])
    plan = plan_buckets([specs_of(named)], 1 << 20)
    (k, tensors), = plan.assemble([named])
    slot = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not start at the packing buffer"):
        pack_bucket(slot[4096:4096 + 64], plan.buckets[k], tensors,
                    checksum=BucketChecksum(slot, torch.zeros(2, dtype=torch.int64)))


def _staged_sync(transport, model, trainer_model):
    receiver = LocalWeightReceiver(model, name="eng", rollback=True, defer_checks=True)
    sync = WeightSync(transport, [receiver], timeouts=TIMEOUTS, progress=None, bucket_bytes=64 * 1024)
    return receiver, sync, StateDictSource([(n, p.detach()) for n, p in trainer_model.named_parameters()])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the fused path (interpreter); on CUDA the "
                    "benchmarks check every synced tensor bit for bit")
def test_a_staged_sync_packs_and_copies_out_fused_and_a_flipped_bit_is_rolled_back(fused_calls):
    trainer = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=3).eval()
    engine = BeamForCausalLM(preset("tiny"), dtype=torch.float32, seed=4).eval()
    before = {n: p.clone() for n, p in engine.named_parameters()}
    receiver, sync, source = _staged_sync(lambda r: FlippedBit(r, bad=1), engine, trainer)
    with pytest.raises(WeightSyncError, match=r"bucket\(s\) \[1\] failed their checksum"):
        sync.sync(source)
    assert sync.transport.mode == "staged"
    assert receiver.weight_version == 0 and all(torch.equal(p, before[n]) for n, p in engine.named_parameters())
    n = len(fused_calls)
    assert n >= 4 and fused_calls.count(True) == fused_calls.count(False)  # every bucket: fused pack and copy out

    receiver, sync, source = _staged_sync(lambda r: TRANSPORTS.get("colocated")(r), engine, trainer)
    assert sync.sync(source).version == 1 == receiver.weight_version
    assert all(torch.equal(p, q) for p, q in zip(engine.parameters(), trainer.parameters()))
