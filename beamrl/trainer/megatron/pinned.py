"""Page-locked host memory of exactly the size asked for, shared by the trainer's sleep (`sleep.py`) and its
checkpoint staging (`checkpoint/storage.py`): both keep a host copy of a rank's device state for the run's lifetime.

torch's pinned caching allocator (`pin_memory=True`) rounds every block up to a power of two, which can cost up to
twice that state in host memory. Registering a plain host allocation of the exact size with CUDA does not.
"""

from __future__ import annotations

import mmap
import sys
import weakref

import torch

_warned = False


def pinned_host(nbytes: int, fork_shared: bool = False) -> torch.Tensor:
    """A uint8 host tensor of exactly `nbytes`, registered with CUDA (unregistered before its memory is freed).
    Views of it keep the memory alive but not the registration: keep this tensor itself for as long as it is used.
    If registration is unavailable, torch's pinned caching allocator is used (said once on stderr).

    `fork_shared`: back it with a shared anonymous mapping, for buffers a forked child reads (the checkpoint
    writer). Linux copies page-locked private pages into the child at `fork` (they cannot be copy-on-write): on the
    H200 that made the async save's fork take 8 s for 27.65 GB of staged state; shared pages are not copied."""
    global _warned
    if fork_shared and nbytes > 0:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        host = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    else:
        host = torch.empty(nbytes, dtype=torch.uint8)
    try:
        from torch.cuda._pin_memory_utils import pin_memory, unpin_memory  # torch's own helpers (FSDP, DCP)

        pin_memory(host.data_ptr(), nbytes)
    except (ImportError, RuntimeError, AttributeError) as e:
        if not _warned:
            _warned = True
            print(f"[beamrl] cannot register host memory with CUDA ({type(e).__name__}: {e}); using torch's pinned "
                  f"allocator (blocks rounded up to powers of two)", file=sys.stderr, flush=True)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(host, unpin_memory, host.data_ptr())
    return host
