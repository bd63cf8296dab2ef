"""Device staging before a save: host tensors pass through, CUDA tensors go to pinned buffers reused from save to
save, which a forked writer can read. (The rest of `storage` runs in tests/trainer/megatron/test_checkpoint.py and
test_file_writer.py.)"""

import pytest
import torch


def test_host_tensors_are_staged_as_they_are():
    from beamrl.trainer.megatron.checkpoint.storage import HostStaging

    t = torch.randn(8)
    staged = HostStaging().stage({"a": t})
    assert staged["a"].data_ptr() == t.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: pinned staging of CUDA tensors")
def test_device_tensors_are_staged_into_reused_pinned_buffers():
    from beamrl.trainer.megatron.checkpoint.storage import HostStaging

    staging = HostStaging()
    x = torch.randn(1024, device="cuda")
    first = staging.stage({"x": x})["x"]
    assert first.is_pinned() and torch.equal(first, x.cpu()) and staging.last_bytes == x.nbytes
    x.add_(1)
    second = staging.stage({"x": x})["x"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, x.cpu())  # reused, refreshed
    third = staging.stage({"x": torch.randn(2048, device="cuda")})["x"]
    assert third.shape == (2048,) and third.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: pinned staging read by a forked writer")
def test_a_forked_writer_reads_the_pinned_staging_buffers(tmp_path):
    """The async save's child reads the pinned buffers the parent staged into (as Megatron's forked writer does)."""
    from beamrl.trainer.megatron.checkpoint.async_writer import BackgroundWrite
    from beamrl.trainer.megatron.checkpoint.storage import HostStaging

    x = torch.randn(1 << 20, device="cuda")
    staged = HostStaging().stage({"x": x})["x"]
    out = tmp_path / "x.pt"
    assert BackgroundWrite(lambda: torch.save(staged, out), "test").wait(timeout_s=60)
    assert torch.equal(torch.load(out, weights_only=True), x.cpu())
