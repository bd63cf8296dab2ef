"""Run beamrl's Triton kernels on Triton's CPU interpreter for the tests that ask for it (no GPU).

`TRITON_INTERPRET` is Triton's own switch. It is read by `@triton.jit` when a function is decorated (an
interpreted function, or a GPU one) and by `beamrl.kernels` at launch (`triton_interpret_enabled`). So:
- Triton's own library (`tl.zeros`, `tl.sum`, ... are `@triton.jit` functions) must be decorated under the
  switch: `import_triton_interpreted()` imports triton once with it on (tests/conftest.py, CPU only), then
  switches it off again;
- `interpreted_kernels()` sets the variable for the duration of one test only, and re-imports every loaded
  `beamrl.kernels` module whose kernels were decorated without it (e.g. imported while another test module was
  collected).
The variable is thus never on for the whole session, nor inherited by the subprocesses of other tests.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "TRITON_INTERPRET"


def import_triton_interpreted() -> None:
    """Import triton with the switch on (its library then runs on the interpreter), leaving the switch as it was.
    Raises if triton was already imported without it: its library would stay GPU-compiled."""
    if "triton" in sys.modules:
        from triton.runtime.jit import JITFunction
        from triton.language import standard

        if isinstance(standard.zeros, JITFunction):
            raise RuntimeError("triton was imported before tests/conftest.py without TRITON_INTERPRET=1: its "
                               "library is GPU-compiled and the CPU kernel tests cannot run")
        return
    before = os.environ.get(ENV)
    os.environ[ENV] = "1"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    finally:
        _restore(before)


def _restore(before: str | None) -> None:
    if before is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = before


def _compiled_kernel_modules() -> list[str]:
    """Loaded `beamrl.kernels` modules that hold a GPU-compiled `@triton.jit` function (their own or imported)."""
    if "triton" not in sys.modules:
        return []
    from triton.runtime.jit import JITFunction

    names = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "beamrl.kernels" or name.startswith("beamrl.kernels.")):
            continue
        if any(isinstance(v, JITFunction) for v in vars(module).values()):
            names.append(name)
    return names


def reimport_interpreted() -> None:
    """Reload (in place) every loaded kernel module decorated without the interpreter; `ENV` must be set.
    Shared helpers first, and repeated until no module still holds a compiled function through an import."""
    for _ in range(3):
        stale = sorted(_compiled_kernel_modules(), key=lambda n: (not n.endswith("_triton_utils"), n))
        if not stale:
            return
        for name in stale:
            importlib.reload(sys.modules[name])
    raise RuntimeError(f"kernel modules still hold GPU-compiled Triton functions: {_compiled_kernel_modules()}")


@contextmanager
def interpreted_kernels() -> Iterator[None]:
    """TRITON_INTERPRET=1 inside the block (restored after), with every loaded kernel module interpreted."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "1"
    try:
        reimport_interpreted()
        yield
    finally:
        _restore(before)
