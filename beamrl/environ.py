"""Environment variables set for one scope (a child process that reads them at start), then restored."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set `values` in `os.environ` inside the `with` block; afterwards every key has its old value again (or is
    unset if it was unset). For launching processes that read their settings from the environment."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
