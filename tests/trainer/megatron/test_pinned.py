"""Exactly sized page-locked host memory (GPU only: registration needs CUDA)."""

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: host memory registered with CUDA")
@pytest.mark.parametrize("fork_shared", [False, True])
def test_pinned_host_is_page_locked_and_exactly_sized(fork_shared):
    from beamrl.trainer.megatron.pinned import pinned_host

    n = (1 << 20) + 3  # not a power of two: the caching allocator would round it up to 2 MiB
    host = pinned_host(n, fork_shared=fork_shared)
    assert host.numel() == n and host.is_pinned() and host.untyped_storage().nbytes() == n
    x = torch.arange(n, dtype=torch.uint8, device="cuda")
    host.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, x.cpu())
