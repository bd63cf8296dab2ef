"""Small network helpers shared by the trainer launcher, the weight-update group and the Ray driver."""

from __future__ import annotations

import socket


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `address` (bind to port 0 and read it back). Another process
    can take it before the caller binds it; callers that host a store retry or fail loudly on bind errors."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]
