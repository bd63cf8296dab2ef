"""CPU compatibility for SGLang 0.5.23's CPU engine (CI, `beamrl parity` on a laptop). Never active on a GPU.

This module is one of the two places in beamrl allowed to patch third-party code. Everything it changes:

1. **torchvision stub.** PyPI's torchvision wheels are CUDA builds (their extension needs `libtorch_cuda.so`),
   and SGLang imports torchvision while importing its multimodal helpers (e.g.
   `srt/multimodal/internvl_utils.py`). A meta-path finder serves an inert `torchvision` package whose every
   attribute is an inert class. Beam never uses torchvision.
2. **sgl_kernel stub.** The CPU engine imports a CPU build of `sgl_kernel` that PyPI does not ship (e.g.
   `kernels/ops/kvcache/cache_move.py`). Every attribute is importable; calling any of them raises
   `SglKernelStubError`, so a code path that really needs a kernel fails loudly instead of computing garbage.
   On a CPU without AMX the torch-native path calls none of them.
3. **Pinned host memory.** `--enable-return-routed-experts` allocates its host buffer through
   `ALLOC_MEMORY_FUNCS` with `pin_memory=True` and `cudaHostRegister`s it
   (`srt/state_capturer/base.py`, `srt/mem_cache/pool_host/common.py`). A post-import hook replaces that
   module's `_cuda_host_register` / `_cuda_host_unregister` with no-ops (plain pageable memory on CPU).
4. **`SGLANG_USE_CPU_ENGINE=1`** is set in this process's environment: SGLang's own switch for its CPU
   engine (`srt/utils/common.py:is_cpu`), read when SGLang decides the device.

5. **TP > 1 on CPU** (`tp_env`, added to the launch environment of an engine with several TP ranks on this
   machine, never to this process): SGLang binds each CPU rank's OpenMP threads to a NUMA node of its own and
   refuses more ranks than NUMA nodes unless `SGLANG_CPU_OMP_THREADS_BIND` names each rank's cores (only used on
   AMX/arm64 CPUs); and it compares free memory across ranks at start-up, which other processes on a shared
   machine skew (`SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0`).

Spawned SGLang processes (scheduler, detokenizer) start fresh interpreters, so in-process import hooks do not
reach them. While an in-process engine starts, `spawn_env()` prepends `beamrl/compat/_sglang_cpu_boot` to
`PYTHONPATH` (restored afterwards, so unrelated subprocesses are unaffected); that folder's `sitecustomize.py`
calls `activate()` again at the child's interpreter start-up. An HTTP server subprocess gets the same through
`child_env()`.

`activate()` raises `SglangCpuCompatError` when CUDA is available: the shims would hide real kernels.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

BOOT_DIR = Path(__file__).resolve().parent / "_sglang_cpu_boot"
_HOST_POOL_MODULE = "sglang.srt.mem_cache.pool_host.common"
_STUBBED_PACKAGES = ("torchvision", "sgl_kernel")
_active = False


class SglangCpuCompatError(RuntimeError):
    """The CPU shims were asked for on a machine where they must not run (a CUDA GPU is present)."""


class SglKernelStubError(NotImplementedError):
    """A `sgl_kernel` op was called on the CPU stub: this code path needs the real (CUDA/AMX) kernel."""


# --------------------------------------------------------------------------- inert torchvision objects
class _InertMeta(type):
    """Metaclass whose classes answer any attribute with another inert class (e.g. `T.InterpolationMode.BICUBIC`)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _inert_class(f"{cls.__qualname__}.{name}")


class _Inert(metaclass=_InertMeta):
    """Instances accept any constructor arguments, are callable and return inert objects."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


def _inert_class(qualname: str) -> type:
    return _InertMeta(qualname.rsplit(".", 1)[-1], (_Inert,), {"__qualname__": qualname, "__module__": "torchvision"})


# --------------------------------------------------------------------------- sgl_kernel stub ops
class _KernelStub:
    """Stand-in for any `sgl_kernel` attribute: importable, raises when called."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise SglKernelStubError(
            f"{self._qualname} was called, but beamrl's CPU compatibility layer only stubs sgl_kernel "
            "(no CPU build on PyPI). This code path needs the real kernel: run on a GPU machine with sglang-kernel.")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _KernelStub(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<beamrl sgl_kernel stub {self._qualname}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if self.__name__.split(".")[0] == "torchvision":
            return _inert_class(f"{self.__name__}.{name}")
        return _KernelStub(f"{self.__name__}.{name}")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so `import torchvision.transforms.functional` resolves
        module.__version__ = "0.0.0+beamrl.cpu.stub"
        return module

    def exec_module(self, module) -> None:
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    """Serves stub modules for torchvision and sgl_kernel (and all their submodules)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in _STUBBED_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


# --------------------------------------------------------------------------- pinned-memory post-import hook
def _no_host_register(*args, **kwargs) -> None:
    """CPU torch cannot cudaHostRegister; the host buffer stays ordinary pageable memory."""


def _patch_host_pool(module) -> None:
    module._cuda_host_register = _no_host_register
    module._cuda_host_unregister = _no_host_register


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _patch_host_pool(module)


class _HostPoolFinder(importlib.abc.MetaPathFinder):
    """Wraps the real loader of SGLang's host-pool module so the no-op is installed right after it loads."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _HOST_POOL_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _StubFinder):
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                spec.loader = _PostImportLoader(spec.loader)
                return spec
        return None


# --------------------------------------------------------------------------- public API
def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def is_active() -> bool:
    return _active


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess that runs SGLang on CPU: the boot dir first on PYTHONPATH + the CPU switch."""
    env = dict(os.environ if base is None else base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOT_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOT_DIR), *parts])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


def tp_env(num_rank_slots: int) -> dict[str, str]:
    """SGLang's own settings for an engine whose ranks on this machine have GPU ids (CPU: rank slots) below
    `num_rank_slots` (see item 5 of the module docstring): every rank slot may use every core of this process."""
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join([cores] * num_rank_slots),
            "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0"}


def activate() -> None:
    """Install the CPU shims in this process and arrange for SGLang's child processes to get them. Idempotent.

    Must run before `sglang` is imported. Raises `SglangCpuCompatError` when CUDA is available, and when
    SGLang's host-pool module was already imported without the shim."""
    global _active
    if _active:
        return
    if _cuda_available():
        raise SglangCpuCompatError(
            "beamrl.compat.sglang_cpu must not be activated on a machine with a CUDA GPU: its stubs would replace "
            "sgl_kernel and torchvision. Install sglang-kernel and run SGLang's GPU path instead.")
    if _HOST_POOL_MODULE in sys.modules:
        _patch_host_pool(sys.modules[_HOST_POOL_MODULE])
    for name in _STUBBED_PACKAGES:
        mod = sys.modules.get(name)
        if mod is not None and not isinstance(mod, _StubModule):
            raise SglangCpuCompatError(f"{name} was imported before the CPU shims were activated ({mod!r})")
    sys.meta_path.insert(0, _StubFinder())
    sys.meta_path.insert(0, _HostPoolFinder())
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    _active = True


@contextmanager
def spawn_env() -> Iterator[None]:
    """While active, processes spawned from this one get the shims (boot dir first on PYTHONPATH)."""
    if not _active:
        raise SglangCpuCompatError("spawn_env() needs activate() first")
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
