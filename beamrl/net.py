"""Small network helpers shared by the trainer launcher, the weight-update group and the Ray driver."""

from __future__ import annotations

import socket


class PortReservation:
    """A TCP port held for a server that another process (or a later call) will start.

    Asking the OS for a free port and closing it again (bind to 0, read, close) leaves a window in which any
    other process can take the port before the server binds it; on a loaded machine running many tests that
    happens. A reservation instead keeps a socket bound to the port, with SO_REUSEADDR and without listening:
    while it is held the OS never hands the port to anyone else, yet a server that binds with SO_REUSEADDR
    (torch's TCPStore, uvicorn, SGLang's port checks, ZMQ) can bind and listen on it. Release it (`close()`,
    or leave the `with` block) once the server is up. Linux semantics; it is what the CPU suite and the
    GPU nodes run.

    Example:
        >>> with reserve_port() as reserved:
        ...     start_server(port=reserved.port)  # doctest: +SKIP
    """

    def __init__(self, address: str = "127.0.0.1") -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((address, 0))
        except BaseException:
            self._sock.close()
            raise
        self.address = address
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        """Release the port (idempotent)."""
        self._sock.close()

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reserve_port(address: str = "127.0.0.1") -> PortReservation:
    """A free TCP port on `address`, held until the reservation is closed (see `PortReservation`)."""
    return PortReservation(address)
