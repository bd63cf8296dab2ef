"""The SGLang CPU shims: refused with CUDA, importable stubs that fail loudly when used, and the
sitecustomize bootstrap that gives a fresh child interpreter the same shims."""

import subprocess
import sys

import pytest

from beamrl.compat import sglang_cpu


def test_refuses_to_activate_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(sglang_cpu, "_active", False)
    monkeypatch.setattr(sglang_cpu, "_cuda_available", lambda: True)
    with pytest.raises(sglang_cpu.SglangCpuCompatError, match="CUDA GPU"):
        sglang_cpu.activate()


def test_child_env_puts_the_boot_dir_first():
    env = sglang_cpu.child_env({"PYTHONPATH": "/a:/b"})
    assert env["PYTHONPATH"].split(":") == [str(sglang_cpu.BOOT_DIR), "/a", "/b"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert (sglang_cpu.BOOT_DIR / "sitecustomize.py").exists()


def test_sgl_kernel_stub_imports_but_raises_when_called():
    sglang_cpu.activate()
    import sgl_kernel
    from sgl_kernel.kvcacheio import transfer_kv_all_layer  # any name imports

    with pytest.raises(sglang_cpu.SglKernelStubError, match="sgl_kernel.kvcacheio.transfer_kv_all_layer"):
        transfer_kv_all_layer(1, 2)
    with pytest.raises(NotImplementedError):
        sgl_kernel.fused_add_rmsnorm()


def test_torchvision_stub_is_inert():
    sglang_cpu.activate()
    import torchvision
    import torchvision.transforms as T
    from torchvision.transforms import InterpolationMode

    assert torchvision.__version__ == "0.0.0+beamrl.cpu.stub"  # the stub, never PyPI's CUDA-only wheel
    pipeline = T.Compose([T.Resize(4, interpolation=InterpolationMode.BICUBIC), T.ToTensor()])
    out = pipeline("image")  # a real Compose would try to resize a string and raise
    assert isinstance(out, sglang_cpu._Inert) and isinstance(out.anything(1, k=2), sglang_cpu._Inert)
    assert issubclass(InterpolationMode.BICUBIC, sglang_cpu._Inert)


@pytest.mark.slow
def test_spawned_interpreter_gets_the_shims_through_sitecustomize():
    code = (
        "import sys\n"
        "assert 'sgl_kernel' not in sys.modules\n"
        "import sglang.srt.mem_cache.pool_host.common as c\n"
        "from beamrl.compat import sglang_cpu\n"
        "assert sglang_cpu.is_active()\n"
        "assert c._cuda_host_register.__name__ == '_no_host_register'\n"
        "import torch\n"
        "buf = c.alloc_with_host_register((2, 3), torch.int32, 'cpu', True, c.HostTensorAllocator())\n"
        "assert tuple(buf.shape) == (2, 3)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=sglang_cpu.child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_spawn_env_is_scoped(monkeypatch):
    sglang_cpu.activate()
    monkeypatch.setenv("PYTHONPATH", "/x")
    with sglang_cpu.spawn_env():
        import os

        assert os.environ["PYTHONPATH"].split(":")[0] == str(sglang_cpu.BOOT_DIR)
    assert os.environ["PYTHONPATH"] == "/x"
