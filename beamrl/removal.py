"""Deleting a folder tree without hiding what could not be deleted (a full disk is found late, and far away)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def remove_tree(path: str | Path) -> list[tuple[str, BaseException]]:
    """Delete `path` and everything under it (nothing if it does not exist); returns what could not be deleted,
    (entry, error) in the order met, for the caller to say."""
    if not os.path.lexists(path):
        return []
    if os.path.islink(path) or not os.path.isdir(path):  # rmtree refuses links and files: remove the entry itself
        try:
            os.unlink(path)
            return []
        except OSError as exc:
            return [(str(path), exc)]
    errors: list[tuple[str, BaseException]] = []
    if sys.version_info >= (3, 12):  # `onerror` is deprecated there
        shutil.rmtree(path, onexc=lambda _fn, target, exc: errors.append((target, exc)))
    else:
        shutil.rmtree(path, onerror=lambda _fn, target, info: errors.append((target, info[1])))
    return errors


def undeleted_line(path: str | Path, errors: list[tuple[str, BaseException]]) -> str:
    """One line about `remove_tree(path)`'s errors: the first, and how many more."""
    target, exc = errors[0]
    more = f" (and {len(errors) - 1} more files or folders)" if len(errors) > 1 else ""
    return f"could not delete {path}: {target}: {exc}{more}"
