"""Suite-wide test settings: CPU only, deterministic, no compile, quiet third-party logs."""

import os
import shutil

# Megatron's jit_fuser becomes torch.compile; the first compile of a tiny op costs seconds on CI.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("BEAMRL_TEST_THREADS", "2")))


@pytest.fixture(scope="module")
def ray_temp_dir():
    """A short folder for a Ray cluster, as `beamrl train` makes one (`ray_start.new_temp_dir`: pytest's own folders
    can be too deep for Ray's socket paths); removed after the module."""
    from beamrl.cluster.ray_start import new_temp_dir

    path = new_temp_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tiny_config():
    from beamrl.models.beam import preset

    return preset("tiny")


# ------------------------------------------------------------------------ process-wide switches, scoped
# Two switches change the whole test process: Triton's interpreter (TRITON_INTERPRET, inherited by every
# subprocess) and the Megatron CPU compatibility layer (it redirects every CUDA call of torch). Tests ask for
# them with these fixtures, which undo them afterwards; `_no_leaked_switches` fails a test that leaves either on.

from beamrl.compat import megatron_cpu  # noqa: E402
from tests.triton_interpreter import (  # noqa: E402
    ENV as TRITON_INTERPRET,
    import_triton_interpreted,
    interpreted_kernels,
)

_TRITON_INTERPRET_AT_START = os.environ.get(TRITON_INTERPRET)
if not torch.cuda.is_available():
    import_triton_interpreted()  # Triton's own library on the interpreter; the switch itself stays off


@pytest.fixture
def triton_interpreter():
    """Triton kernels on the CPU interpreter for this test (on a CUDA machine the real kernels run)."""
    if torch.cuda.is_available():
        yield False
        return
    with interpreted_kernels():
        yield True


@pytest.fixture(scope="module")
def megatron_cpu_shim():
    """`beamrl.compat.megatron_cpu` active for one test module (in-process Megatron), undone after it, with the
    Megatron groups and the default process group the module created."""
    import torch.distributed as dist

    if torch.cuda.is_available():  # the compat layer refuses to activate there (it would redirect every CUDA call)
        pytest.skip("CPU-only: in-process Megatron through beamrl.compat.megatron_cpu, which never runs where CUDA is")
    had_group = dist.is_initialized()
    megatron_cpu.activate()
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized() and not had_group:
        dist.destroy_process_group()
    megatron_cpu.deactivate()


@pytest.fixture(autouse=True)
def _no_leaked_switches(request):
    yield
    if "megatron_cpu_shim" not in request.fixturenames and megatron_cpu.is_active():
        megatron_cpu.deactivate()  # so that only this test fails
        pytest.fail(f"{request.node.nodeid} left beamrl.compat.megatron_cpu active: use the megatron_cpu_shim fixture")
    now = os.environ.get(TRITON_INTERPRET)
    if now != _TRITON_INTERPRET_AT_START:
        if _TRITON_INTERPRET_AT_START is None:
            os.environ.pop(TRITON_INTERPRET, None)
        else:
            os.environ[TRITON_INTERPRET] = _TRITON_INTERPRET_AT_START
        pytest.fail(f"{request.node.nodeid} left {TRITON_INTERPRET}={now!r} (was {_TRITON_INTERPRET_AT_START!r}): "
                    f"use the triton_interpreter fixture")


def pytest_sessionfinish(session, exitstatus):
    """End every ZMQ context still open (in-process SGLang engines' tokenizer managers), dropping unsent messages.
    Finalized later by pytest's last `gc.collect()`, a context with a message queued for a scheduler that a test
    killed waits forever to deliver it, and the suite never exits (seen after a full run: `zmq_ctx_term` in a
    `__del__` under `gc.collect`). `SGLangEngine.shutdown` closes its own; this covers engines a test dropped."""
    import gc
    import sys

    if "zmq" not in sys.modules:
        return
    import zmq

    for obj in gc.get_objects():
        if isinstance(obj, zmq.Context) and not obj.closed:
            obj.destroy(linger=0)
