"""`Wire` carries a per-step call's payload as one pickle: what comes out is what went in, bit for bit, and the
batch's tensors stay writable (the trainer writes into them)."""

import pickle

import numpy as np
import pytest
import torch

from beamrl.loop.wire import INLINE_MAX_BYTES, Wire
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


def _results(rows: int) -> list[GenerateResult]:
    return [GenerateResult([1, 2], [3, 0], [-0.5, -0.25], "stop", 4,
                           np.arange(rows * 8, dtype=np.int32).reshape(rows, 2, 4) + i, f"r{i}") for i in range(3)]


def _crossed(wire: Wire, out_of_band: bool) -> Wire:
    """`wire` pickled and unpickled as Ray does (protocol 5, out-of-band buffers collected) or in-band."""
    if not out_of_band:
        return pickle.loads(pickle.dumps(wire, protocol=5))
    buffers = []
    blob = pickle.dumps(wire, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(blob, buffers=[b.raw() for b in buffers])


@pytest.mark.parametrize("rows", [3, 20_000])  # 288 B or 1.9 MB of routed experts: inside the message, out of band
@pytest.mark.parametrize("out_of_band", [False, True])
def test_results_keep_their_routed_experts_small_ones_inside_the_message_large_ones_out_of_band(rows, out_of_band):
    res = _results(rows)
    wire = Wire(res)
    large = rows * 8 * 4 * 3 > INLINE_MAX_BYTES
    buffers = []
    pickle.dumps(wire, protocol=5, buffer_callback=buffers.append)
    # small arrays ride in the message (one object for Ray to serialize); large ones stay separate buffers, which
    # Ray sends out of band without copying them into the message
    assert len(buffers) == (3 if large else 0)
    assert len(wire.blob) < 2000 and wire.nbytes >= rows * 8 * 4 * 3
    back = _crossed(wire, out_of_band).open()
    assert [r.request_id for r in back] == ["r0", "r1", "r2"]
    assert all(np.array_equal(a.routed_experts, b.routed_experts) and a.routed_experts.dtype == b.routed_experts.dtype
               for a, b in zip(res, back))
    assert back[0].output_logprobs == [-0.5, -0.25]


def test_a_result_that_cannot_be_unpickled_names_the_call():
    from beamrl.loop.groups import _opened
    from beamrl.protocols.rollout import EngineError

    wire = Wire([1, 2])
    wire.blob = wire.blob[:-3]  # e.g. a driver and an engine on different code
    with pytest.raises(EngineError, match="native-0.generate: its result could not be unpickled"):
        _opened(wire, "native-0.generate")
