"""Run Megatron-core 0.19.2 on CPU with gloo (tests and CI only; never on a GPU).

Megatron-core assumes CUDA in a few hundred places. This module is one of the two places in beamrl allowed to
patch third-party code (the other is `beamrl.compat.sglang_cpu`). Every patch is listed below with its symptom,
where it bites and why the patch is safe; ids W0-W5 follow /work/shared/notes/megatron-integration.md §2.

Usage (before building any Megatron model, in a process that uses no GPU)::

    from beamrl.compat import megatron_cpu
    megatron_cpu.activate()          # idempotent; raises if CUDA is available
    import megatron.core ...
    megatron_cpu.deactivate()        # undoes every patch (tests scope the layer to the tests that need it)

Patches:

W0  `ModuleNotFoundError: No module named 'triton'` on `import megatron.core` (unconditional
    `import triton` in `transformer/moe/ops/paged_stash.py:4`). Only when triton is NOT installed, a meta-path
    finder serves that one module with stubs that raise if called (paged stash is a GPU-only memory feature).
    Never a global fake `triton` in sys.modules: torch probes `triton.backends` and breaks. With triton
    installed (the pinned environment) this patch is not applied.
W1  `AssertionError: Torch not compiled with CUDA enabled` in `model_parallel_cuda_manual_seed`
    (`tensor_parallel/random.py:303`, `CudaRNGStatesTracker.add`, `_get/_set_cuda_rng_state`). The "CUDA"
    generator becomes the CPU generator: `torch.cuda.{get,set}_rng_state/manual_seed` and Megatron's
    `_get/_set_cuda_rng_state` read/write the CPU state. The tracker keeps its *named* states (per-TP
    'model-parallel-rng', per-EP 'expert-parallel-rng', ...), so TP-sharded init and activation recompute
    (which restores the forked states) behave as on GPU. `CudaRNGStatesTracker.fork` loses its "CPU RNG state
    changed within GPU RNG context" warning, which is meaningless when both generators are one.
W2  `RuntimeError: torch.cuda.Stream requires CUDA support` (~100 sites, e.g. the alltoall dispatcher
    `transformer/moe/token_dispatcher.py:469`, DDP `distributed/param_and_grad_buffer.py:632`).
    `torch.cuda.Stream/Event/ExternalStream/current_stream/default_stream/stream/synchronize` and
    `Tensor.record_stream` become no-ops: CPU work is synchronous, so every wait is already satisfied.
W2b `TypeError: all_to_all_single(): incompatible function arguments ... tensor([69, 62])` in the EP alltoall:
    `moe_utils.maybe_move_tensor_to_cpu` only converts split sizes to numpy when `tensor.is_cuda`, and gloo's
    `all_to_all_single` wants lists/numpy. Replaced (in the `moe_utils` and `token_dispatcher` namespaces) by a
    version that returns numpy whenever numpy is requested.
W3  `Torch not compiled with CUDA enabled` from `device=torch.cuda.current_device()`, `device="cuda"`,
    `.cuda()` (~90 sites: RoPE, router, schedules, clip_grads, optimizer, grad scaler).
    `torch.cuda.current_device()` returns 0, and the callables that take a device rewrite a CUDA device (str,
    torch.device or int index) to CPU: the tensor factories of the `torch` namespace (`_FACTORIES`: empty,
    zeros, tensor, arange, ... and the `*_like` ones), the `Tensor.new_*` factories, `Tensor.to(...)`;
    `Tensor.cuda()` returns the tensor. Not a process-wide `TorchFunctionMode` (the first version): a mode runs
    a Python handler for *every* torch op, about 18k calls and 13% of the CPU time of one quickstart train step
    (benchmarks/profile_step.py), to catch the ~10 factory calls per step that ask for CUDA.
W4  `AssertionError: sequence parallel not supported by torch LayerNorm` (`transformer/torch_norm.py:50`,
    `WrappedTorchNorm`, which asserts even for q/k norms). With sequence parallelism `WrappedTorchNorm` builds
    `SequenceParallelRMSNorm` (`F.rms_norm`) whose weight is marked `sequence_parallel`, so
    `distributed/finalize_model_grads.py:452` all-reduces its gradient over TP as Megatron's own norms do.
    (Beam's model spec uses its own norm module; this patch is for stock specs.)
W5  `TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor...` (`optimizer/distrib_optimizer.py:466`),
    bare `AssertionError` at `optimizer/clip_grads.py:174`, same pattern in `optimizer/optimizer.py:1009/1028`:
    string checks on `Tensor.type()`. The *no-argument* `Tensor.type()` reports `torch.cuda.*Tensor` names for
    CPU tensors; `Tensor.type(dtype)` (a cast) is unchanged.
W6  Not a failure, a cost: without TE/Apex, Megatron's grad-norm and grad-clip fallbacks
    (`utils.local_multi_tensor_l2_norm` / `local_multi_tensor_scale`, used by `optimizer/clip_grads.py`) read every
    parameter's norm to the host (`torch.tensor(list of 0-dim tensors)`: one host read per tensor) and scale each
    grad with a multiply and a copy, in Python loops. Replaced, in `clip_grads` only and only while they are
    those fallbacks, by `torch._foreach_norm` + `torch.stack` and `torch._foreach_mul_`: the same per-tensor
    kernels (`linalg_vector_norm`, `mul`) and the same norm of the stacked norms, so the same values bit for bit
    (tests/compat/test_megatron_cpu.py), without the host reads. On GPU TE/Apex provide fused kernels instead.

Config flags that still fail on CPU and must stay off: `gradient_accumulation_fusion`, `apply_rope_fusion`,
`moe_permute_fusion`, `moe_router_fusion`; use `batch_p2p_comm=False` with PP=2 + VPP on gloo (§3).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types

import torch
import torch.nn.functional as F

_lock = threading.Lock()
_active = False
_finder: "_PagedStashStubFinder | None" = None
#: (object, attribute, original value) of every patch, in the order applied; `deactivate` restores them.
_saved: list[tuple[object, str, object]] = []

PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


class MegatronCpuError(RuntimeError):
    """The CPU compatibility layer was asked to run where it must not (a visible CUDA device)."""


def is_active() -> bool:
    """True once `activate()` has run in this process."""
    return _active


def activate() -> None:
    """Apply W0-W6 once per process (idempotent). Raises `MegatronCpuError` when CUDA is available."""
    global _active
    with _lock:
        if _active:
            return
        if torch.cuda.is_available():
            raise MegatronCpuError(
                "beamrl.compat.megatron_cpu must not be activated on a machine with a CUDA device: it redirects "
                "every CUDA call to the CPU. Use it only in CPU-only processes (tests / CI).")
        _w0_triton_free_paged_stash()
        _w1_cpu_rng()
        _w2_noop_streams()
        _w3_cpu_devices()
        import megatron.core  # noqa: F401  (after W0; the remaining patches target imported modules)

        _w1_tracker()
        _w2b_numpy_split_sizes()
        _w4_sequence_parallel_norm()
        _w5_tensor_type_names()
        _w6_foreach_grad_norm_and_scale()
        _active = True


def deactivate() -> None:
    """Undo `activate()`: restore every patched attribute and remove the W0 finder.
    Idempotent. Objects built while the layer was active keep what they captured (tests build them anew)."""
    global _active, _finder
    with _lock:
        if not _active:
            return
        for obj, name, original in reversed(_saved):
            _restore(obj, name, original)
        _saved.clear()
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        _active = False


_INHERITED = object()


def _patch(obj: object, name: str, value: object) -> None:
    """setattr, remembering the original for `deactivate` (a class's own raw attribute, e.g. the staticmethod
    of `__new__`, or that it was inherited)."""
    original = vars(obj).get(name, _INHERITED) if isinstance(obj, type) else getattr(obj, name)
    _saved.append((obj, name, original))
    setattr(obj, name, value)


def _restore(obj: object, name: str, original: object) -> None:
    if original is _INHERITED:
        delattr(obj, name)
    else:
        setattr(obj, name, original)


# ------------------------------------------------------------------------------------------------------- W0


class _PagedStashStubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        def _unavailable(*args, **kwargs):
            raise MegatronCpuError("MoE paged stash needs triton/CUDA; it is unavailable on CPU")

        module.GLOBAL_BLOCK_SIZE = 1024
        module.paged_stash_copy_kernel = _unavailable
        module.paged_stash_pop_kernel = _unavailable
        module.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]


class _PagedStashStubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == PAGED_STASH_OPS:
            return importlib.machinery.ModuleSpec(fullname, _PagedStashStubLoader())
        return None


def _w0_triton_free_paged_stash() -> None:
    global _finder
    if importlib.util.find_spec("triton") is not None:
        return  # triton installed: Megatron imports the real module.
    if PAGED_STASH_OPS in sys.modules:
        return
    _finder = _PagedStashStubFinder()
    sys.meta_path.insert(0, _finder)


# ------------------------------------------------------------------------------------------------------- W1


def _w1_cpu_rng() -> None:
    # One generator: the "CUDA" RNG is the CPU RNG.
    _patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _patch(torch.cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
    # Seed the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    _patch(torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    _patch(torch.cuda, "manual_seed_all", lambda seed: torch.default_generator.manual_seed(int(seed)))


def _w1_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    _patch(mrandom, "_get_cuda_rng_state", get_state)
    _patch(mrandom, "_set_cuda_rng_state", set_state)

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        # Megatron's fork, minus the CPU-vs-GPU state warning (one generator here).
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name

    _patch(mrandom.CudaRNGStatesTracker, "fork", fork)


# ------------------------------------------------------------------------------------------------------- W2


class _NoopStream:
    """Stands for torch.cuda.Stream/ExternalStream: CPU ops are synchronous, so every wait is satisfied."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NoopEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, _NoopStream)

    def __hash__(self):
        return 0


class _NoopEvent:
    """Stands for torch.cuda.Event."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_NOOP_STREAM = _NoopStream()


def _w2_noop_streams() -> None:
    _patch(torch.cuda, "Stream", _NoopStream)
    _patch(torch.cuda, "ExternalStream", _NoopStream)
    _patch(torch.cuda, "Event", _NoopEvent)
    _patch(torch.cuda, "current_stream", lambda device=None: _NOOP_STREAM)
    _patch(torch.cuda, "default_stream", lambda device=None: _NOOP_STREAM)
    _patch(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    _patch(torch.cuda, "synchronize", lambda device=None: None)
    _patch(torch.Tensor, "record_stream", lambda self, stream: None)


# ------------------------------------------------------------------------------------------------------ W2b


def _w2b_numpy_split_sizes() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                return tensor.numpy()
        return tensor

    _patch(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


# ------------------------------------------------------------------------------------------------------- W3

_CPU = torch.device("cpu")

#: Tensor factories of the `torch` namespace that take `device=` (every one Megatron 0.19.2 calls, and kin).
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "asarray", "arange", "range", "linspace",
              "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_like", "zeros_like", "ones_like",
              "full_like", "rand_like", "randn_like", "randint_like", "empty_strided", "scalar_tensor",
              "tril_indices", "triu_indices", "sparse_coo_tensor")
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided")


def _to_cpu_device(device):
    """Map a CUDA device spec (str, torch.device, int index) to CPU; anything else unchanged."""
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a bare int device is a CUDA index
    return device


def _device_kwarg_to_cpu(fn):
    """`fn` with a CUDA `device=` keyword rewritten to CPU (the factories take the device by keyword only)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = _to_cpu_device(device)
        return fn(*args, **kwargs)

    wrapped.__megatron_cpu_w3__ = fn
    return wrapped


def _tensor_to(original):
    """`Tensor.to` with a CUDA device (positional `to(device, ...)` or `device=`) rewritten to CPU."""

    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)):
            args = (_to_cpu_device(args[0]),) + args[1:]
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = _to_cpu_device(device)
        return original(self, *args, **kwargs)

    to.__megatron_cpu_w3__ = original
    return to


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _w3_cpu_devices() -> None:
    _patch(torch.cuda, "current_device", lambda: 0)
    _patch(torch.cuda, "set_device", lambda device: None)
    for name in _FACTORIES:
        _patch(torch, name, _device_kwarg_to_cpu(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        _patch(torch.Tensor, name, _device_kwarg_to_cpu(getattr(torch.Tensor, name)))
    _patch(torch.Tensor, "to", _tensor_to(torch.Tensor.to))
    _patch(torch.Tensor, "cuda", _tensor_cuda)


# ------------------------------------------------------------------------------------------------------- W4


class SequenceParallelRMSNorm(torch.nn.Module):
    """RMSNorm (`F.rms_norm`) whose weight is flagged `sequence_parallel` for the TP grad all-reduce."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        setattr(self.weight, "sequence_parallel", sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _w4_sequence_parallel_norm() -> None:
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        if config.sequence_parallel and config.normalization == "RMSNorm":
            norm = SequenceParallelRMSNorm(hidden_size, eps, sequence_parallel=True)
            return norm.to(config.params_dtype)
        return original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                            normalization)

    _patch(torch_norm.WrappedTorchNorm, "__new__", new)


# ------------------------------------------------------------------------------------------------------- W5

_original_type = torch.Tensor.type


def _type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and not non_blocking:
        name = _original_type(self)
        if name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name
    return _original_type(self, dtype, non_blocking, **kwargs)


def _w5_tensor_type_names() -> None:
    _patch(torch.Tensor, "type", _type)


# ------------------------------------------------------------------------------------------------------- W6


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """`megatron.core.utils.local_multi_tensor_l2_norm` without a host read per tensor: the per-tensor norms from
    `torch._foreach_norm` (the same `linalg_vector_norm` per tensor), stacked to the same [lists, tensors] shape
    that `torch.tensor(l2)` built, and the same norm of them."""
    if not all(tensor_lists):  # torch.tensor([[]]) is a [1, 0] tensor; keep Megatron's own code for that case
        from megatron.core.utils import local_multi_tensor_l2_norm

        return local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
    norms = torch.stack([torch.stack(torch._foreach_norm(tl)) for tl in tensor_lists])
    l2_reduced = torch.norm(norms)
    return torch.tensor([float(l2_reduced)], dtype=torch.float, device="cuda"), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """`megatron.core.utils.local_multi_tensor_scale` (dst = src * scale) as one `torch._foreach_mul_` when every
    dst is its src (the grad clip's in-place case); otherwise Megatron's loop."""
    src, dst = tensor_lists
    if len(src) == len(dst) and all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    from megatron.core.utils import local_multi_tensor_scale

    local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale)


def _w6_foreach_grad_norm_and_scale() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        _patch(clip_grads, "l2_norm_impl", foreach_l2_norm)
    if clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        _patch(clip_grads, "multi_tensor_scale_impl", foreach_scale)
