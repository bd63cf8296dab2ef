"""`Wire` carries a per-step call's payload as one pickle: what comes out is what went in, bit for bit, and the
batch's tensors stay writable (the trainer writes into them)."""

import pickle

import numpy as np
import torch

from beamrl.loop.wire import Wire
from beamrl.protocols.rollout import GenerateResult
from beamrl.trainer.protocol import PackedBatch


def test_a_packed_batch_crosses_bit_for_bit_and_writable():
    g = torch.Generator().manual_seed(0)
    batch = PackedBatch(torch.randint(1, 16, (9,), generator=g), torch.tensor([0, 4, 9]), torch.ones(9),
                        {"advantages": torch.randn(9, generator=g)},
                        torch.randint(0, 8, (9, 2, 2), generator=g, dtype=torch.int32))
    wire = pickle.loads(pickle.dumps(Wire(([batch], "loss")), protocol=5))  # as Ray pickles the argument
    (out,), loss = wire.open()
    assert loss == "loss"
    for a, b in [(batch.tokens, out.tokens), (batch.cu_seqlens, out.cu_seqlens), (batch.loss_mask, out.loss_mask),
                 (batch.fields["advantages"], out.fields["advantages"]), (batch.routes, out.routes)]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    out.fields["advantages"][0] = 1.0  # a read-only numpy view would refuse this
    assert not torch.equal(out.fields["advantages"], batch.fields["advantages"])


def test_results_keep_their_routed_experts_and_the_blob_is_the_whole_payload():
    res = [GenerateResult([1, 2], [3, 0], [-0.5, -0.25], "stop", 4, np.arange(24, dtype=np.int32).reshape(3, 2, 4),
                          f"r{i}") for i in range(3)]
    wire = Wire(res)
    assert len(pickle.dumps(wire, protocol=5)) < len(wire) + 200  # no second copy of the data around the blob
    back = pickle.loads(pickle.dumps(wire)).open()
    assert [r.request_id for r in back] == ["r0", "r1", "r2"]
    assert all(np.array_equal(a.routed_experts, b.routed_experts) and a.routed_experts.dtype == b.routed_experts.dtype
               for a, b in zip(res, back))
    assert back[0].output_logprobs == [-0.5, -0.25]
