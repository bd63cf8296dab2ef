"""Third-party start-up noise, filtered where it is raised: Python warnings and loggers of the packages beamrl
runs on (Megatron's "Transformer Engine and Apex are not installed" notices, deprecation notices, ...).

`quiet(verbose)` runs in the driver (`beamrl train`) and, through Ray's `worker_process_setup_hook`, in every Ray
worker before it imports anything of the run. By default these warnings are hidden and the packages' loggers show
errors only; with `verbose` (`beamrl train --verbose`) every warning is shown, each message once per process,
and the loggers keep their own levels. beamrl's own warnings and a user's reward code are never filtered.

When stdout is not a terminal, Ray's log prefixes carry no colour codes (`plain_ray_output`).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Packages whose warnings and log records are start-up noise for a beamrl user. Matched against the module a
# warning is attributed to (and the logger name), so a warning pointing at beamrl's own code stays visible.
NOISY_PACKAGES = ("megatron", "torch", "transformers", "tokenizers", "sglang", "ray", "datasets",
                  "huggingface_hub", "triton", "apex", "transformer_engine", "pydantic", "numpy", "safetensors",
                  "accelerate", "flashinfer", "vllm", "pkg_resources", "setuptools", "google", "grpc")


def quiet(verbose: bool = False) -> None:
    """Install the filters in this process (idempotent)."""
    if verbose:  # Python's "once" is per calling module: Megatron raises the same notice from four modules
        _show_each_message_once()
        return
    for package in NOISY_PACKAGES:
        warnings.filterwarnings("ignore", module=rf"{package}(\.|$)")
        logging.getLogger(package).setLevel(logging.ERROR)
    # Settings these packages read when imported: transformers resets its logger's level when it first logs, and
    # datasets / huggingface_hub draw progress bars ("Generating train split: ...") on stderr.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _show_each_message_once() -> None:
    show = warnings.showwarning
    if getattr(show, "beamrl_once", False):
        return
    seen: set[tuple[str, type]] = set()

    def show_once(message, category, filename, lineno, file=None, line=None):
        key = (str(message), category)
        if key not in seen:
            seen.add(key)
            show(message, category, filename, lineno, file, line)

    show_once.beamrl_once = True
    warnings.showwarning = show_once


def quiet_worker() -> None:
    """Ray `worker_process_setup_hook` of a run without --verbose."""
    quiet(verbose=False)


def verbose_worker() -> None:
    """Ray `worker_process_setup_hook` of a run with --verbose."""
    quiet(verbose=True)


def worker_runtime_env(verbose: bool) -> dict:
    """The Ray `runtime_env` that installs the same filters in every worker process of the run."""
    hook = verbose_worker if verbose else quiet_worker
    return {"worker_process_setup_hook": f"{__name__}.{hook.__name__}"}


def plain_ray_output(stream=None) -> None:
    """No ANSI colour codes in Ray's worker-log prefixes (and its "[repeated Nx]" notes) when `stream` (stdout)
    is not a terminal. Must run before Ray is imported (Ray reads its dedup setting at import)."""
    stream = stream or sys.stdout
    if not stream.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # its "[repeated Nx across cluster]" note is always coloured
