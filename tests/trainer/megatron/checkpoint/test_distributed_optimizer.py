"""The distributed optimizer's per-DP-rank description (`checkpoint/distributed_optimizer.py`): any split of a
parameter's flat elements into DP ranges, each described as boxes, puts every element of the parameter's global
tensor(s) in place exactly once (partial rows, prepended axes, the GLU factory), each box a view of the rank's own
state (no copy). No process group needed; the multi-process save/load runs in tests/trainer/megatron/
test_checkpoint.py."""

import itertools
import math

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from beamrl.trainer.megatron.checkpoint.distributed_optimizer import flat_range_boxes, owned_boxes


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (1, 5, 1, 3)])
def test_flat_ranges_are_few_contiguous_boxes_in_flat_order(shape):
    n = math.prod(shape)
    index = torch.arange(n).view(shape)
    for start, end in itertools.combinations(range(n + 1), 2):
        boxes = flat_range_boxes(shape, start, end)
        assert len(boxes) <= 2 * len(shape) - 1
        covered = []
        for offset, size, at in boxes:
            elements = index[tuple(slice(o, o + s) for o, s in zip(offset, size))].flatten().tolist()
            assert elements == list(range(at, at + math.prod(size)))  # contiguous, starting where it says
            covered += elements
        assert covered == list(range(start, end)), (shape, start, end)


def _plain():
    """TP rank 1 of 3 of an [18, 5] tensor, at layer 2 of 4 (one prepended axis)."""
    return ShardedTensor.from_rank_offsets("w", torch.zeros(6, 5), (0, 2, 4), (1, 1, 3), replica_id=(0, 0, 1),
                                           prepend_axis_num=1)


def _glu():
    """TP rank 1 of 2 of a GLU fc1: local [gate_1; up_1] (8 x 5), global [gate; up] (16 x 5)."""
    sh = ShardedTensor.from_rank_offsets("fc1", torch.zeros(8, 5), (0, 1, 2), replica_id=(0, 0, 1))
    return apply_swiglu_sharded_factory(sh, ())


def _expected(sh, local: torch.Tensor) -> dict[str, torch.Tensor]:
    """The global tensors a full (unsplit) description of `local` fills, NaN where other ranks' parts go."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    described = nested_values(sh.build_fn(sh.key, local, sh.replica_id, None)) if hasattr(sh, "build_fn") else \
        [ShardedTensor(**{**sh.__dict__, "data": local})]
    out = {}
    for d in described:
        full = out.setdefault(d.key, torch.full(d.global_shape, float("nan")))
        full[tuple(slice(o, o + s) for o, s in zip(d.global_offset, (1,) * d.prepend_axis_num + d.local_shape))] = \
            d.data.view((1,) * d.prepend_axis_num + d.local_shape)
    return out


@pytest.mark.parametrize("make", [_plain, _glu])
@pytest.mark.parametrize("cuts", [[13], [5, 6, 27], [1, 2, 3, 28]])  # DP rank boundaries, mid-row included
def test_dp_ranges_reassemble_the_global_tensors_exactly_once(make, cuts):
    sh = make()
    local = torch.arange(sh.data.numel(), dtype=torch.float32).view(sh.data.shape) + 1
    expected = _expected(sh, local)
    got = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
    count = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in expected.items()}
    bounds = [0, *cuts, local.numel()]
    for start, end in zip(bounds, bounds[1:]):
        flat = local.view(-1)[start:end].clone()  # this DP rank's own state
        boxes = owned_boxes(sh, "s", flat, start, end, (0, 0, 0))
        at = 0
        for box in (boxes[i] for i in range(len(boxes))):
            key = box.key
            assert box.replica_id == (0, 0, 0) and box.axis_fragmentations is None
            assert box.data.data_ptr() == flat[at:].data_ptr()  # a view of the rank's state, in flat order
            at += box.data.numel()
            where = tuple(slice(o, o + s) for o, s in zip(box.global_offset, box.local_shape))
            k = sh.key if key == "s" else key  # a factory's outputs keep its key
            got[k][where] = box.data
            count[k][where] += 1
        assert at == end - start
    for k in expected:
        placed = ~torch.isnan(expected[k])
        assert bool((count[k][placed] == 1).all()) and bool((count[k][~placed] == 0).all())
        assert torch.equal(got[k][placed], expected[k][placed])
